#include "common/memory/huge_pages.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "common/io/proc_files.h"

namespace weightd {
namespace {

bool ThpAllowed(const std::string& word) {
  return word == "advise" || word == "within_size" || word == "always" || word == "force";
}

std::string Mib(uint64_t bytes) { return absl::StrCat(bytes / (1 << 20), " MiB"); }

}  // namespace

std::string ParseShmemEnabled(absl::string_view text) {
  size_t open = text.find('['), close = text.find(']');
  if (open == absl::string_view::npos || close == absl::string_view::npos || close < open) return "";
  return std::string(text.substr(open + 1, close - open - 1));
}

HugePageSystem ReadHugePageSystem(const std::string& meminfo_path, const std::string& shmem_enabled_path) {
  HugePageSystem system;
  absl::StatusOr<std::string> meminfo = ReadPseudoFile(meminfo_path);
  if (meminfo.ok()) {
    std::map<std::string, uint64_t> values = ParseMeminfo(*meminfo);
    if (values.count("HugePages_Free") && values["Hugepagesize"] == kHugePageBytes) {
      system.hugetlb_free_bytes = values["HugePages_Free"] * kHugePageBytes;
    }
  }
  absl::StatusOr<std::string> shmem = ReadPseudoFile(shmem_enabled_path, 4096);
  if (shmem.ok()) system.shmem_thp = ParseShmemEnabled(*shmem);
  return system;
}

const char* PageKindName(PageKind kind) {
  switch (kind) {
    case PageKind::kSmall: return "4 KiB";
    case PageKind::kHugetlb: return "2 MiB hugetlb";
    case PageKind::kShmemThp: return "2 MiB shmem THP";
  }
  return "?";
}

PageChoice ChoosePages(const HugePageSystem& system, uint64_t hugetlb_bytes, bool allowed) {
  PageChoice choice;
  if (!allowed) {
    choice.reason = "huge pages are turned off (--huge-pages false)";
    return choice;
  }
  std::string thp = system.shmem_thp.empty() ? "unreadable" : system.shmem_thp;
  bool thp_ok = ThpAllowed(system.shmem_thp);
  if (thp_ok) {
    choice.fallback = PageKind::kShmemThp;
    choice.advise = system.shmem_thp == "advise";
  }
  std::string pool = absl::StrCat("hugetlb pool has ", Mib(system.hugetlb_free_bytes), " free of the ",
                                  Mib(hugetlb_bytes), " needed");
  if (hugetlb_bytes > 0 && system.hugetlb_free_bytes >= hugetlb_bytes) {
    choice.kind = PageKind::kHugetlb;
    choice.reason = pool;
  } else if (thp_ok) {
    choice.kind = PageKind::kShmemThp;
    choice.reason = absl::StrCat(pool, "; shmem_enabled is ", thp);
  } else {
    choice.reason = absl::StrCat(pool, "; shmem_enabled is ", thp,
                                 " (allow huge pages: sysctl vm.nr_hugepages, or shmem_enabled advise)");
  }
  return choice;
}

}  // namespace weightd
