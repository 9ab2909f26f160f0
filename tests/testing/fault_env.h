// An Env that passes everything to another Env (the real one by default)
// and injects faults into the files it opens: EIO at a chosen byte offset,
// short reads, and a file that changes size after it was opened. For tests
// of what a load leaves behind when the disk fails half-way.
#ifndef WEIGHTD_TESTS_TESTING_FAULT_ENV_H_
#define WEIGHTD_TESTS_TESTING_FAULT_ENV_H_

#include <cerrno>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/io/env.h"
#include "common/base/status.h"

namespace weightd::testing {

// What goes wrong in a file whose path ends with `path_suffix` ("" : every file).
struct Faults {
  std::string path_suffix;
  int64_t eio_at = -1;     // a read covering this byte gets the bytes before it, then EIO; -1: never
  size_t max_read = 0;     // ReadSome returns at most this many bytes; 0: no limit
  int64_t size_now = -1;   // CurrentSize() says this (the file changed size); -1: the real size
};

// Thread-safe. Faults apply to reads made after set_faults(), also in files
// opened before it.
class FaultInjectingEnv final : public Env {
 public:
  explicit FaultInjectingEnv(Faults faults = {}, Env* base = Env::Default()) : base_(base), faults_(std::move(faults)) {}

  void set_faults(Faults faults) {
    absl::MutexLock lock(&mu_);
    faults_ = std::move(faults);
  }
  // Reads that failed with the injected EIO so far.
  int eio_reads() const {
    absl::MutexLock lock(&mu_);
    return eio_reads_;
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    return Wrap(base_->OpenForRead(path));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForDirectRead(const std::string& path) override {
    return Wrap(base_->OpenForDirectRead(path));
  }
  absl::StatusOr<FileKind> Stat(const std::string& path) override { return base_->Stat(path); }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override { return base_->ListDir(path); }
  absl::StatusOr<std::string> RealPath(const std::string& path) override { return base_->RealPath(path); }

 private:
  class File final : public RandomAccessFile {
   public:
    File(std::unique_ptr<RandomAccessFile> base, FaultInjectingEnv* env) : base_(std::move(base)), env_(env) {}
    const std::string& path() const override { return base_->path(); }
    uint64_t size() const override { return base_->size(); }
    int fd() const override { return base_->fd(); }
    uint64_t direct_alignment() const override { return base_->direct_alignment(); }
    absl::StatusOr<double> CachedFraction() const override { return base_->CachedFraction(); }
    absl::Status Advise(int advice) const override { return base_->Advise(advice); }
    int64_t mtime_ns() const override { return base_->mtime_ns(); }
    FileIdentity identity() const override { return base_->identity(); }
    absl::StatusOr<std::string> ResolvedPath() const override { return base_->ResolvedPath(); }

    absl::Status ReadAt(uint64_t offset, size_t n, char* dst) const override {
      Faults f = env_->FaultsFor(path());
      if (f.eio_at >= 0 && offset <= static_cast<uint64_t>(f.eio_at) && static_cast<uint64_t>(f.eio_at) < offset + n) {
        size_t good = static_cast<size_t>(f.eio_at - offset);
        if (good > 0) WEIGHTD_RETURN_IF_ERROR(base_->ReadAt(offset, good, dst));
        return env_->Eio(path(), f.eio_at);
      }
      return base_->ReadAt(offset, n, dst);
    }
    absl::StatusOr<size_t> ReadSome(uint64_t offset, size_t n, char* dst) const override {
      Faults f = env_->FaultsFor(path());
      if (f.max_read > 0 && n > f.max_read) n = f.max_read;
      if (f.eio_at >= 0 && offset <= static_cast<uint64_t>(f.eio_at) && static_cast<uint64_t>(f.eio_at) < offset + n) {
        if (static_cast<uint64_t>(f.eio_at) == offset) return env_->Eio(path(), f.eio_at);
        n = static_cast<size_t>(f.eio_at - offset);  // the bytes before the bad one; the next read fails
      }
      return base_->ReadSome(offset, n, dst);
    }
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> ReopenDirect() const override {
      return env_->Wrap(base_->ReopenDirect());
    }
    absl::StatusOr<uint64_t> CurrentSize() const override {
      Faults f = env_->FaultsFor(path());
      if (f.size_now >= 0) return static_cast<uint64_t>(f.size_now);
      return base_->CurrentSize();
    }

   private:
    std::unique_ptr<RandomAccessFile> base_;
    FaultInjectingEnv* env_;
  };

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> Wrap(absl::StatusOr<std::unique_ptr<RandomAccessFile>> file) {
    if (!file.ok()) return file;
    return std::unique_ptr<RandomAccessFile>(new File(std::move(*file), this));
  }
  Faults FaultsFor(const std::string& path) const {
    absl::MutexLock lock(&mu_);
    return absl::EndsWith(path, faults_.path_suffix) ? faults_ : Faults{};
  }
  absl::Status Eio(const std::string& path, int64_t at) {
    absl::MutexLock lock(&mu_);
    ++eio_reads_;
    return ErrnoToStatus(absl::StrCat(path, ": read at byte ", at), EIO);
  }

  Env* const base_;
  mutable absl::Mutex mu_;
  Faults faults_ ABSL_GUARDED_BY(mu_);
  int eio_reads_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FAULT_ENV_H_
