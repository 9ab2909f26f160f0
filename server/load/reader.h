// CheckpointReader: reads byte ranges of a cataloged checkpoint's files for
// the load pipeline (DESIGN.md `Reader`), through the files the catalog opened.
//
// Each file is read buffered (pread(2) through the page cache, with
// POSIX_FADV_SEQUENTIAL) or with O_DIRECT, chosen at Open():
//   off   always buffered;
//   on    O_DIRECT wherever the file system accepts it;
//   auto  O_DIRECT for a file less than half of which is in the page cache
//         (mincore(2)), buffered otherwise: a cached file is read at memory
//         speed, a cold one at disk speed without filling the page cache.
// A file system that refuses O_DIRECT (open or a probe read fails with
// EINVAL, e.g. some tmpfs and overlay mounts) falls back to buffered reads
// with one log line per process.
//
// O_DIRECT needs the file offset, the length and the buffer aligned to the
// file's direct_alignment(). A range [offset, offset + n) is read as the
// aligned span around it, into a caller's ReadBuffer (ReadInto: no copy) or,
// when the destination lines up with the file offset, straight into the
// destination with only the unaligned head and tail bounced (Read).
// io_uring was not adopted: see docs/performance.md.
//
// Thread-safety: Read() and ReadInto() may be called from many threads at
// once, each with its own ReadBuffer.
#ifndef WEIGHTD_SERVER_LOAD_READER_H_
#define WEIGHTD_SERVER_LOAD_READER_H_

#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/format/catalog.h"
#include "common/io/env.h"
#include "server/model/model.h"

namespace weightd {

enum class DirectIo { kAuto, kOn, kOff };
// "auto", "on" or "off"; INVALID_ARGUMENT otherwise.
absl::StatusOr<DirectIo> ParseDirectIo(absl::string_view text);

// A growable, page-aligned scratch buffer owned by one reading thread.
class ReadBuffer {
 public:
  ReadBuffer() = default;
  // At least `bytes` bytes aligned to `alignment` (a power of two); the
  // contents are not kept when it grows. Aborts like new on exhaustion.
  char* Get(uint64_t bytes, uint64_t alignment);
  uint64_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data_;
  uint64_t capacity_ = 0;
  uint64_t alignment_ = 0;
};

// Reads bytes [offset, offset + n) of `file`, which needs aligned reads
// (file.direct_alignment() > 0), as the aligned span around them into
// `scratch`: returns the address of byte `offset`, valid until `scratch` is
// used again. OUT_OF_RANGE when the file ends early.
absl::StatusOr<const char*> ReadDirectInto(const RandomAccessFile& file, uint64_t offset, uint64_t n,
                                           ReadBuffer& scratch);
// The same into `dst` (caller owns n bytes). When `dst` and `offset` are
// congruent modulo the alignment, the aligned middle is read straight into
// `dst` and only the head and tail go through `scratch`; otherwise pieces
// of at most kDirectPieceBytes go through `scratch` and are copied.
absl::Status ReadDirect(const RandomAccessFile& file, uint64_t offset, uint64_t n, char* dst, ReadBuffer& scratch);
inline constexpr uint64_t kDirectPieceBytes = 16ull << 20;

struct ReaderOptions {
  DirectIo direct_io = DirectIo::kAuto;
};

class CheckpointReader {
 public:
  // Reads the files `catalog` holds open (CatalogFile::file), never their
  // paths, so it reads the very files the catalog checked; an O_DIRECT twin
  // is a reopen of the same inode (RandomAccessFile::ReopenDirect). Shares
  // the open files with `catalog`. FAILED_PRECONDITION when a file changed
  // size since it was cataloged or the catalog holds no open file.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const Catalog& catalog,
                                                                const ReaderOptions& options = {});

  // Reads `n` bytes at byte `offset` of file `file` (index into
  // catalog.files) into `dst`; `scratch` serves O_DIRECT heads and tails.
  // Errors name the file and offset.
  absl::Status Read(uint32_t file, uint64_t offset, uint64_t n, char* dst, ReadBuffer& scratch) const;
  // Reads them into `scratch` instead: returns their address, valid until
  // `scratch` is used again.
  absl::StatusOr<const char*> ReadInto(uint32_t file, uint64_t offset, uint64_t n, ReadBuffer& scratch) const;
  // Whether `file` is read with O_DIRECT.
  bool direct(uint32_t file) const { return direct_[file] != nullptr; }

 private:
  std::vector<std::shared_ptr<const RandomAccessFile>> files_;
  std::vector<std::unique_ptr<RandomAccessFile>> direct_;  // null where buffered
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LOAD_READER_H_
