// Which pages a load's host segments get: 2 MiB pages from the hugetlb pool,
// 2 MiB shmem transparent huge pages (THP), or 4 KiB pages, chosen per load
// from what the kernel allows at that moment. Why it matters: a 2.4 GiB
// model on 4 KiB pages is 600k pages to allocate, zero and map, in the
// daemon and in every client that touches them; on 2 MiB pages 1,200
// (measured in docs/performance.md).
//
// Sources: /proc/meminfo's HugePages_Free and Hugepagesize (proc(5);
// set by an operator with sysctl vm.nr_hugepages), and
// /sys/kernel/mm/transparent_hugepage/shmem_enabled, whose selected word is
// in brackets: "always within_size [advise] never deny force"
// (Documentation/admin-guide/mm/transhuge.rst). With "advise" a shmem
// mapping gets huge pages only after madvise(MADV_HUGEPAGE); "always" and
// "within_size" need no advice; "never" and "deny" allow none, "force"
// forces them everywhere. THP is decided when a page is allocated through
// a mapping (a fault or MADV_POPULATE_WRITE), so a THP segment must be
// filled through its mapping, not with pwrite(2).
//
// Tests force every branch by handing ChoosePages a HugePageSystem of their
// own (LoaderOptions::huge_page_probe); nothing here changes a kernel setting.
#ifndef WEIGHTD_COMMON_MEMORY_HUGE_PAGES_H_
#define WEIGHTD_COMMON_MEMORY_HUGE_PAGES_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"

namespace weightd {

inline constexpr uint64_t kHugePageBytes = 2ull << 20;
inline constexpr char kShmemEnabledPath[] = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

// What the kernel offers, read at one moment.
struct HugePageSystem {
  // HugePages_Free x Hugepagesize of the default pool; 0 unless that pool's
  // pages are 2 MiB.
  uint64_t hugetlb_free_bytes = 0;
  // The selected word of shmem_enabled ("advise", "never", ...); "" when
  // the file cannot be read (no THP support, or no /sys).
  std::string shmem_thp;
};
using HugePageProbe = std::function<HugePageSystem()>;

// The machine's, from `meminfo_path` and `shmem_enabled_path`. Never fails:
// an unreadable file reads as "nothing offered".
HugePageSystem ReadHugePageSystem(const std::string& meminfo_path = "/proc/meminfo",
                                  const std::string& shmem_enabled_path = kShmemEnabledPath);
// The bracketed word of a shmem_enabled text; "" when there is none.
std::string ParseShmemEnabled(absl::string_view text);

enum class PageKind { kSmall, kHugetlb, kShmemThp };
// "4 KiB", "2 MiB hugetlb", "2 MiB shmem THP".
const char* PageKindName(PageKind kind);

// The pages a load asks for. A segment asked for kHugetlb that the pool
// refuses (it ran short, e.g. another load took it meanwhile) gets
// `fallback` instead.
struct PageChoice {
  PageKind kind = PageKind::kSmall;
  PageKind fallback = PageKind::kSmall;  // kSmall or kShmemThp
  bool advise = false;                   // THP needs madvise(MADV_HUGEPAGE) (shmem_enabled "advise")
  std::string reason;                    // one phrase for the load's log line
};

// The choice for a load whose host segments need `hugetlb_bytes` of pool
// pages (each rounded up to 2 MiB): the pool when it has them all, else
// shmem THP when shmem_enabled is advise, within_size, always or force, else
// 4 KiB. `allowed` false (--huge-pages false) always chooses 4 KiB.
PageChoice ChoosePages(const HugePageSystem& system, uint64_t hugetlb_bytes, bool allowed);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_MEMORY_HUGE_PAGES_H_
