// An Env of files held in memory, for tests of the reader and the catalog
// that need no file system: FakeFile can refuse unaligned reads exactly as
// O_DIRECT does, and FakeEnv serves FakeFiles by path.
#ifndef WEIGHTD_TESTS_TESTING_FAKE_ENV_H_
#define WEIGHTD_TESTS_TESTING_FAKE_ENV_H_

#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/io/env.h"
#include "common/base/status.h"

namespace weightd::testing {

// A file in memory. With `align` > 0 it behaves like O_DIRECT: ReadSome
// refuses (EINVAL) an offset, length or buffer off the alignment and
// returns a short count at the end of the file.
class FakeFile final : public RandomAccessFile {
 public:
  FakeFile(std::string path, std::string data, uint64_t align, double cached = 1.0)
      : path_(std::move(path)), data_(std::move(data)), align_(align), cached_(cached) {}
  const std::string& path() const override { return path_; }
  uint64_t size() const override { return data_.size(); }
  int fd() const override { return -1; }
  int64_t mtime_ns() const override { return 7; }
  uint64_t direct_alignment() const override { return align_; }
  absl::StatusOr<double> CachedFraction() const override { return cached_; }
  absl::Status Advise(int) const override { return absl::OkStatus(); }

  absl::StatusOr<size_t> ReadSome(uint64_t offset, size_t n, char* dst) const override {
    ++reads_;
    if (align_ > 0 && (offset % align_ != 0 || n % align_ != 0 || reinterpret_cast<uintptr_t>(dst) % align_ != 0)) {
      return ErrnoToStatus(absl::StrCat(path_, ": unaligned read at ", offset), EINVAL);
    }
    if (offset >= data_.size()) return size_t{0};
    size_t got = std::min<size_t>(n, data_.size() - offset);
    std::memcpy(dst, data_.data() + offset, got);
    return got;
  }

  absl::Status ReadAt(uint64_t offset, size_t n, char* dst) const override {
    if (offset + n > data_.size()) return absl::OutOfRangeError("past the end");
    std::memcpy(dst, data_.data() + offset, n);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> ReopenDirect() const override {
    return reopen_direct ? reopen_direct() : RandomAccessFile::ReopenDirect();
  }

  int reads() const { return reads_; }
  std::function<absl::StatusOr<std::unique_ptr<RandomAccessFile>>()> reopen_direct;  // unset: refused

 private:
  std::string path_, data_;
  uint64_t align_;
  double cached_;
  mutable int reads_ = 0;
};

// Serves FakeFiles by path; OpenForDirectRead is refused when `direct_ok`
// is false, as tmpfs or an overlay refuses O_DIRECT.
class FakeEnv final : public Env {
 public:
  std::map<std::string, std::string> files;
  double cached = 1.0;
  bool direct_ok = true;
  int direct_opens = 0;

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    auto file = std::make_unique<FakeFile>(path, files.at(path), 0, cached);
    file->reopen_direct = [this, path] { return OpenForDirectRead(path); };
    return file;
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForDirectRead(const std::string& path) override {
    ++direct_opens;
    if (!direct_ok) return absl::FailedPreconditionError(absl::StrCat(path, ": the file system refuses O_DIRECT (EINVAL)"));
    return std::make_unique<FakeFile>(path, files.at(path), 512, cached);
  }
  absl::StatusOr<FileKind> Stat(const std::string&) override { return FileKind::kRegular; }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string&) override { return std::vector<std::string>{}; }
  absl::StatusOr<std::string> RealPath(const std::string& path) override { return path; }
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FAKE_ENV_H_
