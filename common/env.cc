#include "common/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace weightd {
namespace {

class PosixFile final : public RandomAccessFile {
 public:
  PosixFile(std::string path, int fd, uint64_t size, int64_t mtime_ns)
      : path_(std::move(path)), fd_(fd), size_(size), mtime_ns_(mtime_ns) {}
  ~PosixFile() override { close(fd_); }

  const std::string& path() const override { return path_; }
  uint64_t size() const override { return size_; }
  int fd() const override { return fd_; }
  int64_t mtime_ns() const override { return mtime_ns_; }

  absl::Status ReadAt(uint64_t offset, size_t n, char* dst) const override {
    while (n > 0) {
      ssize_t got = pread(fd_, dst, n, static_cast<off_t>(offset));
      if (got < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(absl::StrCat(path_, ": read at byte ", offset), errno);
      }
      if (got == 0) {
        return absl::OutOfRangeError(
            absl::StrCat(path_, ": file ended at byte ", offset, " while ", n, " more bytes were expected"));
      }
      dst += got;
      offset += static_cast<uint64_t>(got);
      n -= static_cast<size_t>(got);
    }
    return absl::OkStatus();
  }

 private:
  std::string path_;
  int fd_;
  uint64_t size_;
  int64_t mtime_ns_;
};

class PosixEnv final : public Env {
 public:
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoToStatus(absl::StrCat(path, ": open"), errno);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      int err = errno;
      close(fd);
      return ErrnoToStatus(absl::StrCat(path, ": stat"), err);
    }
    if (!S_ISREG(st.st_mode)) {
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
    }
    return std::make_unique<PosixFile>(path, fd, static_cast<uint64_t>(st.st_size),
                                       int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec);
  }

  absl::StatusOr<FileKind> Stat(const std::string& path) override {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return FileKind::kMissing;
      return ErrnoToStatus(absl::StrCat(path, ": stat"), errno);
    }
    if (S_ISREG(st.st_mode)) return FileKind::kRegular;
    if (S_ISDIR(st.st_mode)) return FileKind::kDirectory;
    return FileKind::kOther;
  }

  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    DIR* dir = opendir(path.c_str());
    if (dir == nullptr) return ErrnoToStatus(absl::StrCat(path, ": opendir"), errno);
    std::vector<std::string> names;
    while (struct dirent* entry = readdir(dir)) {
      std::string name = entry->d_name;
      if (name != "." && name != "..") names.push_back(std::move(name));
    }
    closedir(dir);
    std::sort(names.begin(), names.end());
    return names;
  }

  absl::StatusOr<std::string> RealPath(const std::string& path) override {
    char buf[PATH_MAX];
    if (realpath(path.c_str(), buf) == nullptr) return ErrnoToStatus(absl::StrCat(path, ": realpath"), errno);
    return std::string(buf);
  }
};

}  // namespace

Env* Env::Default() {
  static Env* env = new PosixEnv();
  return env;
}

absl::StatusOr<std::string> ReadSmallFile(Env& env, const std::string& path, uint64_t max_bytes) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, env.OpenForRead(path));
  if (file->size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", file->size(), " bytes exceeds the ", max_bytes, "-byte limit for this file"));
  }
  std::string data(file->size(), '\0');
  WEIGHTD_RETURN_IF_ERROR(file->ReadAt(0, data.size(), data.data()));
  return data;
}

}  // namespace weightd
