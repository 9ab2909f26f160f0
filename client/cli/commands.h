// weightctl subcommands. Each is a plain function of parsed arguments that
// writes to the given streams and returns the process exit status, so tests
// can run them in-process.
#ifndef WEIGHTD_CLIENT_CLI_COMMANDS_H_
#define WEIGHTD_CLIENT_CLI_COMMANDS_H_

#include <iosfwd>
#include <map>
#include <string>
#include <vector>

#include "client/cli/args.h"
#include "weightd/client.h"

namespace weightd::cli {

struct Context {
  std::string socket;  // daemon target: a socket path or a gRPC target (see Client::Connect)
  std::ostream& out;
  std::ostream& err;
  ConnectOptions tls;  // --tls-ca, --tls-cert, --tls-key
};

// A client of ctx.socket with ctx.tls.
absl::StatusOr<std::unique_ptr<Client>> ConnectTo(const Context& ctx);

struct Command {
  const char* name;
  const char* summary;  // one line for --help
  CommandSpec spec;     // its arguments: parsing, validation, --help and the usage line
  int (*run)(const Args& args, Context& ctx);
};

// All subcommands, in the order `weightctl --help` lists them.
const std::vector<Command>& Commands();

// "load NAME PATH [--host-resident PATTERN ...] ...": the command's usage line.
std::string Usage(const Command& command);

// Runs weightctl with argv (without the program name): parses it (app.cc),
// then runs the command. Exit 2 with one line on `err` for bad usage. Never
// throws.
int RunWeightctl(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err);

int RunInspect(const Args& args, Context& ctx);
int RunMakeDemo(const Args& args, Context& ctx);
int RunLoad(const Args& args, Context& ctx);
int RunReload(const Args& args, Context& ctx);
int RunUpdate(const Args& args, Context& ctx);
int RunList(const Args& args, Context& ctx);
int RunManifest(const Args& args, Context& ctx);
int RunAttach(const Args& args, Context& ctx);
int RunUnload(const Args& args, Context& ctx);
int RunUpgrade(const Args& args, Context& ctx);
int RunHealth(const Args& args, Context& ctx);
int RunWatch(const Args& args, Context& ctx);
int RunLayouts(const Args& args, Context& ctx);
int RunDropLayout(const Args& args, Context& ctx);

// --identity KEY=VALUE fields as a map; INVALID_ARGUMENT naming a field
// without '=' or a key given twice.
absl::StatusOr<std::map<std::string, std::string>> ParseIdentity(const std::vector<std::string>& fields);

}  // namespace weightd::cli

#endif  // WEIGHTD_CLIENT_CLI_COMMANDS_H_
