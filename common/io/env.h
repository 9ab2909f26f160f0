// All file-system access of the catalog and the load pipeline goes through
// `Env`, so tests can inject EIO, short reads or missing files without root
// or a broken disk (the leveldb `Env` pattern).
#ifndef WEIGHTD_COMMON_IO_ENV_H_
#define WEIGHTD_COMMON_IO_ENV_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

// An open, read-only file. Thread-safe: ReadAt may be called concurrently.
// What tells one version of a file from another without reading its bytes:
// st_dev, st_ino, st_size, st_mtim and st_ctim (stat(2)) at open time. A
// rewrite in place changes the times; a replacement by rename changes the
// inode; ctime also moves on chmod/link changes, which errs on the side of
// re-reading. Equal identities of a file are taken as equal bytes only
// together with an equal header (see CatalogFile::header_hash).
struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t size = 0;  // bytes
  int64_t mtime_ns = 0;  // nanoseconds since the epoch
  int64_t ctime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
};

class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  // The path it was opened with (used in error messages).
  virtual const std::string& path() const = 0;
  // Size in bytes at open time.
  virtual uint64_t size() const = 0;
  // Reads exactly `n` bytes at byte `offset` into `dst` (caller owns dst).
  // A read past the end (the file shrank) is OUT_OF_RANGE; I/O errors keep
  // errno's text. Retries EINTR and short reads.
  virtual absl::Status ReadAt(uint64_t offset, size_t n, char* dst) const = 0;
  // One read of at most `n` bytes at `offset` (EINTR retried): the count,
  // 0 at end of file, possibly short. A file opened by OpenForDirectRead
  // needs `offset`, `n` and `dst` aligned to direct_alignment() (EINVAL
  // otherwise). Used for O_DIRECT spans that may run past the end.
  virtual absl::StatusOr<size_t> ReadSome(uint64_t offset, size_t n, char* dst) const = 0;
  // The file descriptor for zero-copy paths (sendfile, O_DIRECT), or -1.
  virtual int fd() const = 0;
  // 0 for a buffered file; for an O_DIRECT one the alignment its reads need
  // (offset, length and buffer): statx(STATX_DIOALIGN) or 4096.
  virtual uint64_t direct_alignment() const = 0;
  // The fraction [0, 1] of the file's pages now in the page cache, from
  // mincore(2) over 64 windows of 1 MiB spread across the file; an empty
  // file counts as cached.
  virtual absl::StatusOr<double> CachedFraction() const = 0;
  // posix_fadvise(2) over the whole file; `advice` is POSIX_FADV_*. Advisory:
  // errors are returned but callers may ignore them.
  virtual absl::Status Advise(int advice) const = 0;
  // Last modification time in nanoseconds since the epoch, at open time
  // (used to tell a rewritten checkpoint from the one already loaded).
  virtual int64_t mtime_ns() const = 0;
  // The identity at open time (see FileIdentity). The default, for files
  // that are no inode (test fakes), has dev = ino = ctime = 0.
  virtual FileIdentity identity() const { return FileIdentity{0, 0, size(), mtime_ns(), 0}; }

  // The methods below let callers keep using the file they opened instead of
  // opening its path again (which may name another file by then). Their
  // defaults fail closed, so a fake that does not implement them is never
  // taken for a checked file.

  // The absolute path, without symlinks, at which the opened file lies now:
  // readlink(2) of /proc/self/fd/N (proc(5)), confirmed by stat(2) of that
  // path having the open file's st_dev and st_ino. An error when it cannot
  // be told (no /proc; the file was deleted or moved meanwhile).
  virtual absl::StatusOr<std::string> ResolvedPath() const {
    return absl::UnimplementedError(path() + ": cannot tell where the opened file lies");
  }
  // A second, O_DIRECT open of the same inode (not of the path): open(2) of
  // /proc/self/fd/N. FAILED_PRECONDITION when the file system refuses
  // O_DIRECT. The caller owns the result.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> ReopenDirect() const {
    return absl::FailedPreconditionError(path() + ": cannot be reopened with O_DIRECT");
  }
  // The size now (fstat(2)), to notice a file changed in place after open.
  virtual absl::StatusOr<uint64_t> CurrentSize() const { return size(); }
};

enum class FileKind { kMissing, kRegular, kDirectory, kOther };

