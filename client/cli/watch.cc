// weightctl watch: one line per event of a model name until Ctrl-C or
// SIGTERM (exit 0); exit 1 when the daemon goes away or stops, 2 when it
// refuses the watch.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <ostream>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "nlohmann/json.hpp"
#include "weightd/client.h"

namespace weightd::cli {
namespace {

std::atomic<bool> stop_requested{false};

extern "C" void RequestStop(int) { stop_requested = true; }

// SIGINT and SIGTERM set stop_requested while this lives; the previous
// handlers come back after.
class StopSignals {
 public:
  StopSignals() {
    stop_requested = false;
    struct sigaction action = {};
    action.sa_handler = RequestStop;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ = {}, old_term_ = {};
};

// Cancels `watch` once a stop is requested; polls, since a signal handler
// may do nothing else. Stops polling when destroyed.
class CancelOnStop {
 public:
  explicit CancelOnStop(ModelWatch& watch)
      : thread_([this, &watch] {
          absl::MutexLock lock(&mu_);
          while (!mu_.AwaitWithTimeout(absl::Condition(&done_), absl::Milliseconds(20))) {
            if (stop_requested) watch.Cancel();
          }
        }) {}
  ~CancelOnStop() {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    thread_.join();
  }

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

std::string TimeText(double unix_seconds) {
  absl::Time t = absl::UnixEpoch() + absl::Microseconds(static_cast<int64_t>(unix_seconds * 1e6));
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", t, absl::UTCTimeZone());
}

std::string OrDash(const std::string& s) { return s.empty() ? "-" : absl::CEscape(s); }

void Print(const WatchEvent& e, bool as_json, std::ostream& out) {
  if (as_json) {
    out << nlohmann::json{{"time", e.time},
                          {"kind", e.kind},
                          {"model", e.model},
                          {"generation", e.generation},
                          {"version_label", e.version_label},
                          {"fingerprint", e.fingerprint},
                          {"layout", e.layout},
                          {"rank", e.rank}}
               .dump()
        << "\n";
  } else if (!e.layout.empty()) {
    out << absl::StrFormat("%s %-9s %s generation %d layout %s rank %d fingerprint %s\n", TimeText(e.time), e.kind,
                           e.model, e.generation, absl::CEscape(e.layout), e.rank, OrDash(e.fingerprint));
  } else {
    out << absl::StrFormat("%s %-9s %s generation %d version_label %s fingerprint %s\n", TimeText(e.time), e.kind,
                           e.model, e.generation, OrDash(e.version_label), OrDash(e.fingerprint));
  }
  out.flush();  // a line as it happens, also into a pipe
}

}  // namespace

int RunWatch(const Args& args, Context& ctx) {
  StopSignals signals;
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  absl::StatusOr<ModelWatch> watch = (*client)->Watch(args.positional[0]);
  if (!watch.ok()) return stop_requested ? kExitOk : ReportError(watch.status(), ctx.err);
  absl::Status ended;
  {
    CancelOnStop canceller(*watch);
    while (true) {
      absl::StatusOr<WatchEvent> event = watch->Next();
      if (!event.ok()) {
        ended = event.status();
        break;
      }
      Print(*event, args.Flag("--json"), ctx.out);
    }
  }
  if (stop_requested) return kExitOk;
  return ReportError(ended, ctx.err);
}

}  // namespace weightd::cli
