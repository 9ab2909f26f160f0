#include "tests/gpu/gpu_check_protocol.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace weightd::gpu_checks {
namespace {

uint64_t PatternWord(uint64_t seed, uint64_t index) {  // splitmix64
  uint64_t z = index + seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

void FillPattern(char* dst, uint64_t offset, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t word = PatternWord(seed, (offset + i) / 8);
    std::memcpy(dst + i, &word, 8);
  }
}

int64_t FindMismatch(const char* src, uint64_t offset, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t word = PatternWord(seed, (offset + i) / 8);
    if (std::memcmp(src + i, &word, 8) != 0) {
      const char* want = reinterpret_cast<const char*>(&word);
      for (uint64_t j = 0; j < 8; ++j) {
        if (src[i + j] != want[j]) return static_cast<int64_t>(offset + i + j);
      }
    }
  }
  return -1;
}

std::string Message::Get(const std::string& key) const {
  auto it = fields.find(key);
  return it == fields.end() ? "" : it->second;
}

absl::StatusOr<Message> ParseMessage(const std::string& line) {
  Message m;
  std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (words.empty()) return absl::InvalidArgumentError("empty message");
  m.verb = words[0];
  if (m.verb == "error") {
    m.fields["message"] = line.size() > 6 ? line.substr(6) : "";
    return m;
  }
  for (size_t i = 1; i < words.size(); ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(words[i], absl::MaxSplits('=', 1));
    if (kv.first.empty()) return absl::InvalidArgumentError(absl::StrCat("bad field '", words[i], "' in '", line, "'"));
    m.fields[kv.first] = kv.second;
  }
  return m;
}

}  // namespace weightd::gpu_checks
