#include "server/model/model.h"

#include <cctype>

#include "absl/strings/str_cat.h"

namespace weightd {

std::string ModelStateName(ModelState state) {
  switch (state) {
    case ModelState::kLoading: return "LOADING";
    case ModelState::kReady: return "READY";
    case ModelState::kFailed: return "FAILED";
    case ModelState::kDraining: return "DRAINING";
  }
  return "UNKNOWN";
}

bool LoadRequest::SamePlan(const LoadRequest& o) const {
  auto same_rules = [&] {
    if (tp_rules.size() != o.tp_rules.size()) return false;
    for (size_t i = 0; i < tp_rules.size(); ++i) {
      if (tp_rules[i].pattern != o.tp_rules[i].pattern || tp_rules[i].dim != o.tp_rules[i].dim) return false;
    }
    return true;
  };
  return host_resident_patterns == o.host_resident_patterns && tp_size == o.tp_size && devices == o.devices &&
         same_rules();
}

absl::Status ValidateModelName(const std::string& name) {
  if (name.empty() || name.size() > kMaxModelNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("model name must be 1 to 128 characters, got ", name.size()));
  }
  for (char c : name) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return absl::InvalidArgumentError(
          absl::StrCat("model name '", name, "' may hold only letters, digits, '.', '_' and '-'"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateVersionLabel(const std::string& label) {
  if (label.size() > kMaxVersionLabelBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("version label is ", label.size(), " bytes; at most ", kMaxVersionLabelBytes, " are allowed"));
  }
  for (char c : label) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError("version label may hold only printable ASCII characters");
    }
  }
  return absl::OkStatus();
}

}  // namespace weightd
