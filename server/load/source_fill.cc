#include "server/load/source_fill.h"

// libxxhash's run-time dispatch (AVX2 where the CPU has it): see host_fill.cc.
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h>
#else
#include <xxhash.h>
#endif

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/format/content_hash.h"

namespace weightd {

SourceFill::SourceFill(HostSource& source, std::vector<HostSegment*> segments,
                       std::vector<std::vector<SegmentTensor>> tensors,
                       std::vector<std::vector<uint64_t>>& block_hashes)
    : source_(source), segments_(std::move(segments)), tensors_(std::move(tensors)), block_hashes_(block_hashes) {
  absl::MutexLock lock(&mu_);
  stage_.assign(segments_.size(), Stage::kFresh);
}

SourceFill::~SourceFill() { (void)Wait(); }

void SourceFill::Start(int threads) {
  std::vector<std::vector<HostSource::Range>> ranges(segments_.size());
  for (size_t i = 0; i < segments_.size(); ++i) {
    for (const SegmentTensor& t : tensors_[i]) ranges[i].push_back({t.offset, t.nbytes});
  }
  threads_.emplace_back([this, ranges = std::move(ranges)] {
    absl::Status st = source_.Fill(segments_, ranges, [this](uint32_t segment) { return Filled(segment); });
    absl::MutexLock lock(&mu_);
    fill_done_ = true;
    Finish(st);
  });
  for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { Hasher(); });
  threads_.emplace_back([this] { Populator(); });
}

void SourceFill::Populator() {
  for (size_t i = 0; i < segments_.size(); ++i) {
    {
      absl::MutexLock lock(&mu_);
      if (fill_done_ || !error_.ok()) return;
      if (stage_[i] != Stage::kFresh) continue;  // the source got there first
      stage_[i] = Stage::kPopulating;
    }
    // Best effort: without MADV_POPULATE_WRITE, or short of memory, the
    // source's writes make the pages.
    // Without a mapping where that gives the same pages; THP only through
    // the advised mapping.
    HostSegment& segment = *segments_[i];
    if (segment.page_kind() == PageKind::kShmemThp) {
      (void)segment.Populate(0, segment.size());
    } else {
      (void)segment.Preallocate();
    }
    absl::MutexLock lock(&mu_);
    stage_[i] = Stage::kFresh;
  }
}

absl::Status SourceFill::Wait() {
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  absl::MutexLock lock(&mu_);
  return error_;
}

void SourceFill::Finish(absl::Status status) {
  if (error_.ok() && !status.ok()) error_ = std::move(status);
}

// In the source's thread: the seal is the check that the source let go.
absl::Status SourceFill::Filled(uint32_t segment) {
  if (cancel_ != nullptr && cancel_->load()) return absl::UnavailableError("load cancelled: weightd is shutting down");
  {
    absl::MutexLock lock(&mu_);
    if (segment >= segments_.size() || stage_[segment] == Stage::kReported) {
      return absl::InternalError(absl::StrCat("host segment ", segment, " reported filled twice or unknown"));
    }
    auto not_populating = [this, segment]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stage_[segment] != Stage::kPopulating;
    };
    mu_.Await(absl::Condition(&not_populating));
    stage_[segment] = Stage::kReported;
  }
  absl::Status sealed = segments_[segment]->Seal(/*lock=*/false);
  if (!sealed.ok()) return Annotate(sealed, absl::StrCat("sealing host segment ", segment, " after its transfer"));
  absl::MutexLock lock(&mu_);
  queue_.push_back(segment);
  return absl::OkStatus();
}

void SourceFill::Hasher() {
  for (;;) {
    uint32_t segment;
    {
      absl::MutexLock lock(&mu_);
      // Per transfer: nothing is hashed before the source has returned.
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return (!queue_.empty() && hashing_ == SourceHashing::kPerSegment) || fill_done_ || !error_.ok();
      };
      mu_.Await(absl::Condition(&ready));
      if (!error_.ok() || queue_.empty()) return;
      segment = queue_.front();
      queue_.pop_front();
    }
    absl::Status st = HashSegment(segment);
    if (!st.ok()) {
      absl::MutexLock lock(&mu_);
      Finish(st);
      return;
    }
  }
}

absl::Status SourceFill::HashSegment(uint32_t segment) {
  const HostSegment& s = *segments_[segment];
  const char* data = s.data();
  std::vector<SegmentTensor> order = tensors_[segment];
  std::sort(order.begin(), order.end(), [](const SegmentTensor& a, const SegmentTensor& b) { return a.offset < b.offset; });
  uint64_t covered = 0;  // bytes below this are checked or hashed
  auto zero_until = [&](uint64_t end) -> absl::Status {
    for (uint64_t at = covered; at < end; ++at) {
      if (data[at] != 0) {
        return absl::DataLossError(absl::StrCat("host segment ", segment, ": byte ", at,
                                                " lies outside every tensor and is not zero after the transfer"));
      }
    }
    return absl::OkStatus();
  };
  for (const SegmentTensor& t : order) {
    if (t.offset > covered) WEIGHTD_RETURN_IF_ERROR(zero_until(t.offset));
    std::vector<uint64_t>& blocks = block_hashes_[t.tensor];
    for (uint64_t start = 0, b = 0; start < t.nbytes; start += kHashBlockBytes, ++b) {
      uint64_t n = std::min(kHashBlockBytes, t.nbytes - start);
      blocks[b] = XXH3_64bits(data + t.offset + start, n);
      hashed_.fetch_add(n);
    }
    covered = std::max(covered, t.offset + t.nbytes);
  }
  return zero_until(s.size());
}

}  // namespace weightd
