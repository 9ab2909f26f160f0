// The bare fill: the ceiling a load into fresh shareable memory can reach
// on this machine, with nothing of weightd in it (no hashing, no RPC, no
// seal). T threads each own one memfd holding an equal share of the
// checkpoint's bytes (so no inode lock is shared) and fill it from the
// page cache the way each page kind fills fastest (server/load/host_fill.h):
//   small    pread 1 MiB into a bounce buffer, pwrite it into the memfd;
//   thp      mmap + madvise(MADV_HUGEPAGE), then per 16 MiB
//   hugetlb  MADV_POPULATE_WRITE and pread straight into the mapping
//            (hugetlb: an MFD_HUGETLB memfd from the pool).
// Reports how many bytes really got 2 MiB pages, measured (smaps
// ShmemPmdMapped for THP), never assumed.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "common/io/proc_files.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/subcommands.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace weightd::bench {
namespace {

constexpr uint64_t kHuge = 2ull << 20;
constexpr uint64_t kSlice = 1ull << 20;
constexpr uint64_t kBlock = 16ull << 20;

struct Source {
  int fd;
  uint64_t size;
};

// Reads bytes [at, at + n) of the concatenated files into dst.
bool ReadRange(const std::vector<Source>& files, uint64_t at, uint64_t n, char* dst) {
  uint64_t base = 0;
  for (const Source& f : files) {
    while (n > 0 && at < base + f.size) {
      uint64_t k = std::min(n, base + f.size - at);
      ssize_t got = pread(f.fd, dst, k, static_cast<off_t>(at - base));
      if (got <= 0) return false;
      dst += got;
      at += static_cast<uint64_t>(got);
      n -= static_cast<uint64_t>(got);
    }
    base += f.size;
  }
  return n == 0;
}

struct Share {
  int fd = -1;
  char* map = nullptr;
  uint64_t size = 0;
  bool ok = true;
};

}  // namespace

// fill-files --pages small|thp|hugetlb [--threads T] FILE|DIR...
int FillFilesCommand(const Flags& flags) {
  std::string pages = flags.Get("pages", "small");
  int threads = static_cast<int>(flags.GetInt("threads", 2));
  std::vector<Source> files;
  uint64_t total = 0;
  for (const std::string& p : flags.positional()) {
    for (const std::string& f : CheckpointFiles(p)) {
      int fd = open(f.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return Fail("open " + f);
      files.push_back({fd, FileSize(f)});
      total += files.back().size;
    }
  }
  uint64_t per = (total + threads - 1) / threads;
  per = (per + kHuge - 1) / kHuge * kHuge;
  std::vector<Share> shares(threads);
  double start = Now();
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      Share& s = shares[t];
      uint64_t lo = std::min(total, t * per), n = std::min(total, lo + per) - lo;
      s.size = (n + kHuge - 1) / kHuge * kHuge;
      s.fd = memfd_create("weightd-bench-fill", MFD_CLOEXEC | (pages == "hugetlb" ? MFD_HUGETLB : 0));
      if (s.fd < 0 || ftruncate(s.fd, static_cast<off_t>(s.size)) != 0) {
        s.ok = false;
        return;
      }
      if (pages == "small") {
        std::vector<char> buf(kSlice);
        for (uint64_t d = 0; d < n && s.ok; d += kSlice) {
          uint64_t k = std::min(kSlice, n - d);
          s.ok = ReadRange(files, lo + d, k, buf.data()) && pwrite(s.fd, buf.data(), k, static_cast<off_t>(d)) == static_cast<ssize_t>(k);
        }
        return;
      }
      void* map = mmap(nullptr, s.size, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0);
      if (map == MAP_FAILED) {
        s.ok = false;
        return;
      }
      s.map = static_cast<char*>(map);
      if (pages == "thp") madvise(s.map, s.size, MADV_HUGEPAGE);
      for (uint64_t b = 0; b < n && s.ok; b += kBlock) {
        uint64_t bn = std::min(kBlock, n - b);
        (void)madvise(s.map + b, (bn + kHuge - 1) / kHuge * kHuge, MADV_POPULATE_WRITE);
        for (uint64_t d = 0; d < bn && s.ok; d += kSlice) s.ok = ReadRange(files, lo + b + d, std::min(kSlice, bn - d), s.map + b + d);
      }
    });
  }
  for (std::thread& w : workers) w.join();
  double seconds = Now() - start;
  uint64_t huge = 0;
  if (pages == "hugetlb") {
    for (const Share& s : shares) huge += s.ok ? s.size : 0;
  } else if (pages == "thp") {
    absl::StatusOr<std::string> smaps = ReadPseudoFile("/proc/self/smaps", 256 << 20);
    if (smaps.ok()) {
      std::map<uint64_t, uint64_t> pmd = ParseSmapsField(*smaps, "ShmemPmdMapped");
      for (const Share& s : shares) huge += pmd[reinterpret_cast<uint64_t>(s.map)];
    }
  }
  bool ok = true;
  for (Share& s : shares) {
    ok &= s.ok;
    if (s.map != nullptr) munmap(s.map, s.size);
    if (s.fd >= 0) close(s.fd);
  }
  for (const Source& f : files) close(f.fd);
  if (!ok) return Fail("fill-files --pages " + pages + ": a memfd, mapping or read failed (pool too small?)");
  Emit({{"seconds", seconds}, {"bytes", total}, {"gbps", total / seconds / 1e9}, {"threads", threads},
        {"pages", pages}, {"huge_page_bytes", huge}});
  return 0;
}

}  // namespace weightd::bench
