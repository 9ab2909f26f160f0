#include "common/io/host_memory.h"

#include <optional>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/io/proc_files.h"
#include "common/base/status.h"

namespace weightd {
namespace {

// cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (about 2^63 bytes).
constexpr uint64_t kV1Unlimited = 1ull << 62;

// A /proc/self/cgroup line's path for the memory hierarchy of `version`.
std::optional<std::string> OwnCgroupPath(absl::string_view self_cgroup, int version) {
  for (absl::string_view line : absl::StrSplit(self_cgroup, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    bool match = version == 2 ? f[0] == "0" && f[1].empty()
                              : absl::c_linear_search(absl::StrSplit(f[1], ','), "memory");
    if (match) return std::string(f[2]);
  }
  return std::nullopt;
}

// mountinfo escapes ' ', '\t', '\n' and '\\' as octal (\040).
std::string Unescape(absl::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      out.push_back(static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

struct Mount {
  std::string root;   // the path inside the hierarchy that is mounted
  std::string point;  // where
};

// The mount of the v2 hierarchy, or of v1's memory controller.
std::optional<Mount> FindMount(absl::string_view mountinfo, int version) {
  for (absl::string_view line : absl::StrSplit(mountinfo, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> halves = absl::StrSplit(line, absl::MaxSplits(" - ", 1));
    if (halves.size() != 2) continue;
    std::vector<absl::string_view> pre = absl::StrSplit(halves[0], ' ');
    std::vector<absl::string_view> post = absl::StrSplit(halves[1], ' ');
    if (pre.size() < 5 || post.size() < 3) continue;
    bool match = version == 2 ? post[0] == "cgroup2"
                              : post[0] == "cgroup" && absl::c_linear_search(absl::StrSplit(post[2], ','), "memory");
    if (match) return Mount{Unescape(pre[3]), Unescape(pre[4])};
  }
  return std::nullopt;
}

// The directories from `own` (a path in the hierarchy) up to the mount point.
std::vector<MemoryCgroup> Levels(const Mount& mount, const std::string& own, const std::string& sys_root, int version) {
  std::string top = sys_root + mount.point;
  std::string rel;  // below the mount point; a path outside the mounted root maps to the mount point itself
  if (mount.root == "/") {
    rel = own == "/" ? "" : own;
  } else if (own == mount.root || absl::StartsWith(own, mount.root + "/")) {
    rel = own.substr(mount.root.size());
  }
  std::vector<MemoryCgroup> out;
  for (std::string dir = top + rel;; dir = dir.substr(0, dir.rfind('/'))) {
    out.push_back({version, dir});
    if (dir.size() <= top.size()) break;
  }
  return out;
}

std::optional<uint64_t> ReadNumber(const std::string& path) {
  absl::StatusOr<std::string> text = ReadPseudoFile(path, 4096);
  if (!text.ok()) return std::nullopt;
  absl::string_view value = absl::StripAsciiWhitespace(*text);
  uint64_t n = 0;
  if (value == "max") return UINT64_MAX;
  if (!absl::SimpleAtoi(value, &n)) return std::nullopt;
  return n;
}

// "key value" lines of memory.stat.
uint64_t StatValue(const std::string& path, absl::string_view key) {
  absl::StatusOr<std::string> text = ReadPseudoFile(path);
  if (!text.ok()) return 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(line, ' ');
    uint64_t n = 0;
    if (kv.first == key && absl::SimpleAtoi(kv.second, &n)) return n;
  }
  return 0;
}

// What `level` still allows (limit minus working set), with its description;
// nullopt when it sets no limit or its files cannot be read.
std::optional<HostMemoryBudget> LevelBudget(const MemoryCgroup& level) {
  bool v2 = level.version == 2;
  std::optional<uint64_t> limit = ReadNumber(level.dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
  std::optional<uint64_t> usage = ReadNumber(level.dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"));
  if (!limit || !usage || *limit == UINT64_MAX || (!v2 && *limit >= kV1Unlimited)) return std::nullopt;
  uint64_t inactive = StatValue(level.dir + "/memory.stat", v2 ? "inactive_file" : "total_inactive_file");
  uint64_t working_set = *usage > inactive ? *usage - inactive : 0;
  return HostMemoryBudget{*limit > working_set ? *limit - working_set : 0,
                          absl::StrCat("cgroup v", level.version, " ", level.dir, ": limit ", *limit,
                                       ", working set ", working_set)};
}

}  // namespace

absl::StatusOr<std::vector<MemoryCgroup>> FindMemoryCgroups(const HostMemoryPaths& paths) {
  WEIGHTD_ASSIGN_OR_RETURN(std::string self_cgroup, ReadPseudoFile(paths.self_cgroup));
  WEIGHTD_ASSIGN_OR_RETURN(std::string mountinfo, ReadPseudoFile(paths.self_mountinfo, 16 << 20));
  // v1's memory controller when it is mounted (a hybrid system keeps memory
  // there even with a cgroup2 mount beside it), else the v2 hierarchy.
  for (int version : {1, 2}) {
    std::optional<std::string> own = OwnCgroupPath(self_cgroup, version);
    std::optional<Mount> mount = FindMount(mountinfo, version);
    if (own && mount) return Levels(*mount, *own, paths.sys_root, version);
  }
  return std::vector<MemoryCgroup>{};
}

absl::StatusOr<HostMemoryBudget> ReadHostMemoryBudget(const HostMemoryPaths& paths) {
  std::optional<uint64_t> available = MeminfoValue("MemAvailable", paths.meminfo);
  if (!available) return absl::NotFoundError(absl::StrCat(paths.meminfo, ": no MemAvailable line"));
  HostMemoryBudget budget{*available, "MemAvailable"};
  absl::StatusOr<std::vector<MemoryCgroup>> levels = FindMemoryCgroups(paths);
  if (!levels.ok()) return budget;  // no /proc/self/cgroup: no cgroup to obey
  for (const MemoryCgroup& level : *levels) {
    std::optional<HostMemoryBudget> bound = LevelBudget(level);
    if (bound && bound->available < budget.available) budget = *bound;
  }
  return budget;
}

}  // namespace weightd
