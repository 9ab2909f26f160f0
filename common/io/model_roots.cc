#include "common/io/model_roots.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"

namespace weightd {

bool PathUnder(const std::string& path, const std::string& dir) {
  return dir == "/" || path == dir || absl::StartsWith(path, dir + "/");
}

ModelRoots ModelRoots::Resolve(Env& env, const std::vector<std::string>& roots) {
  ModelRoots out;
  out.given_ = roots;
  for (const std::string& root : roots) {
    absl::StatusOr<std::string> real = env.RealPath(root);
    if (real.ok()) out.real_.push_back(*std::move(real));
  }
  return out;
}

absl::Status ModelRoots::Validate(Env& env, const std::vector<std::string>& roots, std::vector<std::string>* warnings) {
  for (const std::string& root : roots) {
    if (root.empty()) return absl::InvalidArgumentError("--model-root must not be empty");
    absl::StatusOr<std::string> real = env.RealPath(root);
    if (real.ok() && *real == "/") {
      return absl::InvalidArgumentError(absl::StrCat("--model-root ", root,
                                                     " resolves to /: the whole file system cannot be a model root"));
    }
    absl::StatusOr<FileKind> kind = real.ok() ? env.Stat(*real) : absl::StatusOr<FileKind>(real.status());
    if (!kind.ok() || *kind != FileKind::kDirectory) {
      warnings->push_back(absl::StrCat("--model-root ", root, " is not a directory now (",
                                       kind.ok() ? "not a folder" : kind.status().message(),
                                       "): nothing under it can be loaded until it is"));
    }
  }
  return absl::OkStatus();
}

bool ModelRoots::Contains(const std::string& resolved) const {
  for (const std::string& root : real_) {
    if (PathUnder(resolved, root)) return true;
  }
  return false;
}

absl::Status ModelRoots::Check(const RandomAccessFile& file, const std::string& name) const {
  absl::StatusOr<std::string> resolved = file.ResolvedPath();
  if (!resolved.ok()) {
    return absl::PermissionDeniedError(
        absl::StrCat(ElideName(name), ": cannot tell whether it lies under a --model-root: ", resolved.status().message()));
  }
  if (Contains(*resolved)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(ElideName(name), ": resolves to ", *resolved, ", outside every --model-root (", Describe(), ")"));
}

std::string ModelRoots::Describe() const { return absl::StrJoin(given_, ", "); }

}  // namespace weightd
