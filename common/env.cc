#include "common/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
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
  PosixFile(std::string path, int fd, uint64_t size, int64_t mtime_ns, uint64_t direct_alignment)
      : path_(std::move(path)), fd_(fd), size_(size), mtime_ns_(mtime_ns), direct_alignment_(direct_alignment) {}
  ~PosixFile() override { close(fd_); }

  const std::string& path() const override { return path_; }
  uint64_t size() const override { return size_; }
  int fd() const override { return fd_; }
  int64_t mtime_ns() const override { return mtime_ns_; }
  uint64_t direct_alignment() const override { return direct_alignment_; }

  absl::StatusOr<size_t> ReadSome(uint64_t offset, size_t n, char* dst) const override {
    for (;;) {
      ssize_t got = pread(fd_, dst, n, static_cast<off_t>(offset));
      if (got >= 0) return static_cast<size_t>(got);
      if (errno != EINTR) return ErrnoToStatus(absl::StrCat(path_, ": read at byte ", offset), errno);
    }
  }

  absl::StatusOr<double> CachedFraction() const override {
    if (size_ == 0) return 1.0;
    void* map = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
    if (map == MAP_FAILED) return ErrnoToStatus(absl::StrCat(path_, ": mmap for mincore"), errno);
    // A sample, not every page: mincore over a 1 GB file costs tens of ms.
    constexpr uint64_t kWindows = 64, kWindowBytes = 1 << 20;
    uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    uint64_t stride = std::max<uint64_t>(size_ / kWindows, kWindowBytes) / page * page;
    std::vector<unsigned char> resident(kWindowBytes / page);
    uint64_t seen = 0, in = 0;
    int err = 0;
    for (uint64_t at = 0; at < size_ && err == 0; at += stride) {
      uint64_t len = std::min(kWindowBytes, size_ - at);
      if (mincore(static_cast<char*>(map) + at, len, resident.data()) != 0) err = errno;
      for (uint64_t i = 0; i < (len + page - 1) / page; ++i) in += resident[i] & 1;
      seen += (len + page - 1) / page;
    }
    munmap(map, size_);
    if (err != 0) return ErrnoToStatus(absl::StrCat(path_, ": mincore"), err);
    return static_cast<double>(in) / static_cast<double>(seen);
  }

  absl::Status Advise(int advice) const override {
    int err = posix_fadvise(fd_, 0, 0, advice);  // returns the error, does not set errno
    return err == 0 ? absl::OkStatus() : ErrnoToStatus(absl::StrCat(path_, ": posix_fadvise"), err);
  }

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
  uint64_t direct_alignment_;
};

// The alignment O_DIRECT reads of `fd` need: the larger of statx's memory
// and offset alignments (Linux 6.1+), else 4096 (a page: enough for every
// logical block size in use).
uint64_t DirectAlignment(int fd) {
  struct statx sx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) != 0 &&
      sx.stx_dio_offset_align != 0) {
    return std::max<uint64_t>(sx.stx_dio_mem_align, sx.stx_dio_offset_align);
  }
  return 4096;
}

class PosixEnv final : public Env {
 public:
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    return Open(path, false);
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForDirectRead(const std::string& path) override {
    return Open(path, true);
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

 private:
  static absl::StatusOr<std::unique_ptr<RandomAccessFile>> Open(const std::string& path, bool direct) {
    // O_NONBLOCK: opening a FIFO or a device named like a checkpoint must not
    // block; anything but a regular file is refused below.
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | (direct ? O_DIRECT : 0));
    if (fd < 0 && direct && errno == EINVAL) {
      return absl::FailedPreconditionError(absl::StrCat(path, ": the file system refuses O_DIRECT (EINVAL)"));
    }
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
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return std::make_unique<PosixFile>(path, fd, static_cast<uint64_t>(st.st_size),
                                       int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec,
                                       direct ? DirectAlignment(fd) : 0);
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
