// A small command-line parser for weightctl's subcommands: positional
// arguments plus `--name value`, `--name=value`, repeatable options and
// boolean flags. Unknown options are errors that name the option.
#ifndef WEIGHTD_CLIENT_CLI_ARGS_H_
#define WEIGHTD_CLIENT_CLI_ARGS_H_

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace weightd::cli {

struct ArgSpec {
  std::set<std::string> with_value;  // e.g. "--rank"
  std::set<std::string> flags;       // e.g. "--json"
};

class Args {
 public:
  // INVALID_ARGUMENT for an unknown option or a missing value.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& argv, const ArgSpec& spec);

  const std::vector<std::string>& positional() const { return positional_; }
  bool Has(const std::string& name) const { return values_.count(name) != 0; }
  // The last value given for `name`.
  std::optional<std::string> Get(const std::string& name) const;
  std::vector<std::string> GetAll(const std::string& name) const;
  // The value parsed as an integer in [min, max]; INVALID_ARGUMENT otherwise.
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t fallback, int64_t min, int64_t max) const;
  absl::StatusOr<double> GetDouble(const std::string& name, double fallback) const;

 private:
  std::vector<std::string> positional_;
  std::map<std::string, std::vector<std::string>> values_;
};

}  // namespace weightd::cli

#endif  // WEIGHTD_CLIENT_CLI_ARGS_H_
