#include "common/io/proc_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/base/status.h"
#include "common/base/scoped_fd.h"

namespace weightd {

absl::StatusOr<std::string> ReadPseudoFile(const std::string& path, uint64_t max_bytes) {
  ScopedFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd.valid()) return ErrnoToStatus(absl::StrCat(path, ": open"), errno);
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoToStatus(absl::StrCat(path, ": read"), errno);
    if (n == 0) return out;
    if (out.size() + static_cast<uint64_t>(n) > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": holds more than ", max_bytes, " bytes"));
    }
    out.append(buf, static_cast<size_t>(n));
  }
}

std::map<std::string, uint64_t> ParseMeminfo(absl::string_view text) {
  std::map<std::string, uint64_t> out;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t value = 0;
    if (words.size() < 2 || !absl::ConsumeSuffix(&words[0], ":") || !absl::SimpleAtoi(words[1], &value)) continue;
    bool kib = words.size() > 2 && words[2] == "kB";
    out[std::string(words[0])] = kib ? value * 1024 : value;
  }
  return out;
}

std::optional<uint64_t> MeminfoValue(absl::string_view key, const std::string& path) {
  absl::StatusOr<std::string> text = ReadPseudoFile(path);
  if (!text.ok()) return std::nullopt;
  std::map<std::string, uint64_t> values = ParseMeminfo(*text);
  auto it = values.find(std::string(key));
  if (it == values.end()) return std::nullopt;
  return it->second;
}

std::map<uint64_t, uint64_t> ParseSmapsField(absl::string_view text, absl::string_view field) {
  std::map<uint64_t, uint64_t> out;
  std::optional<uint64_t> start;  // of the mapping whose lines follow
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    size_t dash = line.find('-');
    size_t space = line.find(' ');
    uint64_t address = 0;
    // A mapping's first line: "7f12a0000000-7f12a4000000 rw-s 00000000 00:01 2 /memfd:..."
    if (dash != absl::string_view::npos && space != absl::string_view::npos && dash < space &&
        absl::SimpleHexAtoi(line.substr(0, dash), &address)) {
      start = address;
      continue;
    }
    absl::string_view rest = line;
    if (!start || !absl::ConsumePrefix(&rest, field) || !absl::ConsumePrefix(&rest, ":")) continue;
    std::vector<absl::string_view> words = absl::StrSplit(rest, ' ', absl::SkipEmpty());
    uint64_t kib = 0;
    if (words.size() == 2 && words[1] == "kB" && absl::SimpleAtoi(words[0], &kib)) out[*start] = kib * 1024;
  }
  return out;
}

}  // namespace weightd
