#include "server/model/model.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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

std::optional<TpRule> ParseTpRule(const std::string& text) {
  size_t colon = text.rfind(':');
  uint32_t dim = 0;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(text.substr(colon + 1), &dim)) return std::nullopt;
  return TpRule{text.substr(0, colon), dim};
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
         include_patterns == o.include_patterns && exclude_patterns == o.exclude_patterns &&
         numa_copies == o.numa_copies && same_rules();
}

std::vector<uint32_t> ModelGeneration::SegmentsOf(uint32_t rank, int copy) const {
  std::vector<uint32_t> ids = ranks.at(rank).segments;
  if (copy < 0 || static_cast<size_t>(copy) >= numa_copies.size()) return ids;
  const std::vector<uint32_t>& host = numa_copies[copy].host_segments;
  for (size_t i = 0; i < ids.size() && i < host.size(); ++i) ids[i] = host[i];
  return ids;
}

bool LoadRequest::Selects(const std::string& tensor) const {
  auto contains = [&](const std::string& pattern) { return tensor.find(pattern) != std::string::npos; };
  if (!include_patterns.empty() && std::none_of(include_patterns.begin(), include_patterns.end(), contains)) {
    return false;
  }
  return std::none_of(exclude_patterns.begin(), exclude_patterns.end(), contains);
}

absl::Status CheckLoadPatterns(const LoadRequest& request) {
  auto refuse = [](std::string message) {
    absl::Status status = absl::InvalidArgumentError(std::move(message));
    status.SetPayload(kInvalidLoadRequestPayload, absl::Cord("1"));
    return status;
  };
  std::vector<std::string> rule_patterns;
  for (const TpRule& rule : request.tp_rules) rule_patterns.push_back(rule.pattern);
  struct List {
    const char* option;
    const std::vector<std::string>* patterns;
    bool nonempty;
  };
  for (const List& list : {List{"--host-resident", &request.host_resident_patterns, false},
                           List{"--include", &request.include_patterns, true},
                           List{"--exclude", &request.exclude_patterns, true},
                           List{"--tp-rule", &rule_patterns, true}}) {
    if (list.patterns->size() > kMaxLoadPatterns) {
      return refuse(absl::StrCat(list.option, " was given ", list.patterns->size(), " patterns; at most ",
                                 kMaxLoadPatterns, " are allowed"));
    }
    for (size_t i = 0; i < list.patterns->size(); ++i) {
      const std::string& p = (*list.patterns)[i];
      if (p.size() > kMaxPatternBytes) {
        return refuse(absl::StrCat(list.option, " pattern ", i + 1, " is ", p.size(), " bytes; at most ",
                                   kMaxPatternBytes, " are allowed"));
      }
      if (list.nonempty && p.empty()) return refuse(absl::StrCat(list.option, " pattern ", i + 1, " is empty"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ChooseNumaCopy(const std::vector<NumaCopy>& copies, std::optional<int> node,
                                   const std::vector<int>& cpus) {
  if (copies.empty()) return -1;
  if (node.has_value()) {
    std::vector<std::string> nodes;
    for (size_t i = 0; i < copies.size(); ++i) {
      if (copies[i].node == *node) return static_cast<int>(i);
      nodes.push_back(std::to_string(copies[i].node));
    }
    return absl::FailedPreconditionError(absl::StrCat("no NUMA copy on node ", *node, "; the model has copies on nodes ",
                                                      absl::StrJoin(nodes, ", ")));
  }
  int best = 0;
  size_t best_cpus = 0;
  for (size_t i = 0; i < copies.size(); ++i) {
    const std::vector<int>& node_cpus = copies[i].cpus;  // sorted (ParseCpuList)
    size_t mine = std::count_if(cpus.begin(), cpus.end(),
                                [&](int cpu) { return std::binary_search(node_cpus.begin(), node_cpus.end(), cpu); });
    if (mine > best_cpus) {
      best = static_cast<int>(i);
      best_cpus = mine;
    }
  }
  return best;
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
