// weightctl commands that talk to the daemon: load, ls, manifest, unload.
#include <ostream>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "common/format/shape.h"
#include "nlohmann/json.hpp"
#include "weightd/client.h"

namespace weightd::cli {
namespace {

using json = nlohmann::json;

uint64_t DeviceTotal(const ModelSummary& m) {
  uint64_t total = 0;
  for (const auto& [uuid, bytes] : m.device_bytes) total += bytes;
  return total;
}

json SummaryJson(const ModelSummary& m) {
  return {{"name", m.name},
          {"generation", m.generation},
          {"state", m.state},
          {"host_bytes", m.host_bytes},
          {"locked_bytes", m.locked_bytes},
          {"huge_page_bytes", m.huge_page_bytes},
          {"device_bytes", m.device_bytes},
          {"leases", m.leases},
          {"fingerprint", m.fingerprint},
          {"version_label", m.version_label},
          {"source", m.source},
          {"numa_nodes", m.numa_nodes},
          {"tensor_count", m.tensor_count},
          {"tp_size", m.tp_size},
          {"checkpoint_path", m.checkpoint_path},
          {"checkpoint_bytes", m.checkpoint_bytes}};
}

absl::StatusOr<LoadOptions> ParseLoadOptions(const Args& args) {
  LoadOptions options;
  options.host_resident_patterns = args.List("--host-resident");
  options.include_patterns = args.List("--include");
  options.exclude_patterns = args.List("--exclude");
  options.numa_copies = args.Flag("--numa-copies");
  options.tp_size = static_cast<uint32_t>(args.Int("--tp-size"));
  for (const std::string& rule : args.List("--tp-rule")) {
    size_t colon = rule.rfind(':');
    uint32_t dim;
    if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(rule.substr(colon + 1), &dim)) {
      return absl::InvalidArgumentError(absl::StrCat("--tp-rule must be PATTERN:DIM, got '", rule, "'"));
    }
    options.tp_rules.emplace_back(rule.substr(0, colon), dim);
  }
  options.peers = args.List("--peer");
  if (std::optional<std::string> devices = args.Text("--devices")) {
    for (absl::string_view d : absl::StrSplit(*devices, ',', absl::SkipEmpty())) options.devices.emplace_back(d);
  }
  return options;
}

}  // namespace

namespace {

// Prints the outcome of a load or reload (`verb`: "loaded", "reloaded").
int ReportLoad(const absl::StatusOr<LoadResult>& result, bool as_json, const char* verb, Context& ctx) {
  if (!result.ok()) return ReportError(result.status(), ctx.err);
  const ModelSummary& m = result->model;
  uint64_t bytes = m.checkpoint_bytes;
  if (!as_json) {
    for (const std::string& w : m.warnings) ctx.err << "weightctl: warning: " << w << "\n";
  }
  double seconds = result->reused ? 0 : m.load_seconds;
  if (as_json) {
    json doc = {{"model", m.name},       {"generation", m.generation}, {"state", m.state},
                {"bytes", bytes},        {"seconds", seconds},         {"fingerprint", m.fingerprint},
                {"reused", result->reused}, {"tensors", m.tensor_count}, {"host_bytes", m.host_bytes},
                {"device_bytes", m.device_bytes}, {"locked_bytes", m.locked_bytes}, {"warnings", m.warnings},
                {"bytes_read", result->bytes_read}, {"bytes_reused", result->bytes_reused},
                {"bytes_shared", m.bytes_shared}, {"source", m.source}};
    ctx.out << doc.dump(2) << "\n";
  } else if (result->reused) {
    ctx.out << absl::StrFormat("'%s' generation %d is already loaded from the same files: reused (fingerprint %s)\n",
                               m.name, m.generation, m.fingerprint);
  } else if (absl::StartsWith(m.source, "peer ")) {
    ctx.out << absl::StrFormat("%s '%s' generation %d: %d tensors, %s in %.3f s (%.2f GB/s), fingerprint %s\n", verb,
                               m.name, m.generation, m.tensor_count, HumanBytes(bytes), seconds,
                               seconds > 0 ? static_cast<double>(m.host_bytes) / seconds / 1e9 : 0.0, m.fingerprint);
    ctx.out << absl::StrFormat("  received %s (%d bytes) of host segments from %s, read %s (%d bytes) from storage\n",
                               HumanBytes(m.host_bytes), m.host_bytes, m.source, HumanBytes(result->bytes_read),
                               result->bytes_read);
  } else {
    uint64_t read = result->bytes_read;
    ctx.out << absl::StrFormat("%s '%s' generation %d: %d tensors, %s in %.3f s (%.2f GB/s), fingerprint %s\n", verb,
                               m.name, m.generation, m.tensor_count, HumanBytes(bytes), seconds,
                               seconds > 0 ? static_cast<double>(read) / seconds / 1e9 : 0.0, m.fingerprint);
    ctx.out << absl::StrFormat("  read %s (%d bytes) from storage, reused %s (%d bytes) of unchanged files\n",
                               HumanBytes(read), read, HumanBytes(result->bytes_reused), result->bytes_reused);
  }
  return kExitOk;
}

}  // namespace

int RunLoad(const Args& args, Context& ctx) {
  absl::StatusOr<LoadOptions> options = ParseLoadOptions(args);
  if (!options.ok()) return ReportError(options.status(), ctx.err);
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  bool as_json = args.Flag("--json");
  ProgressBar bar("load", !as_json);
  absl::StatusOr<LoadResult> result =
      (*client)->Load(args.positional[0], args.positional[1], *options,
                      [&](const LoadProgressInfo& p) { bar.Update(p.bytes_done, p.bytes_total); });
  bar.Finish();
  return ReportLoad(result, as_json, "loaded", ctx);
}

