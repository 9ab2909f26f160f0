// The --model-root folders and the rule every file the daemon reads must
// pass: the file actually opened lies under one of them (issue 12).
//
// The rule is checked on an open file, not on a path: the path the open file
// lies at (RandomAccessFile::ResolvedPath: readlink of /proc/self/fd/N,
// proc(5), confirmed by st_dev/st_ino) must be a root's realpath or start
// with it plus "/". A symlink that stays inside a root passes (the Hugging
// Face cache's snapshots/<rev>/x -> ../../blobs/<sha>); one that leads out
// fails before a byte of its target is read. openat2(2)'s RESOLVE_BENEATH was
// not used: it refuses absolute symlinks that stay inside the root too, and
// some seccomp profiles refuse openat2 itself.
#ifndef WEIGHTD_COMMON_IO_MODEL_ROOTS_H_
#define WEIGHTD_COMMON_IO_MODEL_ROOTS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/io/env.h"

namespace weightd {

// Whether `path` is `dir` or lies below it (both absolute, without symlinks).
bool PathUnder(const std::string& path, const std::string& dir);

// An immutable value; thread-safe.
class ModelRoots {
 public:
  ModelRoots() = default;
  // `roots` as configured, each resolved with env.RealPath; a root that does
  // not resolve holds nothing but is still named in messages.
  static ModelRoots Resolve(Env& env, const std::vector<std::string>& roots);

  // No roots configured: nothing passes Contains or Check.
  bool empty() const { return given_.empty(); }
  // Whether `resolved` (absolute, without symlinks) lies under a root.
  bool Contains(const std::string& resolved) const;
  // OK when the open `file` lies under a root; otherwise PERMISSION_DENIED
  // naming `name` and where the file lies:
  // "<name>: resolves to <path>, outside every --model-root (<roots>)".
  absl::Status Check(const RandomAccessFile& file, const std::string& name) const;
  // The roots as configured, ", "-separated, for messages.
  std::string Describe() const;

  // The daemon's start-up check of its configured roots: INVALID_ARGUMENT
  // for an empty root or one that resolves to "/" (the whole file system
  // would pass the rule above, which is then no rule); a root that does not
  // resolve to a directory (missing, a file, an unmounted share) is allowed,
  // since it may appear later, and described in `warnings`.
  static absl::Status Validate(Env& env, const std::vector<std::string>& roots, std::vector<std::string>* warnings);

 private:
  std::vector<std::string> given_;
  std::vector<std::string> real_;
};

}  // namespace weightd

#endif  // WEIGHTD_COMMON_IO_MODEL_ROOTS_H_
