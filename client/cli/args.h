// How a weightctl command declares its arguments, and what they parse into.
// One declaration per command drives the parser (CLI11, in app.cc), its
// validation, the command's --help and its usage line, so a command's usage
// text has one source.
#ifndef WEIGHTD_CLIENT_CLI_ARGS_H_
#define WEIGHTD_CLIENT_CLI_ARGS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace weightd::cli {

enum class OptionKind {
  kFlag,      // --json
  kText,      // --verify DIR; the last value given wins
  kTextList,  // --host-resident PATTERN, repeatable: every value, in order
  kInteger,   // --rank R: an integer in [min, max]
  kNumber,    // --hold SECONDS: a number >= 0
};

struct OptionSpec {
  std::string name;      // "--rank"
  OptionKind kind;
  std::string value;     // what the usage line calls the value ("R"); empty for a flag
  std::string help;      // one line for --help
  std::string fallback = {};  // the value when not given ("0", "tiny"); empty: none
  int64_t min = 0;       // kInteger only
  int64_t max = 0;
  bool required = false;  // the command refuses to run without it (usage: no brackets)
};

struct PositionalSpec {
  std::string name;  // "NAME"
  std::string help;
  bool required = true;  // optional ones come last
};

struct CommandSpec {
  std::vector<PositionalSpec> positionals;
  std::vector<OptionSpec> options;
};

// The arguments part of a usage line, e.g.
// "NAME [--rank R] [--verify CHECKPOINT_DIR] [--json]"; a required option
// has no brackets ("NAME --from DIR [--json]").
std::string UsageLine(const CommandSpec& spec);

// What one command's arguments parsed into. The parser validated every value
// against its OptionSpec, so the getters cannot fail; asking for a name the
// command does not declare returns the empty value.
struct Args {
  std::vector<std::string> positional;  // the positionals given, in order
  std::map<std::string, bool> flags;
  std::map<std::string, std::string> texts;  // given, or the fallback
  std::map<std::string, std::vector<std::string>> lists;
  std::map<std::string, int64_t> ints;   // given, or the fallback
  std::map<std::string, double> numbers;  // given, or the fallback

  bool Flag(const std::string& name) const;
  // nullopt when neither given nor defaulted.
  std::optional<std::string> Text(const std::string& name) const;
  std::vector<std::string> List(const std::string& name) const;
  int64_t Int(const std::string& name) const;
  double Number(const std::string& name) const;
};

}  // namespace weightd::cli

#endif  // WEIGHTD_CLIENT_CLI_ARGS_H_
