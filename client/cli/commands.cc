#include "client/cli/commands.h"

#include <ostream>

#include "client/cli/output.h"

namespace weightd::cli {
namespace {

constexpr char kDefaultSocket[] = "unix:///run/weightd/weightd.sock";

// Options every daemon command takes, before or after the command's name.
constexpr const char* kGlobalOptions[] = {"--socket", "--tls-ca", "--tls-cert", "--tls-key"};

std::string& GlobalOption(Context& ctx, const std::string& name) {
  if (name == "--tls-ca") return ctx.tls.tls_ca_file;
  if (name == "--tls-cert") return ctx.tls.tls_cert_file;
  if (name == "--tls-key") return ctx.tls.tls_key_file;
  return ctx.socket;
}

// Consumes argv[*i] (and its value) when it is a global option.
bool ParseGlobal(const std::vector<std::string>& argv, size_t* i, Context& ctx) {
  for (std::string name : kGlobalOptions) {
    if (argv[*i] == name && *i + 1 < argv.size()) {
      GlobalOption(ctx, name) = argv[++*i];
      return true;
    }
    if (argv[*i].rfind(name + "=", 0) == 0) {
      GlobalOption(ctx, name) = argv[*i].substr(name.size() + 1);
      return true;
    }
  }
  return false;
}

void PrintUsage(std::ostream& out) {
  out << "usage: weightctl [--socket PATH] COMMAND [ARGS]    (also: weightctl --help, weightctl --version)\n"
         "  --socket PATH|HOST:PORT; TLS to a HOST:PORT: --tls-ca PEM, mutual TLS: also --tls-cert PEM --tls-key PEM\n\n"
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

absl::StatusOr<std::unique_ptr<Client>> ConnectTo(const Context& ctx) { return Client::Connect(ctx.socket, ctx.tls); }

int RunWeightctl(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  Context ctx{kDefaultSocket, out, err, {}};  // Client::Connect accepts plain socket paths
  if (const char* env = std::getenv("WEIGHTD_SOCKET")) ctx.socket = env;
  size_t i = 0;
  for (; i < argv.size() && argv[i].rfind("--", 0) == 0; ++i) {
    if (argv[i] == "--help" || argv[i] == "-h") return PrintUsage(out), kExitOk;
    if (argv[i] == "--version") return out << "weightctl " << WEIGHTD_VERSION << "\n", kExitOk;
    if (!ParseGlobal(argv, &i, ctx)) return ReportError(absl::InvalidArgumentError("unknown option " + argv[i]), err);
  }
  if (i == argv.size()) {
    PrintUsage(err);
    return kExitBadInput;
  }
  for (const Command& command : Commands()) {
    if (argv[i] != command.name) continue;
    ArgSpec spec = command.spec;
    for (const char* name : kGlobalOptions) spec.with_value.insert(name);
    absl::StatusOr<Args> args = Args::Parse({argv.begin() + i + 1, argv.end()}, spec);
    if (!args.ok()) return ReportError(args.status(), err);
    for (const char* name : kGlobalOptions) {
      if (std::optional<std::string> value = args->Get(name)) GlobalOption(ctx, name) = *value;
    }
    return command.run(*args, ctx);
  }
  return ReportError(absl::InvalidArgumentError("unknown command '" + argv[i] + "' (see weightctl --help)"), err);
}

}  // namespace weightd::cli
