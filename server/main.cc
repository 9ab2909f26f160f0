// weightd: the per-node weight-serving daemon. See `weightd --help`.
#include <signal.h>
#include <sys/resource.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "server/config/config.h"
#include "server/daemon.h"
#include "server/restart/fd_store.h"
#include "server/restart/upgrade.h"

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
  // Before anything is opened: LISTEN_FDS and WEIGHTD_HANDOFF_FD name fd
  // numbers, and only now can every such number be nothing but inherited.
  std::vector<weightd::NamedFd> inherited = weightd::TakeListenFds();
  absl::StatusOr<weightd::ParsedArgs> args = weightd::ParseDaemonArgs(std::vector<std::string>(argv + 1, argv + argc));
  if (!args.ok()) {
    std::cerr << "weightd: " << args.status().message() << "\n";
    return 2;
  }
  if (args->help) return std::cout << weightd::DaemonUsage(), 0;
  if (args->version) return std::cout << "weightd " << WEIGHTD_VERSION << "\n", 0;
  if (args->print_config) return std::cout << weightd::ConfigToJson(args->config).dump(2) << "\n", 0;
  if (const std::string& failed = weightd::UpgradeFallbackError(); !failed.empty()) {
    weightd::LogError(absl::StrCat("started again on the running binary: the in-place upgrade failed: ", failed));
  }

  // The binary an in-place upgrade executes: this path, taken now, is the
  // new file once a package manager has replaced it.
  absl::StatusOr<std::string> binary = weightd::SelfBinaryPath();

  // SIGTERM/SIGINT/SIGHUP are taken synchronously by this thread; every
  // thread the daemon starts inherits the blocked mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  RaiseFdLimit();
  absl::StatusOr<std::unique_ptr<weightd::Daemon>> daemon = weightd::Daemon::Start(args->config, std::move(inherited));
  if (!daemon.ok()) {
    weightd::LogError(daemon.status().message());
    return 1;
  }
  int sig = 0;
  absl::StatusOr<weightd::ScopedFd> target = absl::UnavailableError("no upgrade asked");
  for (;;) {
    sigwait(&signals, &sig);
    if (sig != SIGHUP) break;
    // SIGHUP (or UpgradeDaemon): upgrade in place, when the binary allows;
    // the fd checked is the fd executed.
    target = binary.ok() ? weightd::OpenUpgradable(*binary) : binary.status();
    if (target.ok()) break;
    weightd::LogError(absl::StrCat("SIGHUP: ", target.status().message(), "; still serving"));
  }
  if (sig != SIGHUP) {
    weightd::LogInfo(sig == SIGTERM ? "SIGTERM: shutting down" : "SIGINT: shutting down");
    (*daemon)->Shutdown();
    return 0;
  }
  weightd::LogInfo(absl::StrCat("SIGHUP: upgrading in place: stopping, then executing ", *binary));
  (*daemon)->ShutdownForUpgrade();
  std::vector<weightd::NamedFd> fds = (*daemon)->Handoff();
  daemon->reset();  // the copies in `fds` keep every segment alive
  weightd::LogInfo(absl::StrCat("handing ", fds.size(), " fds to the new image"));
  absl::Status exec =
      weightd::ExecUpgrade(std::move(*target), *binary, std::vector<std::string>(argv, argv + argc), std::move(fds));
  weightd::LogError(absl::StrCat("in-place upgrade failed: ", exec.message()));
  return 1;
}