// A NUMA node and the CPUs it holds (sysfs, Documentation/ABI/stable/
// sysfs-devices-node: /sys/devices/system/node/online and nodeN/cpulist).
struct NumaNode {
  int id = 0;
  std::vector<int> cpus;
  bool operator==(const NumaNode&) const = default;
};

// Where the kernel describes NUMA nodes.
inline constexpr char kNumaSysfsRoot[] = "/sys/devices/system/node";
// Bounds on what a topology may name (a hostile or broken sysfs stand-in
// cannot make a caller allocate without bound): node ids and CPU numbers
// below these (MAX_NUMNODES is at most 1024 in Linux; CPU_SETSIZE is 1024,
// machines go beyond it, 8192 is the kernel's NR_CPUS ceiling on x86-64).
inline constexpr int kMaxNumaNodes = 1024;
inline constexpr int kMaxCpus = 8192;

// "0-3,8,10-11" (the kernel's cpulist and node list format, cpuset(7)
// "List format") as sorted numbers, each below `limit`. INVALID_ARGUMENT
// naming the text otherwise.
absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text, int limit);

class Env {
 public:
  virtual ~Env() = default;
  // The process-wide POSIX implementation; never null, never freed.
  static Env* Default();

  // Opens a regular file for reading. The path is first opened with O_PATH
  // (open(2)), so a FIFO, socket, device or directory is refused
  // (INVALID_ARGUMENT "<path>: not a regular file (FIFO)") without being
  // opened for reading; a regular file is then reopened through
  // /proc/self/fd/N: the inode already found, not the path again.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) = 0;
  // The same with O_DIRECT (reads bypass the page cache). A file system that
  // refuses O_DIRECT (tmpfs, some overlays) is FAILED_PRECONDITION naming the
  // path and errno's text.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForDirectRead(const std::string& path) = 0;
  // kMissing when the path does not exist; errors only for other failures.
  virtual absl::StatusOr<FileKind> Stat(const std::string& path) = 0;
  // Names (not paths) of the entries of a directory, sorted, without "." "..".
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) = 0;
  // realpath(3): resolves symlinks, "." and "..".
  virtual absl::StatusOr<std::string> RealPath(const std::string& path) = 0;

  // The machine's NUMA nodes, by id, each with its CPUs
  // (ReadNumaTopology(*this, kNumaSysfsRoot)). Empty when the kernel has no
  // NUMA support (no such folder): callers treat that as one node.
  virtual absl::StatusOr<std::vector<NumaNode>> NumaNodes() { return ReadNumaTopology(*this, kNumaSysfsRoot); }
  // Binds the pages of `bytes` bytes at `addr`, a shared writable mapping
  // of memfd `fd`, to NUMA node `node` (mbind(2) MPOL_BIND with
  // MPOL_MF_STRICT | MPOL_MF_MOVE). On a shmem mapping this sets the file's
  // shared policy: every page of that range allocated later, through any
  // mapping or write(2), comes from `node`. Call before filling. `fd` is
  // for fakes that record which segment was bound. Errors keep errno
  // (EINVAL for a node the machine does not have).
  virtual absl::Status BindMemory(int fd, char* addr, uint64_t bytes, int node);

  // The topology under `root` (a sysfs node folder, or a stand-in in
  // tests): `root`/online lists the node ids, `root`/nodeN/cpulist each
  // node's CPUs. Bounded by kMaxNumaNodes and kMaxCpus; errors name the
  // file.
  static absl::StatusOr<std::vector<NumaNode>> ReadNumaTopology(Env& env, const std::string& root);
};

// Reads a whole small file (an index or config), refusing files larger than
// `max_bytes` before allocating anything.
absl::StatusOr<std::string> ReadSmallFile(Env& env, const std::string& path, uint64_t max_bytes);
// The same for a file already open.
absl::StatusOr<std::string> ReadSmallFile(const RandomAccessFile& file, uint64_t max_bytes);

// A PEM file (TLS certificate chain, private key or CA bundle) of at most
// kMaxPemBytes, read through Env::Default(); errors start with `flag` (the
// option that named the file, e.g. "--tls-ca").
inline constexpr uint64_t kMaxPemBytes = 1 << 20;
absl::StatusOr<std::string> ReadPemFile(const std::string& flag, const std::string& path);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_IO_ENV_H_
