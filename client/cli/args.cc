#include "client/cli/args.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace weightd::cli {

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& argv, const ArgSpec& spec) {
  Args args;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& arg = argv[i];
    if (arg.size() < 3 || arg.rfind("--", 0) != 0) {
      args.positional_.push_back(arg);
      continue;
    }
    size_t eq = arg.find('=');
    std::string name = arg.substr(0, eq);
    if (spec.flags.count(name)) {
      if (eq != std::string::npos) return absl::InvalidArgumentError(absl::StrCat(name, " takes no value"));
      args.values_[name].push_back("");
    } else if (spec.with_value.count(name)) {
      if (eq != std::string::npos) {
        args.values_[name].push_back(arg.substr(eq + 1));
      } else if (i + 1 < argv.size()) {
        args.values_[name].push_back(argv[++i]);
      } else {
        return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown option ", name));
    }
  }
  return args;
}

std::optional<std::string> Args::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second.back();
}

std::vector<std::string> Args::GetAll(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

absl::StatusOr<int64_t> Args::GetInt(const std::string& name, int64_t fallback, int64_t min, int64_t max) const {
  std::optional<std::string> text = Get(name);
  if (!text) return fallback;
  int64_t value;
  if (!absl::SimpleAtoi(*text, &value) || value < min || value > max) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be an integer in [", min, ", ", max, "], got '", *text, "'"));
  }
  return value;
}

absl::StatusOr<double> Args::GetDouble(const std::string& name, double fallback) const {
  std::optional<std::string> text = Get(name);
  if (!text) return fallback;
  double value;
  if (!absl::SimpleAtod(*text, &value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be a non-negative number, got '", *text, "'"));
  }
  return value;
}

}  // namespace weightd::cli
