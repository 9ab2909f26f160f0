// weightctl attach: take a lease, map the tensors (or a runtime layout's),
// optionally verify them byte for byte against the checkpoint files (or a
// layout's against its recorded hashes), optionally hold the lease.
#include <chrono>
#include <ostream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "client/cli/verify.h"
#include "common/io/env.h"
#include "nlohmann/json.hpp"
#include "weightd/client.h"

namespace weightd::cli {

int RunAttach(const Args& args, Context& ctx) {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(ctx);
  if (!client.ok()) return ReportError(client.status(), ctx.err);
  AttachOptions options;
  options.prefault = args.Flag("--prefault");
  if (std::optional<std::string> node = args.Text("--numa-node")) {
    int n = -1;
    if (!absl::SimpleAtoi(*node, &n) || n < 0 || n >= kMaxNumaNodes) {
      return ReportError(absl::InvalidArgumentError(absl::StrCat("--numa-node must be a node id in [0, ", kMaxNumaNodes,
                                                                 "), got '", *node, "'")),
                         ctx.err);
    }
    options.numa_node = n;
  }
  if (std::optional<std::string> layout = args.Text("--layout")) options.layout = *layout;
  absl::StatusOr<std::map<std::string, std::string>> identity = ParseIdentity(args.List("--identity"));
  if (!identity.ok()) return ReportError(identity.status(), ctx.err);
  options.identity = std::move(*identity);
  if (options.layout.empty() && (!options.identity.empty() || args.Flag("--verify-layout"))) {
    return ReportError(absl::InvalidArgumentError("--identity and --verify-layout need --layout KEY"), ctx.err);
  }
  if (!options.layout.empty() && args.Text("--verify").has_value()) {
    return ReportError(absl::InvalidArgumentError(
                           "--verify compares checkpoint tensors; a layout's are checked with --verify-layout"),
                       ctx.err);
  }
  absl::StatusOr<MappedModel> model =
      (*client)->Attach(args.positional[0], static_cast<uint32_t>(args.Int("--rank")), options);
  if (!model.ok()) return ReportError(model.status(), ctx.err);
  uint64_t bytes = 0;
  for (const TensorView& v : model->tensors()) bytes += v.nbytes;
  const Manifest& m = model->manifest();
  bool as_json = args.Flag("--json");
  if (!as_json) {
    ctx.out << absl::StrFormat("attached '%s'%s rank %d generation %d: %d tensors, %s in %.3f ms%s%s (fingerprint %s)\n",
                               m.model, m.layout.empty() ? "" : absl::StrCat(" layout '", m.layout, "'"), m.rank,
                               m.generation, model->tensors().size(), HumanBytes(bytes),
                               model->attach_seconds() * 1e3, options.prefault ? ", prefaulted" : "",
                               m.numa_node >= 0 ? absl::StrCat(", NUMA node ", m.numa_node, "'s copy") : "",
                               m.fingerprint);
  }
  bool verified = false;
  if (std::optional<std::string> dir = args.Text("--verify")) {
    absl::StatusOr<VerifyResult> result = VerifyAgainstCheckpoint(*model, *dir);
    if (!result.ok()) return ReportError(result.status(), ctx.err);
    verified = true;
    if (!as_json) ctx.out << absl::StrFormat("verified %d tensors, %d bytes\n", result->tensors, result->bytes);
  }
  if (args.Flag("--verify-layout")) {
    absl::StatusOr<VerifyResult> result = VerifyLayoutHashes(*model);
    if (!result.ok()) return ReportError(result.status(), ctx.err);
    verified = true;
    if (!as_json) {
      ctx.out << absl::StrFormat("verified %d layout tensors, %d bytes: every content hash matches\n", result->tensors,
                                 result->bytes);
    }
  }
  if (as_json) {
    nlohmann::json tensors = nlohmann::json::array();
    if (!m.layout.empty()) {  // a layout's tensors are the writer's: say what they are
      for (const TensorView& v : model->tensors()) {
        const TensorInfo& t = *v.info;
        tensors.push_back({{"name", t.name},
                           {"dtype", t.dtype},
                           {"shape", t.shape},
                           {"strides", t.strides},
                           {"placement", t.location == Location::kDevice ? "device" : "host"},
                           {"nbytes", t.nbytes},
                           {"content_hash", t.content_hash}});
      }
    }
    ctx.out << nlohmann::json{{"model", m.model},
                              {"layout", m.layout},
                              {"identity", m.identity},
                              {"layout_tensors", tensors},
                              {"rank", m.rank},
                              {"generation", m.generation},
                              {"tensors", model->tensors().size()},
                              {"bytes", bytes},
                              {"attach_seconds", model->attach_seconds()},
                              {"prefaulted", options.prefault},
                              {"numa_node", m.numa_node},
                              {"fingerprint", m.fingerprint},
                              {"version_label", m.version_label},
                              {"verified", verified}}
                   .dump(2)
            << "\n";
  }
  ctx.out.flush();
  double hold = args.Number("--hold");
  if (hold > 0) std::this_thread::sleep_for(std::chrono::duration<double>(hold));
  return kExitOk;
}

}  // namespace weightd::cli
