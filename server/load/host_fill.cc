#include "server/load/host_fill.h"

// libxxhash's run-time dispatch (AVX2 / AVX-512 where the CPU has them):
// XXH3 of a 1 MiB slice in cache ran at 6-8 GB/s through it against 2-3 GB/s
// through the plain entry points of Debian's build (compiled for baseline
// x86-64), same digests. It redefines XXH3_64bits_update and friends.
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h>
#endif

#include <time.h>

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/base/status.h"

namespace weightd {

namespace {

// CPU seconds this thread has run: a populate's cost without the time the
// thread waited for a CPU, so that a busy machine is not taken for a stall
// (direct compaction runs in the faulting thread and counts here).
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

}  // namespace

FillThread::FillThread() : hasher(XXH3_createState(), &XXH3_freeState) {}

std::string HostFill::stall_note() const {
  absl::MutexLock lock(&mu_);
  return stall_note_;
}

absl::StatusOr<uint64_t> HostFill::FillBlock(uint32_t file, uint64_t file_offset, uint64_t n, HostSegment& segment,
                                             uint64_t at, FillThread& thread) {
  PageKind kind = segment.page_kind();
  if (kind == PageKind::kSmall) return Pwrite(file, file_offset, n, segment, at, thread);
  if (kind == PageKind::kShmemThp) {
    if (stalled_.load()) {
      segment.AvoidHugePages();
      return Pwrite(file, file_offset, n, segment, at, thread);
    }
    WEIGHTD_RETURN_IF_ERROR(PopulateThp(segment, at, n, thread));
  } else if (!no_populate_.load()) {
    absl::StatusOr<uint64_t> populated = segment.Populate(at, n);
    if (absl::IsUnimplemented(populated.status())) {
      no_populate_ = true;  // pages fault in as the reads write them
    } else {
      WEIGHTD_RETURN_IF_ERROR(populated.status());
      populated_.fetch_add(n);
    }
  }
  return ReadHashed(file, file_offset, n, segment.writable() + at, thread);
}

absl::StatusOr<uint64_t> HostFill::ReadHashed(uint32_t file, uint64_t file_offset, uint64_t n, char* dst,
                                              FillThread& thread) {
  XXH3_state_t& hasher = *thread.hasher;
  XXH3_64bits_reset(&hasher);
  uint64_t piece = reader_.direct(file) ? n : kFillSliceBytes;
  for (uint64_t done = 0; done < n; done += piece) {
    uint64_t m = std::min(piece, n - done);
    WEIGHTD_RETURN_IF_ERROR(reader_.Read(file, file_offset + done, m, dst + done, thread.scratch));
    XXH3_64bits_update(&hasher, dst + done, m);
  }
  return XXH3_64bits_digest(&hasher);
}

absl::StatusOr<uint64_t> HostFill::Pwrite(uint32_t file, uint64_t file_offset, uint64_t n, HostSegment& segment,
                                          uint64_t at, FillThread& thread) {
  XXH3_state_t& hasher = *thread.hasher;
  XXH3_64bits_reset(&hasher);
  uint64_t piece = reader_.direct(file) ? n : kFillSliceBytes;
  for (uint64_t done = 0; done < n; done += piece) {
    uint64_t m = std::min(piece, n - done);
    WEIGHTD_ASSIGN_OR_RETURN(const char* src, reader_.ReadInto(file, file_offset + done, m, thread.scratch));
    for (uint64_t s = 0; s < m; s += kFillSliceBytes) {
      uint64_t k = std::min(kFillSliceBytes, m - s);
      XXH3_64bits_update(&hasher, src + s, k);
      WEIGHTD_RETURN_IF_ERROR(segment.Write(at + done + s, src + s, k));
    }
  }
  return XXH3_64bits_digest(&hasher);
}

absl::Status HostFill::PopulateThp(HostSegment& segment, uint64_t at, uint64_t n, FillThread& thread) {
  if (no_populate_.load()) return absl::OkStatus();
  double start = ThreadCpuSeconds();
  absl::StatusOr<uint64_t> populated = segment.Populate(at, n);
  if (absl::IsUnimplemented(populated.status())) {
    no_populate_ = true;
    return absl::OkStatus();
  }
  WEIGHTD_RETURN_IF_ERROR(populated.status());
  double seconds = ThreadCpuSeconds() - start;
  uint64_t before = populated_.fetch_add(n);
  if (*populated < budget_.min_block_bytes) return absl::OkStatus();  // too short to judge
  bool slow = static_cast<double>(*populated) < budget_.min_populate_bytes_per_second * seconds;
  thread.slow_blocks = slow ? thread.slow_blocks + 1 : 0;
  if (thread.slow_blocks < budget_.stall_blocks || stalled_.exchange(true)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  stall_note_ = absl::StrFormat(
      "fell back to 4 KiB pages after %d MiB on huge pages: populating %d KiB of 2 MiB pages took %.1f ms of CPU, under "
      "the %.2f GB/s floor %d times in a row (compaction stall)",
      (before + n) >> 20, *populated >> 10, seconds * 1e3, budget_.min_populate_bytes_per_second / 1e9, thread.slow_blocks);
  return absl::OkStatus();
}

}  // namespace weightd
