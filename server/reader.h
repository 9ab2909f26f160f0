// CheckpointReader: reads byte ranges of a cataloged checkpoint's files for
// the load pipeline (DESIGN.md `Reader`). Today: pread(2) through Env with
// EINTR/short-read handling. The place for O_DIRECT, readahead hints and
// io_uring when measurements justify them.
//
// Thread-safety: Read() may be called from many threads at once.
#ifndef WEIGHTD_SERVER_READER_H_
#define WEIGHTD_SERVER_READER_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/catalog.h"
#include "server/model.h"

namespace weightd {

class CheckpointReader {
 public:
  // Opens every file of `catalog`; FAILED_PRECONDITION when a file changed
  // size since it was cataloged.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const Catalog& catalog);

  // Reads `n` bytes at byte `offset` of file `file` (index into
  // catalog.files) into `dst`. Errors name the file and offset.
  absl::Status Read(uint32_t file, uint64_t offset, uint64_t n, char* dst) const;
  // Size and mtime of each file as opened.
  const std::vector<FileStamp>& stamps() const { return stamps_; }

 private:
  std::vector<std::unique_ptr<RandomAccessFile>> files_;
  std::vector<FileStamp> stamps_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_READER_H_
