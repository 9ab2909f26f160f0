// The one absl::Status -> grpc::Status conversion: codes kept, messages
// capped so that they always reach the client.
#include "server/api/convert.h"

#include <string>

#include "gtest/gtest.h"

namespace weightd {
namespace {

TEST(ToGrpcStatus, KeepsCodeAndShortMessage) {
  grpc::Status s = ToGrpcStatus(absl::NotFoundError("no model named 'm'"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "no model named 'm'");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

// Regression: a 1 MiB message went out whole in the trailers, and the client
// refused it as RESOURCE_EXHAUSTED "received initial metadata size exceeds limit".
TEST(ToGrpcStatus, CapsALongMessageAt1KiBWithAMarker) {
  grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError(std::string(1 << 20, 'm')));
  std::string marker = "…[truncated, 1048576 bytes in all]";
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), std::string(1024 - marker.size(), 'm') + marker);
}

}  // namespace
}  // namespace weightd
