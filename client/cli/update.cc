// weightctl update NAME --from DIR: publishes the tensors of a safetensors
// checkpoint into a served model through the writer path (BeginUpdate,
// write into the staged segments, CommitUpdate), with each tensor's
// expected content hash so the daemon verifies every byte it publishes.
#include <ostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "common/base/status.h"
#include "common/format/catalog.h"
#include "common/format/content_hash.h"
#include "common/format/shape.h"
#include "nlohmann/json.hpp"
#include "weightd/client.h"

namespace weightd::cli {
namespace {

// Copies every checkpoint tensor into its writable view; returns the
// expected hashes. Refuses a dtype or shape that differs from the model's.
absl::StatusOr<std::map<std::string, std::string>> WriteTensors(const Catalog& catalog, Updater& updater) {
  std::map<std::string, std::string> expected;
  for (const CatalogTensor& t : catalog.tensors) {
    WritableTensor* w = updater.Find(t.name);
    if (w == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteName(t.name), " is not writable in this update"));
    }
    const CatalogFile& file = catalog.files[t.file];
    if (w->info.dtype != DTypeName(t.dtype) || w->info.full_shape != t.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          ElideName(file.name), ": tensor ", QuoteName(t.name), " is ", DTypeName(t.dtype), " ", ShapeString(t.shape),
          " but the model's is ", w->info.dtype, " ", ShapeString(w->info.full_shape),
          "; an update keeps every dtype and shape (load the checkpoint to change them)"));
    }
    if (w->info.nbytes != t.nbytes) {
      return absl::InternalError(absl::StrCat("tensor ", QuoteName(t.name), ": ", t.nbytes, " bytes in the file, ",
                                              w->info.nbytes, " in the model"));
    }
    WEIGHTD_RETURN_IF_ERROR(file.file->ReadAt(t.offset, t.nbytes, w->data));  // one copy: file -> daemon's memory
    expected[t.name] = ContentHashHex(TensorContentHash(w->data, t.nbytes));
  }
  return expected;
}

}  // namespace

int RunUpdate(const Args& args, Context& ctx) {
  const std::string from = *args.Text("--from");  // required: the parser refuses a command line without it
  absl::StatusOr<Catalog> catalog = BuildCatalog(from);
  if (!catalog.ok()) return ReportError(catalog.status(), ctx.err);
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  std::vector<std::string> names;
  for (const CatalogTensor& t : catalog->tensors) names.push_back(t.name);
  absl::StatusOr<Updater> updater = (*client)->BeginUpdate(args.positional[0], names);
  if (!updater.ok()) return ReportError(updater.status(), ctx.err);
  absl::StatusOr<std::map<std::string, std::string>> expected = WriteTensors(*catalog, *updater);
  if (!expected.ok()) {
    (void)updater->Abort();
    return ReportError(expected.status(), ctx.err);
  }
  absl::StatusOr<CommitInfo> commit = updater->Commit(*expected, args.Text("--version-label").value_or(""));
  if (!commit.ok()) return ReportError(commit.status(), ctx.err);
  const ModelSummary& m = commit->model;
  if (args.Flag("--json")) {
    nlohmann::json doc = {{"model", m.name},
                          {"generation", m.generation},
                          {"version_label", m.version_label},
                          {"fingerprint", m.fingerprint},
                          {"tensors_written", names.size()},
                          {"tensors_changed", commit->tensors_changed},
                          {"bytes_written", commit->bytes_written},
                          {"bytes_shared", commit->bytes_shared},
                          {"seconds", commit->seconds}};
    ctx.out << doc.dump(2) << "\n";
    return kExitOk;
  }
  ctx.out << absl::StrFormat(
      "committed '%s' generation %d%s: %d tensors written, %d changed; %s (%d bytes) of staged segments, %s (%d "
      "bytes) shared; commit %.3f s; fingerprint %s\n",
      m.name, m.generation, m.version_label.empty() ? "" : absl::StrCat(" (", m.version_label, ")"), names.size(),
      commit->tensors_changed, HumanBytes(commit->bytes_written), commit->bytes_written,
      HumanBytes(commit->bytes_shared), commit->bytes_shared, commit->seconds, m.fingerprint);
  return kExitOk;
}

}  // namespace weightd::cli
