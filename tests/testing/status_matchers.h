// GoogleTest helpers for absl::Status, which Debian's Abseil does not ship.
#ifndef WEIGHTD_TESTS_TESTING_STATUS_MATCHERS_H_
#define WEIGHTD_TESTS_TESTING_STATUS_MATCHERS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace weightd::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) { return s.status(); }

}  // namespace weightd::testing

#define WEIGHTD_EXPECT_OK(expr) EXPECT_TRUE(::weightd::testing::GetStatus(expr).ok()) << ::weightd::testing::GetStatus(expr)
#define WEIGHTD_ASSERT_OK(expr) ASSERT_TRUE(::weightd::testing::GetStatus(expr).ok()) << ::weightd::testing::GetStatus(expr)

#define WEIGHTD_ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  WEIGHTD_ASSERT_OK_AND_ASSIGN_IMPL_(WEIGHTD_TEST_CONCAT_(statusor_, __LINE__), lhs, rexpr)
#define WEIGHTD_TEST_CONCAT_INNER_(a, b) a##b
#define WEIGHTD_TEST_CONCAT_(a, b) WEIGHTD_TEST_CONCAT_INNER_(a, b)
#define WEIGHTD_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                       \
  ASSERT_TRUE(tmp.ok()) << tmp.status();                    \
  lhs = std::move(tmp).value()

// Matches a Status or StatusOr whose code is `code` and whose message contains `substr`.
MATCHER_P2(StatusIs, code, substr, "") {
  const absl::Status& status = ::weightd::testing::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code && std::string(status.message()).find(substr) != std::string::npos;
}

#endif  // WEIGHTD_TESTS_TESTING_STATUS_MATCHERS_H_