int RunReload(const Args& args, Context& ctx) {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  bool as_json = args.Flag("--json");
  ProgressBar bar("reload", !as_json);
  std::string path = args.positional.size() > 1 ? args.positional[1] : "";
  absl::StatusOr<LoadResult> result = (*client)->Reload(
      args.positional[0], path, [&](const LoadProgressInfo& p) { bar.Update(p.bytes_done, p.bytes_total); });
  bar.Finish();
  return ReportLoad(result, as_json, "reloaded", ctx);
}

int RunList(const Args& args, Context& ctx) {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  absl::StatusOr<Client::DaemonState> daemon = (*client)->Daemon();
  if (!daemon.ok()) return ReportError(daemon.status(), ctx.err);
  const std::vector<ModelSummary>* models = &daemon->models;
  if (args.Flag("--json")) {
    json list = json::array();
    for (const ModelSummary& m : *models) {
      json entry = SummaryJson(m);
      entry["device_bytes"] = DeviceTotal(m);
      entry["device_bytes_by_gpu"] = m.device_bytes;
      entry["bytes_done"] = m.bytes_done;
      entry["bytes_total"] = m.bytes_total;
      entry["error"] = m.error;
      list.push_back(entry);
    }
    ctx.out << json{{"daemon_instance", daemon->instance}, {"models", list}}.dump(2) << "\n";
    return kExitOk;
  }
  ctx.out << absl::StrFormat("%-24s %5s %-9s %12s %12s %12s %6s  %-16s %-24s %s\n", "NAME", "GEN", "STATE", "HOST",
                             "HUGE PAGES", "DEVICE", "LEASES", "LABEL", "SOURCE", "FINGERPRINT");
  for (const ModelSummary& m : *models) {
    std::string last = m.fingerprint;  // a LOADING or FAILED entry has none: its progress or error instead
    if (m.state == "LOADING") last = absl::StrCat(HumanBytes(m.bytes_done), " of ", HumanBytes(m.bytes_total), " read");
    if (m.state == "FAILED") last = m.error;
    std::string label = m.version_label.empty() ? "-" : absl::CEscape(m.version_label);
    std::string source = m.source.empty() ? "-" : absl::CEscape(m.source);
    ctx.out << absl::StrFormat("%-24s %5d %-9s %12s %12s %12s %6d  %-16s %-24s %s\n", m.name, m.generation, m.state,
                               HumanBytes(m.host_bytes), HumanBytes(m.huge_page_bytes), HumanBytes(DeviceTotal(m)),
                               m.leases, label, source, last);
  }
  return kExitOk;
}

int RunManifest(const Args& args, Context& ctx) {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  absl::StatusOr<Manifest> manifest = (*client)->GetManifest(args.positional[0], static_cast<uint32_t>(args.Int("--rank")));
  if (!manifest.ok()) return ReportError(manifest.status(), ctx.err);
  auto placement = [](Location l) { return l == Location::kHost ? "host" : "device"; };
  if (args.Flag("--json")) {
    json tensors = json::array();
    for (const TensorInfo& t : manifest->tensors) {
      tensors.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"placement", placement(t.location)},
                         {"segment", t.segment}, {"offset", t.offset}, {"nbytes", t.nbytes},
                         {"full_shape", t.full_shape}, {"split_dim", t.split_dim}, {"split_start", t.split_start},
                         {"content_hash", t.content_hash}});
    }
    json segments = json::array();
    for (const SegmentInfo& s : manifest->segments) {
      segments.push_back({{"placement", placement(s.location)}, {"size", s.size}, {"backend", s.backend},
                          {"gpu_uuid", s.gpu_uuid}});
    }
    ctx.out << json{{"model", manifest->model},
                    {"rank", manifest->rank},
                    {"generation", manifest->generation},
                    {"fingerprint", manifest->fingerprint},
                    {"version_label", manifest->version_label},
                    {"segments", segments},
                    {"tensors", tensors}}
                   .dump(2)
            << "\n";
    return kExitOk;
  }
  ctx.out << absl::StrFormat("%-48s %-6s %-16s %-7s %3s %12s %12s  %-16s %s\n", "NAME", "DTYPE", "SHAPE", "PLACE", "SEG",
                             "OFFSET", "BYTES", "FULL_SHAPE", "SPLIT");
  for (const TensorInfo& t : manifest->tensors) {
    std::string split = t.split_dim < 0 ? "-" : absl::StrFormat("dim %d from %d", t.split_dim, t.split_start);
    ctx.out << absl::StrFormat("%-48s %-6s %-16s %-7s %3d %12d %12d  %-16s %s\n", t.name, t.dtype,
                               ShapeString(t.shape), placement(t.location), t.segment, t.offset,
                               t.nbytes, ShapeString(t.full_shape), split);
  }
  ctx.out << absl::StrFormat("%d tensors, %d segment(s), rank %d of '%s' generation %d\n", manifest->tensors.size(),
                             manifest->segments.size(), manifest->rank, manifest->model, manifest->generation);
  return kExitOk;
}

int RunUnload(const Args& args, Context& ctx) {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  auto result = (*client)->Unload(args.positional[0], args.Flag("--force"));
  if (!result.ok()) return ReportError(result.status(), ctx.err);
  const auto& [m, freed] = *result;
  if (freed) {
    ctx.out << absl::StrFormat("unloaded '%s' generation %d: freed\n", m.name, m.generation);
  } else {
    ctx.out << absl::StrFormat("unloaded '%s' generation %d: DRAINING until its %d lease(s) end\n", m.name,
                               m.generation, m.leases);
  }
  return kExitOk;
}

}  // namespace weightd::cli
