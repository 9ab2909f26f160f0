// weightctl's command line on CLI11: global options, one subcommand per entry
// of Commands(), --help from the same declarations, and every usage error
// turned into one line on stderr and exit status 2. The only file that
// includes CLI11 (its headers are slow to compile).
#include <CLI/CLI.hpp>

#include <ostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "common/base/log.h"

namespace weightd::cli {
namespace {

constexpr char kDefaultSocket[] = "unix:///run/weightd/weightd.sock";
constexpr char kSocketEnv[] = "WEIGHTD_SOCKET";
constexpr char kSynopsis[] =
    "usage: weightctl [--socket PATH] COMMAND [ARGS]    (also: weightctl --help, weightctl --version, "
    "weightctl COMMAND --help)";
constexpr char kGlobalGroup[] = "global options (before or after COMMAND)";

const Command* FindCommand(const std::string& name) {
  for (const Command& c : Commands()) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

// The top level lists the commands by their usage lines; a command's help
// starts with its usage line. Both come from the Command table.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* app, std::string) const override {
    const Command* command = app->get_parent() ? FindCommand(app->get_name()) : nullptr;
    if (command == nullptr) return absl::StrCat(kSynopsis, "\n");
    return absl::StrCat("usage: weightctl [--socket PATH] ", Usage(*command), "\n\n", command->summary, "\n");
  }

  std::string make_subcommands(const CLI::App*, CLI::AppFormatMode) const override {
    std::string out = "\ncommands:\n";
    for (const Command& c : Commands()) absl::StrAppend(&out, "  ", Usage(c), "\n      ", c.summary, "\n");
    return out;
  }

  std::string make_help(const CLI::App* app, std::string name, CLI::AppFormatMode mode) const override {
    return absl::StrCat(make_usage(app, name), make_positionals(app), make_groups(app, mode),
                        make_subcommands(app, mode), "\n", make_footer(app));
  }
};

class SubcommandFormatter : public HelpFormatter {
 public:
  std::string make_subcommands(const CLI::App*, CLI::AppFormatMode) const override { return ""; }
};

CLI::Validator IntegerIn(int64_t min, int64_t max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        int64_t value;
        if (absl::SimpleAtoi(text, &value) && value >= min && value <= max) return "";
        return absl::StrCat("must be an integer in [", min, ", ", max, "], got '", text, "'");
      },
      absl::StrCat("in [", min, ", ", max, "]"));
}

CLI::Validator NonNegativeNumber() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double value;
        if (absl::SimpleAtod(text, &value) && value >= 0) return "";
        return absl::StrCat("must be a number >= 0, got '", text, "'");
      },
      ">= 0");
}

// Adds `o` to `sub`, bound to its slot in `args`.
void AddOption(CLI::App* sub, const OptionSpec& o, Args& args) {
  CLI::Option* option = nullptr;
  switch (o.kind) {
    case OptionKind::kFlag:
      option = sub->add_flag(o.name, args.flags[o.name]);
      break;
    case OptionKind::kText:
      args.texts[o.name] = o.fallback;
      option = sub->add_option(o.name, args.texts[o.name]);
      break;
    case OptionKind::kTextList:
      option = sub->add_option(o.name, args.lists[o.name])->take_all();
      break;
    case OptionKind::kInteger:
      absl::SimpleAtoi(o.fallback, &args.ints[o.name]);
      option = sub->add_option(o.name, args.ints[o.name])->check(IntegerIn(o.min, o.max));
      break;
    case OptionKind::kNumber:
      absl::SimpleAtod(o.fallback, &args.numbers[o.name]);
      option = sub->add_option(o.name, args.numbers[o.name])->check(NonNegativeNumber());
      break;
  }
  option->description(o.help)->required(o.required);
  if (!o.value.empty()) option->type_name(o.value);
  if (!o.fallback.empty()) option->default_str(o.fallback);
}

void AddCommand(CLI::App& app, const Command& command, Args& args) {
  CLI::App* sub = app.add_subcommand(command.name, command.summary);
  sub->formatter(std::make_shared<SubcommandFormatter>());
  sub->footer(absl::StrCat("global options: --socket PATH|HOST:PORT (or $", kSocketEnv,
                           "), --tls-ca PEM, --tls-cert PEM, --tls-key PEM (see weightctl --help)"));
  args.positional.resize(command.spec.positionals.size());
  for (size_t i = 0; i < command.spec.positionals.size(); ++i) {
    const PositionalSpec& p = command.spec.positionals[i];
    sub->add_option(p.name, args.positional[i], p.help)->required(p.required)->type_name("");
  }
  for (const OptionSpec& o : command.spec.options) AddOption(sub, o, args);
}

