#include "client/cli/commands.h"

#include <ostream>

#include "client/cli/output.h"

namespace weightd::cli {
namespace {

constexpr char kDefaultSocket[] = "unix:///run/weightd/weightd.sock";

void PrintUsage(std::ostream& out) {
  out << "usage: weightctl [--socket PATH] COMMAND [ARGS]    (also: weightctl --help, weightctl --version)\n\n"
         "commands:\n";
  for (const Command& c : Commands()) out << "  " << c.usage << "\n";
}


}  // namespace

const std::vector<Command>& Commands() {
  static const auto* commands = new std::vector<Command>{
      {"load", "load NAME PATH [--host-resident P ...] [--tp-size N --tp-rule PATTERN:DIM ...] [--devices LIST] [--json]",
       {{"--host-resident", "--tp-size", "--tp-rule", "--devices"}, {"--json"}}, RunLoad},
      {"ls", "ls [--json]                            list loaded models", {{}, {"--json"}}, RunList},
      {"manifest", "manifest NAME [--rank R] [--json]     a rank's manifest, without a lease",
       {{"--rank"}, {"--json"}}, RunManifest},
      {"attach", "attach NAME [--rank R] [--verify CHECKPOINT_DIR] [--hold SECONDS] [--json]",
       {{"--rank", "--verify", "--hold"}, {"--json"}}, RunAttach},
      {"unload", "unload NAME [--force]", {{}, {"--force"}}, RunUnload},
      {"health", "health [MODEL] [--json]               gRPC health: the daemon, or one model (SERVING once READY)",
       {{}, {"--json"}}, RunHealth},
      {"inspect", "inspect PATH [--json]                 catalog a checkpoint offline", {{}, {"--json"}}, RunInspect},
      {"make-demo", "make-demo DIR [--preset tiny|small|llama-1b]   write the synthetic demo checkpoint",
       {{"--preset"}, {}}, RunMakeDemo},
  };
  return *commands;
}

int RunWeightctl(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  std::string socket = kDefaultSocket;
  if (const char* env = std::getenv("WEIGHTD_SOCKET")) socket = env;
  size_t i = 0;
  for (; i < argv.size() && argv[i].rfind("--", 0) == 0; ++i) {
    if (argv[i] == "--help" || argv[i] == "-h") return PrintUsage(out), kExitOk;
    if (argv[i] == "--version") return out << "weightctl " << WEIGHTD_VERSION << "\n", kExitOk;
    if (argv[i] == "--socket" && i + 1 < argv.size()) {
      socket = argv[++i];
    } else if (argv[i].rfind("--socket=", 0) == 0) {
      socket = argv[i].substr(9);
    } else {
      return ReportError(absl::InvalidArgumentError("unknown option " + argv[i]), err);
    }
  }
  if (i == argv.size()) {
    PrintUsage(err);
    return kExitBadInput;
  }
  for (const Command& command : Commands()) {
    if (argv[i] != command.name) continue;
    ArgSpec spec = command.spec;
    spec.with_value.insert("--socket");
    absl::StatusOr<Args> args = Args::Parse({argv.begin() + i + 1, argv.end()}, spec);
    if (!args.ok()) return ReportError(args.status(), err);
    if (std::optional<std::string> s = args->Get("--socket")) socket = *s;
    Context ctx{socket, out, err};  // Client::Connect accepts plain socket paths
    return command.run(*args, ctx);
  }
  return ReportError(absl::InvalidArgumentError("unknown command '" + argv[i] + "' (see weightctl --help)"), err);
}

}  // namespace weightd::cli
