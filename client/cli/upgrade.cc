// weightctl upgrade: the daemon re-executes its binary and keeps every
// READY model (UpgradeDaemon; docs/operations.md "Restart, upgrade and crash").
#include <chrono>
#include <ostream>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "nlohmann/json.hpp"
#include "weightd/client.h"

namespace weightd::cli {

int RunUpgrade(const Args& args, Context& ctx) {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<UpgradeInfo> started = (*client)->UpgradeDaemon();
  if (!started.ok()) return ReportError(started.status(), ctx.err);
  // Back when another instance answers; until then calls fail (UNAVAILABLE)
  // and the client reconnects on the next one.
  auto deadline = start + std::chrono::duration<double>(args.Number("--timeout"));
  absl::StatusOr<Client::DaemonState> state = absl::UnavailableError("not asked yet");
  while (std::chrono::steady_clock::now() < deadline) {
    state = (*client)->Daemon();
    if (state.ok() && state->instance != started->daemon_instance) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!state.ok() || state->instance == started->daemon_instance) {
    return ReportError(absl::DeadlineExceededError(absl::StrFormat(
                           "the daemon did not come back within %.0f s of the upgrade to %s (see its log)",
                           args.Number("--timeout"), started->binary)),
                       ctx.err);
  }
  if (!state->last_upgrade_error.empty()) {
    // Back, but on the old binary: the upgrade itself did not happen.
    return ReportError(absl::AbortedError(absl::StrCat("the upgrade to ", started->binary, " failed (",
                                                       state->last_upgrade_error,
                                                       "); the daemon is serving again on its running binary")),
                       ctx.err);
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  absl::StatusOr<std::vector<ModelSummary>> models = (*client)->List();
  if (!models.ok()) return ReportError(models.status(), ctx.err);
  std::vector<std::string> ready;
  nlohmann::json list = nlohmann::json::array();
  for (const ModelSummary& m : *models) {
    if (m.state != "READY") continue;
    ready.push_back(m.name);
    list.push_back({{"name", m.name}, {"generation", m.generation}, {"fingerprint", m.fingerprint}});
  }
  if (args.Flag("--json")) {
    ctx.out << nlohmann::json{{"binary", started->binary},       {"seconds", seconds},
                              {"daemon_instance", state->instance},   {"models_handed_over", started->models},
                              {"models", list}}
                   .dump(2)
            << "\n";
    return kExitOk;
  }
  ctx.out << absl::StrFormat("upgraded in place to %s in %.2f s: %d of %d READY models kept (%s)\n", started->binary,
                             seconds, ready.size(), started->models, absl::StrJoin(ready, ", "));
  return kExitOk;
}

}  // namespace weightd::cli
