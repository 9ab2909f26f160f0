// weightctl layouts and drop-layout: the runtime layouts of a model's
// generations (docs/api.md "Runtime layouts"), and removing one.
#include <ostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "nlohmann/json.hpp"
#include "weightd/client.h"

namespace weightd::cli {
namespace {

using json = nlohmann::json;

json LayoutJson(const LayoutSummary& l) {
  return {{"key", l.key},
          {"rank", l.rank},
          {"generation", l.generation},
          {"tensors", l.tensor_count},
          {"host_bytes", l.host_bytes},
          {"device_bytes", l.device_bytes},
          {"leases", l.leases},
          {"fingerprint", l.fingerprint},
          {"identity", l.identity},
          {"publish_seconds", l.publish_seconds},
          {"published_at", l.published_at}};
}

std::string IdentityText(const std::map<std::string, std::string>& identity) {
  if (identity.empty()) return "-";
  return absl::StrJoin(identity, ",", absl::PairFormatter("="));
}

std::string DeviceText(const std::map<std::string, uint64_t>& device_bytes) {
  if (device_bytes.empty()) return "-";
  std::vector<std::string> parts;
  for (const auto& [uuid, bytes] : device_bytes) parts.push_back(absl::StrCat(uuid, "=", HumanBytes(bytes)));
  return absl::StrJoin(parts, ",");
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> ParseIdentity(const std::vector<std::string>& fields) {
  std::map<std::string, std::string> identity;
  for (const std::string& field : fields) {
    size_t eq = field.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--identity must be KEY=VALUE, got '", field, "'"));
    }
    if (!identity.emplace(field.substr(0, eq), field.substr(eq + 1)).second) {
      return absl::InvalidArgumentError(absl::StrCat("--identity names '", field.substr(0, eq), "' twice"));
    }
  }
  return identity;
}

int RunLayouts(const Args& args, Context& ctx) {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  absl::StatusOr<std::vector<ModelSummary>> models = (*client)->List();
  if (!models.ok()) return ReportError(models.status(), ctx.err);
  const std::string& name = args.positional[0];
  json layouts = json::array();
  bool found = false;
  for (const ModelSummary& m : *models) {
    if (m.name != name) continue;
    found = true;
    for (const LayoutSummary& l : m.layouts) layouts.push_back(LayoutJson(l));
  }
  if (!found) return ReportError(absl::NotFoundError(absl::StrCat("no model named '", name, "'")), ctx.err);
  if (args.Flag("--json")) {
    ctx.out << json{{"model", name}, {"layouts", layouts}}.dump(2) << "\n";
    return kExitOk;
  }
  ctx.out << absl::StrFormat("%-32s %4s %5s %7s %10s %-24s %6s %-32s %s\n", "KEY", "RANK", "GEN", "TENSORS", "HOST",
                             "DEVICE", "LEASES", "FINGERPRINT", "IDENTITY");
  for (const ModelSummary& m : *models) {
    if (m.name != name) continue;
    for (const LayoutSummary& l : m.layouts) {
      ctx.out << absl::StrFormat("%-32s %4d %5d %7d %10s %-24s %6d %-32s %s\n", l.key, l.rank, l.generation,
                                 l.tensor_count, HumanBytes(l.host_bytes), DeviceText(l.device_bytes), l.leases,
                                 l.fingerprint, IdentityText(l.identity));
    }
  }
  return kExitOk;
}

int RunDropLayout(const Args& args, Context& ctx) {
  std::optional<uint32_t> rank;
  if (std::optional<std::string> text = args.Text("--rank")) {
    uint32_t r = 0;
    if (!absl::SimpleAtoi(*text, &r) || r > (1u << 20)) {
      return ReportError(absl::InvalidArgumentError(
                             absl::StrCat("--rank must be an integer in [0, ", 1u << 20, "], got '", *text, "'")),
                         ctx.err);
    }
    rank = r;
  }
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  absl::StatusOr<uint32_t> dropped = (*client)->DropLayout(args.positional[0], args.positional[1], rank);
  if (!dropped.ok()) return ReportError(dropped.status(), ctx.err);
  ctx.out << absl::StrFormat("dropped %d layout(s) '%s' of '%s'%s\n", *dropped, args.positional[1], args.positional[0],
                             rank.has_value() ? absl::StrCat(" rank ", *rank) : "");
  return kExitOk;
}

}  // namespace weightd::cli
