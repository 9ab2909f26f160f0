#include "client/cli/commands.h"

#include "absl/strings/str_cat.h"

namespace weightd::cli {
namespace {

OptionSpec Json() { return {"--json", OptionKind::kFlag, "", "print one JSON document on stdout"}; }
OptionSpec Rank() {
  return {"--rank", OptionKind::kInteger, "R", "the tensor-parallel rank", "0", 0, 1 << 20};
}
PositionalSpec Model() { return {"NAME", "the model's name"}; }
OptionSpec Required(OptionSpec o) {
  o.required = true;
  return o;
}

}  // namespace

const std::vector<Command>& Commands() {
  static const auto* commands = new std::vector<Command>{
      {"load", "load a checkpoint (or reuse the loaded one) as model NAME",
       {{Model(), {"PATH", "the checkpoint: a folder or a .safetensors file, under a --model-root of the daemon"}},
        {{"--host-resident", OptionKind::kTextList, "PATTERN", "place tensors whose name contains PATTERN on the host"},
         {"--tp-size", OptionKind::kInteger, "N", "the number of tensor-parallel ranks", "1", 1, 1024},
         {"--tp-rule", OptionKind::kTextList, "PATTERN:DIM", "split tensors whose name contains PATTERN along DIM"},
         {"--devices", OptionKind::kText, "LIST", "GPUs, one per rank: comma-separated UUIDs or ordinals"},
         {"--include", OptionKind::kTextList, "PATTERN",
          "load only tensors whose name contains PATTERN (repeatable: any of them); default: every tensor"},
         {"--exclude", OptionKind::kTextList, "PATTERN", "do not load tensors whose name contains PATTERN; repeatable"},
         {"--numa-copies", OptionKind::kFlag, "", "one copy of the host tensors per NUMA node, each on its node's memory"},
         {"--peer", OptionKind::kTextList, "HOST:PORT",
          "seed from this peer's memory (another node's weightd --peer-address) before storage; repeatable"},
         Json()}},
       RunLoad},
      {"reload", "load the next generation of model NAME with its plan, reading only the files that changed",
       {{Model(), {"PATH", "the checkpoint to load from; default: the one NAME was loaded from", false}}, {Json()}},
       RunReload},
      {"update", "publish a checkpoint's tensors into model NAME through the writer path (verified, atomic)",
       {{Model()},
        {Required({"--from", OptionKind::kText, "DIR",
                   "a safetensors checkpoint whose tensors (a subset of the model's, same dtypes and shapes) to "
                   "write"}),
         {"--version-label", OptionKind::kText, "LABEL", "stored with the new generation, e.g. step-1200"},
         Json()}},
       RunUpdate},
      {"ls", "list loaded models", {{}, {Json()}}, RunList},
      {"manifest", "a rank's manifest, without a lease", {{Model()}, {Rank(), Json()}}, RunManifest},
      {"attach", "take a lease and map the tensors of one rank",
       {{Model()},
        {Rank(),
         {"--verify", OptionKind::kText, "CHECKPOINT_DIR", "compare every tensor with the checkpoint's bytes"},
         {"--hold", OptionKind::kNumber, "SECONDS", "keep the lease this long before exiting", "0"},
         {"--prefault", OptionKind::kFlag, "", "map every page of the host segments now (no page faults later)"},
         {"--numa-node", OptionKind::kText, "N",
          "map NUMA node N's copy of a model loaded with --numa-copies; default: the node of this process's CPUs"},
         {"--layout", OptionKind::kText, "KEY", "attach the runtime layout KEY of the current generation instead"},
         {"--identity", OptionKind::kTextList, "K=V",
          "with --layout: the identity the layout must have been published with (repeatable)"},
         {"--verify-layout", OptionKind::kFlag, "",
          "with --layout: read every tensor and compare its xxh3-64 with the hash recorded at commit"},
         Json()}},
       RunAttach},
      {"layouts", "list the runtime layouts published on model NAME's generations",
       {{Model()}, {Json()}}, RunLayouts},
      {"drop-layout", "remove runtime layout KEY of model NAME (leases on it keep it until they end)",
       {{Model(), {"KEY", "the layout's key"}},
        {{"--rank", OptionKind::kText, "R", "only this rank's layout; default: every rank's"}}},
       RunDropLayout},
      {"unload", "stop new leases; free the model when its last lease ends",
       {{Model()}, {{"--force", OptionKind::kFlag, "", "revoke the leases now"}}}, RunUnload},
      {"watch", "print a line per event of model NAME (published, draining, freed, unloaded, layouts) until Ctrl-C",
       {{Model()}, {{"--json", OptionKind::kFlag, "", "print one JSON object per line"}}},
       RunWatch},
      {"upgrade", "re-execute the daemon's binary in place, keeping every READY model (no checkpoint is read)",
       {{},
        {{"--timeout", OptionKind::kNumber, "SECONDS", "how long to wait for the daemon to come back", "60"}, Json()}},
       RunUpgrade},
      {"health", "gRPC health: the daemon, or one model (SERVING once READY)",
       {{{"MODEL", "a model's name; none: the daemon itself", false}}, {Json()}}, RunHealth},
      {"inspect", "catalog a checkpoint offline (no daemon needed)",
       {{{"PATH", "a checkpoint folder or .safetensors file"}}, {Json()}}, RunInspect},
      {"make-demo", "write the synthetic, deterministic demo checkpoint",
       {{{"DIR", "the folder to write"}},
        {{"--preset", OptionKind::kText, "tiny|small|llama-1b|engram", "the checkpoint's size and layout", "tiny"}}},
       RunMakeDemo},
  };
  return *commands;
}

std::string Usage(const Command& command) { return absl::StrCat(command.name, " ", UsageLine(command.spec)); }

absl::StatusOr<std::unique_ptr<Client>> ConnectTo(const Context& ctx) { return Client::Connect(ctx.socket, ctx.tls); }

}  // namespace weightd::cli
