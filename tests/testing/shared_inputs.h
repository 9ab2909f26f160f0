// Locating ../shared (real checkpoints and edge cases). A user's own clone
// has no ../shared; tests that need it skip with a clear message. CI always
// has it, and .ci/run fails when it is missing.
#ifndef WEIGHTD_TESTS_TESTING_SHARED_INPUTS_H_
#define WEIGHTD_TESTS_TESTING_SHARED_INPUTS_H_

#include <optional>
#include <string>

#include "gtest/gtest.h"

namespace weightd::testing {

// $WEIGHTD_SHARED_DIR (set by CTest to <source>/../shared), when it holds
// DESIGN.md-era inputs (cases/cases.json); nullopt otherwise.
std::optional<std::string> SharedDir();

// A fresh temporary directory, removed (recursively) by the destructor.
// realpath(3) of `path`, or "" when it does not resolve.
std::string RealPath(const std::string& path);

class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace weightd::testing

// Declares `std::string shared` or skips the test when ../shared is absent.
#define WEIGHTD_REQUIRE_SHARED(var)                                                              \
  std::string var;                                                                              \
  if (auto dir = ::weightd::testing::SharedDir()) {                                             \
    var = *dir;                                                                                 \
  } else {                                                                                      \
    GTEST_SKIP() << "../shared (real checkpoints and edge cases) is absent: set WEIGHTD_SHARED_DIR"; \
  }

#endif  // WEIGHTD_TESTS_TESTING_SHARED_INPUTS_H_
