#include "server/reader.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace weightd {

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const Catalog& catalog) {
  auto reader = std::make_unique<CheckpointReader>();
  for (const CatalogFile& f : catalog.files) {
    WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, Env::Default()->OpenForRead(f.path));
    if (file->size() != f.size) {
      return absl::FailedPreconditionError(
          absl::StrCat(f.name, ": file changed size while loading (", f.size, " -> ", file->size(), " bytes)"));
    }
    reader->stamps_.push_back({f.name, f.size, file->mtime_ns()});
    reader->files_.push_back(std::move(file));
  }
  return reader;
}

absl::Status CheckpointReader::Read(uint32_t file, uint64_t offset, uint64_t n, char* dst) const {
  return files_[file]->ReadAt(offset, n, dst);
}

}  // namespace weightd
