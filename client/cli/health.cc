// weightctl health [MODEL]: the daemon's standard gRPC health check, for
// scripts and probes. Exit 0 when SERVING, 1 when NOT_SERVING or
// SERVICE_UNKNOWN (with a line on stderr), 2 for bad input; the status goes
// to stdout either way.
#include <ostream>

#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "nlohmann/json.hpp"
#include "weightd/client.h"

namespace weightd::cli {

int RunHealth(const Args& args, Context& ctx) {
  std::string service = args.positional.empty() ? "" : args.positional[0];
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  absl::StatusOr<std::string> status = (*client)->Health(service);
  if (!status.ok()) return ReportError(status.status(), ctx.err);
  if (args.Flag("--json")) {
    ctx.out << nlohmann::json{{"service", service}, {"status", *status}}.dump() << "\n";
  } else {
    ctx.out << *status << "\n";
  }
  if (*status == "SERVING") return kExitOk;
  ctx.err << "weightctl: " << (service.empty() ? "the daemon" : "model '" + service + "'") << " is " << *status << "\n";
  return kExitFailure;
}

}  // namespace weightd::cli
