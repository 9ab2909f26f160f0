// weightd: the per-node weight-serving daemon. See `weightd --help`.
#include <signal.h>
#include <sys/resource.h>

#include <iostream>

#include "common/base/log.h"
#include "server/config.h"
#include "server/daemon.h"

namespace {

// Every connection, lease and segment costs a descriptor, and running out
// wedges listeners: take the whole hard limit the service manager allows
// (LimitNOFILE=), as systemd's own default soft limit of 1024 is too low.
void RaiseFdLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
    weightd::LogInfo("raised the open-file limit (RLIMIT_NOFILE) from " + std::to_string(before) + " to " +
                     std::to_string(limit.rlim_max));
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<weightd::ParsedArgs> args = weightd::ParseDaemonArgs(std::vector<std::string>(argv + 1, argv + argc));
  if (!args.ok()) {
    std::cerr << "weightd: " << args.status().message() << "\n";
    return 2;
  }
  if (args->help) return std::cout << weightd::DaemonUsage(), 0;
  if (args->version) return std::cout << "weightd " << WEIGHTD_VERSION << "\n", 0;
  if (args->print_config) return std::cout << weightd::ConfigToJson(args->config).dump(2) << "\n", 0;

  // SIGTERM/SIGINT are taken synchronously by this thread; every thread the
  // daemon starts inherits the blocked mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  RaiseFdLimit();
  absl::StatusOr<std::unique_ptr<weightd::Daemon>> daemon = weightd::Daemon::Start(args->config);
  if (!daemon.ok()) {
    weightd::LogError(daemon.status().message());
    return 1;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  weightd::LogInfo(sig == SIGTERM ? "SIGTERM: shutting down" : "SIGINT: shutting down");
  (*daemon)->Shutdown();
  return 0;
}
