#include "common/model_roots.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

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