void AddGlobalOptions(CLI::App& app, Context& ctx) {
  app.add_option("--socket", ctx.socket,
                 absl::StrCat("the daemon: a Unix socket path or a gRPC target; the flag wins over $", kSocketEnv,
                              ", which wins over the default"))
      ->envname(kSocketEnv)
      ->type_name("PATH|HOST:PORT")
      ->default_str(kDefaultSocket);
  app.add_option("--tls-ca", ctx.tls.tls_ca_file, "TLS to a HOST:PORT: trust this CA")->type_name("PEM");
  app.add_option("--tls-cert", ctx.tls.tls_cert_file, "mutual TLS: this client certificate")->type_name("PEM");
  app.add_option("--tls-key", ctx.tls.tls_key_file, "mutual TLS: this client key")->type_name("PEM");
  app.set_version_flag("--version", absl::StrCat("weightctl ", WEIGHTD_VERSION), "print the version");
  for (CLI::Option* option : app.get_options()) option->group(kGlobalGroup);
}

// Drops the text options that were neither given nor defaulted, and the
// optional positionals not given.
void Trim(const CLI::App& sub, const Command& command, Args& args) {
  for (const OptionSpec& o : command.spec.options) {
    if (o.kind == OptionKind::kText && o.fallback.empty() && sub.count(o.name) == 0) args.texts.erase(o.name);
  }
  size_t given = 0;
  for (const PositionalSpec& p : command.spec.positionals) given += sub.count(p.name) > 0;
  args.positional.resize(given);
}

// One line for a usage error CLI11 reported.
std::string UsageErrorMessage(const CLI::App& app, const CLI::ParseError& e) {
  std::vector<CLI::App*> chosen = app.get_subcommands();
  const Command* command = chosen.empty() ? nullptr : FindCommand(chosen[0]->get_name());
  std::vector<std::string> extras = app.remaining(true);
  const std::string first = extras.empty() ? "" : extras[0];
  if (first.rfind("-", 0) == 0) return "unknown option " + first;  // also when it left a positional missing
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
    if (command == nullptr) return "unknown command '" + first + "' (see weightctl --help)";
    return absl::StrCat("unexpected argument '", first, "'; usage: weightctl ", Usage(*command));
  }
  if (command != nullptr && dynamic_cast<const CLI::RequiredError*>(&e) != nullptr) {
    return absl::StrCat(e.what(), "; usage: weightctl ", Usage(*command));
  }
  return e.what();
}

}  // namespace

int RunWeightctl(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  Context ctx{kDefaultSocket, out, err, {}};  // Client::Connect accepts plain socket paths
  CLI::App app("", "weightctl");
  app.formatter(std::make_shared<HelpFormatter>());
  app.set_help_flag("-h,--help", "print this help and exit");  // before the subcommands: they copy it
  app.fallthrough();  // global options also after the command's name
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  AddGlobalOptions(app, ctx);
  std::map<std::string, Args> args;  // per command: a stable slot for each bound value
  for (const Command& command : Commands()) AddCommand(app, command, args[command.name]);
  // Names, paths and patterns travel as protobuf strings, which must be UTF-8:
  // refused here with the argument named, not as an empty error from gRPC.
  for (size_t i = 0; i < argv.size(); ++i) {
    if (!IsValidUtf8(argv[i])) {
      err << "weightctl: argument " << i + 1 << " (" << EscapeForLog(argv[i].substr(0, 200))
          << ") is not valid UTF-8; names, paths and patterns must be\n";
      return kExitBadInput;
    }
  }
  try {
    app.parse(std::vector<std::string>(argv.rbegin(), argv.rend()));  // CLI11 takes them reversed
  } catch (const CLI::CallForVersion& e) {
    out << e.what() << "\n";
    return kExitOk;
  } catch (const CLI::Success&) {  // --help
    out << app.help();
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    return ReportError(absl::InvalidArgumentError(UsageErrorMessage(app, e)), err);
  }
  std::vector<CLI::App*> chosen = app.get_subcommands();
  if (chosen.empty()) {
    err << app.help();
    return kExitBadInput;
  }
  const Command& command = *FindCommand(chosen[0]->get_name());
  Args& parsed = args[command.name];
  Trim(*chosen[0], command, parsed);
  return command.run(parsed, ctx);
}

}  // namespace weightd::cli
