#include "server/load/reader.h"

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/base/align.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace weightd {
namespace {

constexpr double kColdFraction = 0.5;  // auto: O_DIRECT below this cached fraction


// Reads the aligned span [start, start + len) into `buf` until at least
// `need` bytes arrived; the span may run past the end of the file, where
// O_DIRECT returns a short count.
absl::Status ReadSpan(const RandomAccessFile& file, uint64_t start, uint64_t len, char* buf, uint64_t need) {
  uint64_t align = file.direct_alignment();
  uint64_t got = 0;
  while (got < need) {
    WEIGHTD_ASSIGN_OR_RETURN(size_t n, file.ReadSome(start + got, len - got, buf + got));
    got += n;
    if (got < need && (n == 0 || got % align != 0)) {
      return absl::OutOfRangeError(absl::StrCat(file.path(), ": file ended at byte ", start + got, " while ",
                                                need - got, " more bytes were expected"));
    }
  }
  return absl::OkStatus();
}

// Copies [offset, offset + n) through `scratch` into dst.
absl::Status BounceDirect(const RandomAccessFile& file, uint64_t offset, uint64_t n, char* dst, ReadBuffer& scratch) {
  WEIGHTD_ASSIGN_OR_RETURN(const char* src, ReadDirectInto(file, offset, n, scratch));
  std::memcpy(dst, src, n);
  return absl::OkStatus();
}

void LogDirectRefusedOnce(const absl::Status& why) {
  static std::atomic<bool> logged{false};
  if (!logged.exchange(true)) {
    LogWarning(absl::StrCat("O_DIRECT unavailable, reading buffered instead (logged once): ", why.message()));
  }
}

// The O_DIRECT twin of `buffered` (the same inode, reopened), or null where
// `mode` and the page cache say buffered or the file system refuses O_DIRECT.
std::unique_ptr<RandomAccessFile> MaybeOpenDirect(const RandomAccessFile& buffered, DirectIo mode) {
  if (mode == DirectIo::kOff || buffered.size() == 0) return nullptr;
  if (mode == DirectIo::kAuto) {
    absl::StatusOr<double> cached = buffered.CachedFraction();
    if (!cached.ok() || *cached >= kColdFraction) return nullptr;
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> direct = buffered.ReopenDirect();
  if (!direct.ok()) {
    LogDirectRefusedOnce(direct.status());
    return nullptr;
  }
  // Some file systems accept O_DIRECT at open and refuse the reads.
  ReadBuffer probe;
  absl::StatusOr<const char*> read = ReadDirectInto(**direct, 0, std::min<uint64_t>(buffered.size(), 1), probe);
  if (!read.ok()) {
    LogDirectRefusedOnce(read.status());
    return nullptr;
  }
  return std::move(*direct);
}

}  // namespace

absl::StatusOr<DirectIo> ParseDirectIo(absl::string_view text) {
  if (text == "auto") return DirectIo::kAuto;
  if (text == "on") return DirectIo::kOn;
  if (text == "off") return DirectIo::kOff;
  return absl::InvalidArgumentError(absl::StrCat("direct I/O must be auto, on or off, got '", text, "'"));
}

char* ReadBuffer::Get(uint64_t bytes, uint64_t alignment) {
  if (bytes > capacity_ || alignment > alignment_) {
    alignment = std::max<uint64_t>(alignment, 4096);
    uint64_t size = AlignUp(std::max<uint64_t>(bytes, 1), alignment);
    data_.reset(static_cast<char*>(std::aligned_alloc(alignment, size)));
    if (data_ == nullptr) throw std::bad_alloc();
    capacity_ = size;
    alignment_ = alignment;
  }
  return data_.get();
}

absl::StatusOr<const char*> ReadDirectInto(const RandomAccessFile& file, uint64_t offset, uint64_t n,
                                           ReadBuffer& scratch) {
  uint64_t align = file.direct_alignment();
  uint64_t start = AlignDown(offset, align), end = AlignUp(offset + n, align);
  char* buf = scratch.Get(end - start, align);
  WEIGHTD_RETURN_IF_ERROR(ReadSpan(file, start, end - start, buf, offset + n - start));
  return buf + (offset - start);
}

absl::Status ReadDirect(const RandomAccessFile& file, uint64_t offset, uint64_t n, char* dst, ReadBuffer& scratch) {
  uint64_t align = file.direct_alignment();
  uint64_t end = offset + n;
  if ((reinterpret_cast<uintptr_t>(dst) - offset) % align != 0) {
    for (uint64_t at = offset; at < end; at += kDirectPieceBytes) {
      uint64_t piece = std::min(kDirectPieceBytes, end - at);
      WEIGHTD_RETURN_IF_ERROR(BounceDirect(file, at, piece, dst + (at - offset), scratch));
    }
    return absl::OkStatus();
  }
  // Congruent: every aligned file offset lands on an aligned address of dst.
  uint64_t head_end = std::min(AlignUp(offset, align), end);
  uint64_t middle_end = std::max(AlignDown(end, align), head_end);
  if (head_end > offset) WEIGHTD_RETURN_IF_ERROR(BounceDirect(file, offset, head_end - offset, dst, scratch));
  if (middle_end > head_end) {
    char* middle = dst + (head_end - offset);
    WEIGHTD_RETURN_IF_ERROR(ReadSpan(file, head_end, middle_end - head_end, middle, middle_end - head_end));
  }
  if (end > middle_end) {
    WEIGHTD_RETURN_IF_ERROR(BounceDirect(file, middle_end, end - middle_end, dst + (middle_end - offset), scratch));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const Catalog& catalog,
                                                                         const ReaderOptions& options) {
  auto reader = std::make_unique<CheckpointReader>();
  for (const CatalogFile& f : catalog.files) {
    if (f.file == nullptr) return absl::FailedPreconditionError(absl::StrCat(f.name, ": the catalog holds no open file"));
    WEIGHTD_ASSIGN_OR_RETURN(uint64_t size, f.file->CurrentSize());
    if (size != f.size) {
      return absl::FailedPreconditionError(
          absl::StrCat(f.name, ": file changed size while loading (", f.size, " -> ", size, " bytes)"));
    }
    std::unique_ptr<RandomAccessFile> direct = MaybeOpenDirect(*f.file, options.direct_io);
    if (direct == nullptr) (void)f.file->Advise(POSIX_FADV_SEQUENTIAL);  // a hint: larger readahead
    reader->files_.push_back(f.file);
    reader->direct_.push_back(std::move(direct));
  }
  return reader;
}

absl::Status CheckpointReader::Read(uint32_t file, uint64_t offset, uint64_t n, char* dst, ReadBuffer& scratch) const {
  if (direct_[file] != nullptr) return ReadDirect(*direct_[file], offset, n, dst, scratch);
  return files_[file]->ReadAt(offset, n, dst);
}

absl::StatusOr<const char*> CheckpointReader::ReadInto(uint32_t file, uint64_t offset, uint64_t n,
                                                       ReadBuffer& scratch) const {
  if (direct_[file] != nullptr) return ReadDirectInto(*direct_[file], offset, n, scratch);
  char* buf = scratch.Get(n, 64);
  WEIGHTD_RETURN_IF_ERROR(files_[file]->ReadAt(offset, n, buf));
  return buf;
}

}  // namespace weightd
