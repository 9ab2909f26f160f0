#include <map>
#include <ostream>

#include "absl/strings/str_format.h"
#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "common/format/catalog.h"
#include "common/format/shape.h"
#include "nlohmann/json.hpp"

namespace weightd::cli {
namespace {

using json = nlohmann::json;

json CatalogJson(const Catalog& catalog) {
  json tensors = json::array();
  for (const CatalogTensor& t : catalog.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", DTypeName(t.dtype)},
                       {"shape", t.shape},
                       {"nbytes", t.nbytes},
                       {"file", catalog.files[t.file].name},
                       {"offset", t.offset}});
  }
  json metadata = json::object();
  for (const CatalogFile& f : catalog.files) {
    if (!f.metadata.empty()) metadata[f.name] = f.metadata;
  }
  json files = json::array();
  for (const CatalogFile& f : catalog.files) files.push_back({{"name", f.name}, {"bytes", f.size}});
  return {{"path", catalog.root},       {"tensors", tensors},        {"total_bytes", catalog.total_bytes()},
          {"files", files},             {"metadata", metadata},      {"index_metadata", catalog.index_metadata},
          {"warnings", catalog.warnings}};
}

void PrintTable(const Catalog& catalog, std::ostream& out) {
  out << absl::StrFormat("%-48s %-11s %-20s %12s  %-36s %s\n", "NAME", "DTYPE", "SHAPE", "BYTES", "FILE", "OFFSET");
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;  // dtype -> (tensors, bytes)
  for (const CatalogTensor& t : catalog.tensors) {
    out << absl::StrFormat("%-48s %-11s %-20s %12d  %-36s %d\n", t.name, DTypeName(t.dtype),
                           ShapeString(t.shape), t.nbytes, catalog.files[t.file].name, t.offset);
    auto& [count, bytes] = by_dtype[std::string(DTypeName(t.dtype))];
    ++count;
    bytes += t.nbytes;
  }
  out << "\n";
  for (const auto& [dtype, totals] : by_dtype) {
    out << absl::StrFormat("%-11s %8d tensors %14d bytes (%s)\n", dtype, totals.first, totals.second,
                           HumanBytes(totals.second));
  }
  out << absl::StrFormat("total: %d tensors in %d file(s), %d bytes (%s)\n", catalog.tensors.size(),
                         catalog.files.size(), catalog.total_bytes(), HumanBytes(catalog.total_bytes()));
  for (const std::string& w : catalog.warnings) out << "warning: " << w << "\n";
}

}  // namespace

int RunInspect(const Args& args, Context& ctx) {
  absl::StatusOr<Catalog> catalog = BuildCatalog(args.positional[0]);
  if (!catalog.ok()) return ReportError(catalog.status(), ctx.err);
  if (args.Flag("--json")) {
    ctx.out << CatalogJson(*catalog).dump(2) << "\n";
  } else {
    PrintTable(*catalog, ctx.out);
  }
  return kExitOk;
}

}  // namespace weightd::cli
