#include "common/io/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/mempolicy.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "common/base/scoped_fd.h"
#include "common/io/proc_files.h"

namespace weightd {
namespace {

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

// What a non-regular file is, for refusals.
const char* KindName(mode_t mode) {
  if (S_ISDIR(mode)) return "directory";
  if (S_ISFIFO(mode)) return "FIFO";
  if (S_ISSOCK(mode)) return "socket";
  if (S_ISCHR(mode)) return "character device";
  if (S_ISBLK(mode)) return "block device";
  return "unknown kind";
}

std::string ProcFdPath(int fd) { return absl::StrCat("/proc/self/fd/", fd); }

bool SameInode(const struct stat& a, const struct stat& b) { return a.st_dev == b.st_dev && a.st_ino == b.st_ino; }

// Opens /proc/self/fd/`fd` (proc(5)): a new open file description of the
// inode `fd` refers to, whatever its path names by now.
absl::StatusOr<ScopedFd> Reopen(int fd, const std::string& path, int flags) {
  ScopedFd reopened(open(ProcFdPath(fd).c_str(), flags | O_RDONLY | O_CLOEXEC | O_NOCTTY));
  if (!reopened.valid() && (flags & O_DIRECT) != 0 && errno == EINVAL) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": the file system refuses O_DIRECT (EINVAL)"));
  }
  if (!reopened.valid() && errno == ENOENT) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": cannot reopen through ", ProcFdPath(fd), " (is /proc mounted?)"));
  }
  if (!reopened.valid()) return ErrnoToStatus(absl::StrCat(path, ": open"), errno);
  return reopened;
}

class PosixFile final : public RandomAccessFile {
 public:
  PosixFile(std::string path, ScopedFd fd, const struct stat& st, uint64_t direct_alignment)
      : path_(std::move(path)),
        fd_(fd.Release()),
        st_(st),
        size_(static_cast<uint64_t>(st.st_size)),
        mtime_ns_(int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec),
        direct_alignment_(direct_alignment) {}
  ~PosixFile() override { close(fd_); }

  absl::StatusOr<std::string> ResolvedPath() const override {
    char buf[PATH_MAX];
    ssize_t n = readlink(ProcFdPath(fd_).c_str(), buf, sizeof(buf));
    if (n < 0) return ErrnoToStatus(absl::StrCat(path_, ": readlink ", ProcFdPath(fd_)), errno);
    if (static_cast<size_t>(n) == sizeof(buf)) return absl::OutOfRangeError(absl::StrCat(path_, ": resolved path too long"));
    std::string resolved(buf, static_cast<size_t>(n));
    // A deleted file reads "<path> (deleted)"; a moved one its new path.
    // Either way the name must still lead to this very inode.
    struct stat at;
    if (resolved.empty() || resolved[0] != '/' || stat(resolved.c_str(), &at) != 0 || !SameInode(at, st_)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path_, ": the opened file no longer lies at ", resolved, " (moved or deleted meanwhile)"));
    }
    return resolved;
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> ReopenDirect() const override {
    WEIGHTD_ASSIGN_OR_RETURN(ScopedFd fd, Reopen(fd_, path_, O_DIRECT));
    struct stat st;
    if (fstat(fd.get(), &st) != 0) return ErrnoToStatus(absl::StrCat(path_, ": stat"), errno);
    uint64_t align = DirectAlignment(fd.get());
    return std::make_unique<PosixFile>(path_, std::move(fd), st, align);
  }

  absl::StatusOr<uint64_t> CurrentSize() const override {
    struct stat st;
    if (fstat(fd_, &st) != 0) return ErrnoToStatus(absl::StrCat(path_, ": stat"), errno);
    return static_cast<uint64_t>(st.st_size);
  }

  const std::string& path() const override { return path_; }
  uint64_t size() const override { return size_; }
  int fd() const override { return fd_; }
  int64_t mtime_ns() const override { return mtime_ns_; }
  FileIdentity identity() const override {
    return FileIdentity{static_cast<uint64_t>(st_.st_dev), static_cast<uint64_t>(st_.st_ino), size_, mtime_ns_,
                        int64_t{st_.st_ctim.tv_sec} * 1'000'000'000 + st_.st_ctim.tv_nsec};
  }
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
  struct stat st_;  // at open time
  uint64_t size_;
  int64_t mtime_ns_;
  uint64_t direct_alignment_;
};

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
    // O_PATH: nothing is read and no device or FIFO is opened (no side
    // effect, no blocking) before the file is known to be regular.
    ScopedFd located(open(path.c_str(), O_PATH | O_CLOEXEC));
    if (!located.valid()) return ErrnoToStatus(absl::StrCat(path, ": open"), errno);
    struct stat st;
    if (fstat(located.get(), &st) != 0) return ErrnoToStatus(absl::StrCat(path, ": stat"), errno);
    if (!S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file (", KindName(st.st_mode), ")"));
    }
    WEIGHTD_ASSIGN_OR_RETURN(ScopedFd fd, Reopen(located.get(), path, direct ? O_DIRECT : 0));
    struct stat opened;
    if (fstat(fd.get(), &opened) != 0) return ErrnoToStatus(absl::StrCat(path, ": stat"), errno);
    uint64_t align = direct ? DirectAlignment(fd.get()) : 0;
    return std::make_unique<PosixFile>(path, std::move(fd), opened, align);
  }
};

}  // namespace

absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text, int limit) {
  std::vector<int> out;
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::pair<absl::string_view, absl::string_view> range = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int lo = 0, hi = 0;
    bool parsed = absl::SimpleAtoi(range.first, &lo);
    if (!absl::StrContains(part, '-')) {
      hi = lo;
    } else {
      parsed = parsed && absl::SimpleAtoi(range.second, &hi);
    }
    if (!parsed || lo < 0 || hi < lo || hi >= limit) {
      return absl::InvalidArgumentError(absl::StrCat("'", text.substr(0, 64), "' is not a list of numbers below ", limit,
                                                     " (cpuset(7) list format)"));
    }
    for (int i = lo; i <= hi; ++i) out.push_back(i);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

absl::Status Env::BindMemory(int fd, char* addr, uint64_t bytes, int node) {
  if (node < 0 || node >= kMaxNumaNodes) return absl::InvalidArgumentError(absl::StrCat("NUMA node ", node, " is out of range"));
  if (bytes == 0) return absl::OkStatus();
  constexpr int kBits = 8 * sizeof(unsigned long);
  std::vector<unsigned long> mask(kMaxNumaNodes / kBits, 0);
  mask[node / kBits] |= 1ul << (node % kBits);
  // maxnode counts bits, and the kernel reads one fewer (mbind(2) BUGS).
  long r = syscall(SYS_mbind, addr, bytes, MPOL_BIND, mask.data(), static_cast<unsigned long>(kMaxNumaNodes) + 1,
                   MPOL_MF_STRICT | MPOL_MF_MOVE);
  if (r != 0) return ErrnoToStatus(absl::StrCat("mbind to NUMA node ", node), errno);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NumaNode>> Env::ReadNumaTopology(Env& env, const std::string& root) {
  WEIGHTD_ASSIGN_OR_RETURN(FileKind kind, env.Stat(root));
  if (kind != FileKind::kDirectory) return std::vector<NumaNode>{};
  // sysfs files report a size of 4096 whatever they hold: read to the end.
  WEIGHTD_ASSIGN_OR_RETURN(std::string online, ReadPseudoFile(root + "/online", 64 << 10));
  absl::StatusOr<std::vector<int>> ids = ParseCpuList(online, kMaxNumaNodes);
  if (!ids.ok()) return Annotate(ids.status(), root + "/online");
  std::vector<NumaNode> nodes;
  for (int id : *ids) {
    std::string path = absl::StrCat(root, "/node", id, "/cpulist");
    WEIGHTD_ASSIGN_OR_RETURN(std::string list, ReadPseudoFile(path, 64 << 10));
    absl::StatusOr<std::vector<int>> cpus = ParseCpuList(list, kMaxCpus);
    if (!cpus.ok()) return Annotate(cpus.status(), path);
    nodes.push_back({id, std::move(*cpus)});
  }
  return nodes;
}

Env* Env::Default() {
  static Env* env = new PosixEnv();
  return env;
}

absl::StatusOr<std::string> ReadSmallFile(Env& env, const std::string& path, uint64_t max_bytes) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, env.OpenForRead(path));
  return ReadSmallFile(*file, max_bytes);
}

absl::StatusOr<std::string> ReadSmallFile(const RandomAccessFile& file, uint64_t max_bytes) {
  if (file.size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": ", file.size(), " bytes exceeds the ", max_bytes, "-byte limit for this file"));
  }
  std::string data(file.size(), '\0');
  WEIGHTD_RETURN_IF_ERROR(file.ReadAt(0, data.size(), data.data()));
  return data;
}

absl::StatusOr<std::string> ReadPemFile(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadSmallFile(*Env::Default(), path, kMaxPemBytes);
  if (!pem.ok()) return Annotate(pem.status(), flag);
  return pem;
}

}  // namespace weightd
