#include "tests/testing/shared_inputs.h"

#include <climits>
#include <cstdlib>

#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>

namespace weightd::testing {

std::optional<std::string> SharedDir() {
  const char* env = std::getenv("WEIGHTD_SHARED_DIR");
  if (env == nullptr || *env == '\0') return std::nullopt;
  struct stat st;
  std::string cases = std::string(env) + "/cases/cases.json";
  if (stat(cases.c_str(), &st) != 0) return std::nullopt;
  return std::string(env);
}

TempDir::TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "weightd-test-XXXXXX").string();
  char* made = mkdtemp(pattern.data());
  if (made == nullptr) std::abort();
  path_ = made;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? buf : "";
}

}  // namespace weightd::testing
