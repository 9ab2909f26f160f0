#include "client/cli/args.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace weightd::cli {
namespace {

template <typename Map>
typename Map::mapped_type Find(const Map& map, const std::string& name) {
  auto it = map.find(name);
  return it == map.end() ? typename Map::mapped_type{} : it->second;
}

std::string OptionUsage(const OptionSpec& o) {
  std::string words = o.kind == OptionKind::kFlag ? o.name : absl::StrCat(o.name, " ", o.value);
  if (o.kind == OptionKind::kTextList) absl::StrAppend(&words, " ...");
  return o.required ? words : absl::StrCat("[", words, "]");
}

}  // namespace

std::string UsageLine(const CommandSpec& spec) {
  std::vector<std::string> words;
  for (const PositionalSpec& p : spec.positionals) words.push_back(p.required ? p.name : "[" + p.name + "]");
  for (const OptionSpec& o : spec.options) words.push_back(OptionUsage(o));
  return absl::StrJoin(words, " ");
}

bool Args::Flag(const std::string& name) const { return Find(flags, name); }

std::optional<std::string> Args::Text(const std::string& name) const {
  auto it = texts.find(name);
  if (it == texts.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> Args::List(const std::string& name) const { return Find(lists, name); }
int64_t Args::Int(const std::string& name) const { return Find(ints, name); }
double Args::Number(const std::string& name) const { return Find(numbers, name); }

}  // namespace weightd::cli
