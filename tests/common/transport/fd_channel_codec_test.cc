// The fd channel's grammar (docs/api.md, "The fd channel"): every message
// kind round-trips, and what the grammar does not produce is refused.
#include "common/transport/fd_channel_codec.h"

#include <string>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using Kind = FdChannelMessage::Kind;

TEST(FdChannelCodec, ClaimRoundTrips) {
  EXPECT_EQ(EncodeClaim("0123456789abcdef0123456789abcdef"), "CLAIM 0123456789abcdef0123456789abcdef");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(FdChannelMessage m, ParseFdChannelMessage("CLAIM 0123456789abcdef0123456789abcdef"));
  EXPECT_EQ(m.kind, Kind::kClaim);
  EXPECT_EQ(m.lease_id, "0123456789abcdef0123456789abcdef");
}

TEST(FdChannelCodec, OkRoundTrips) {
  EXPECT_EQ(EncodeOk(0), "OK 0");
  EXPECT_EQ(EncodeOk(251), "OK 251");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(FdChannelMessage m, ParseFdChannelMessage("OK 251"));
  EXPECT_EQ(m.kind, Kind::kOk);
  EXPECT_EQ(m.fd_count, 251u);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(FdChannelMessage most, ParseFdChannelMessage("OK 1048576"));
  EXPECT_EQ(most.fd_count, kMaxFdsPerClaim);
}

TEST(FdChannelCodec, MoreRoundTrips) {
  EXPECT_EQ(EncodeMore(), "MORE");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(FdChannelMessage m, ParseFdChannelMessage("MORE"));
  EXPECT_EQ(m.kind, Kind::kMore);
}

TEST(FdChannelCodec, ErrRoundTrips) {
  EXPECT_EQ(EncodeErr(absl::NotFoundError("unknown or expired lease id")), "ERR 5 unknown or expired lease id");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(FdChannelMessage m, ParseFdChannelMessage("ERR 5 unknown or expired lease id"));
  EXPECT_EQ(m.kind, Kind::kErr);
  EXPECT_EQ(m.error, absl::NotFoundError("unknown or expired lease id"));
}

TEST(FdChannelCodec, ErrWithoutMessageParses) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(FdChannelMessage m, ParseFdChannelMessage("ERR 16"));
  EXPECT_EQ(m.error, absl::Status(absl::StatusCode::kUnauthenticated, ""));
}

// Regression: an ERR over 4096 bytes was silently not sent at all.
TEST(FdChannelCodec, LongErrIsCutToFitWithAVisibleMarker) {
  std::string encoded = EncodeErr(absl::InvalidArgumentError(std::string(20000, 'n')));
  EXPECT_EQ(encoded.size(), kMaxMessageBytes);
  EXPECT_EQ(encoded, "ERR 3 " + std::string(kMaxMessageBytes - 6 - 14, 'n') + "...[truncated]");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(FdChannelMessage m, ParseFdChannelMessage(encoded));
  EXPECT_EQ(m.error.code(), absl::StatusCode::kInvalidArgument);
}

TEST(FdChannelCodec, ErrOfExactlyTheLimitIsNotCut) {
  std::string message(kMaxMessageBytes - 6, 'x');
  EXPECT_EQ(EncodeErr(absl::InvalidArgumentError(message)), "ERR 3 " + message);
}

TEST(FdChannelCodec, CutErrDoesNotSplitAUtf8Character) {
  // 2-byte characters after the 7-byte "ERR 16 ": a cut after 4096 - 14 bytes falls inside one.
  std::string message;
  for (int i = 0; i < 3000; ++i) message += "\xc3\xa9";  // é
  std::string encoded = EncodeErr(absl::UnauthenticatedError(message));
  EXPECT_EQ(encoded.size(), kMaxMessageBytes - 1);
  EXPECT_EQ(encoded.substr(0, 9), "ERR 16 \xc3\xa9");
  EXPECT_EQ(encoded.substr(encoded.size() - 16), "\xc3\xa9...[truncated]");
}

TEST(FdChannelCodec, MalformedMessagesAreRefused) {
  for (const char* payload : {"", "HELLO", "CLAIM", "CLAIM ", "claim x", "OK", "OK ", "OK x", "OK -1", "OK +1",
                              "OK 1 ", "OK 99999999999", "OK 1048577", "MORE ", "MORE 1", "ERR", "ERR ", "ERR abc msg",
                              "ERR 0 ok is no error", "ERR 17 beyond the codes", "ERR -5 x", "ERR  5 x"}) {
    EXPECT_THAT(ParseFdChannelMessage(payload), StatusIs(absl::StatusCode::kInvalidArgument, "malformed"))
        << "'" << payload << "'";
  }
}

TEST(FdChannelCodec, OversizeMessageIsRefused) {
  std::string payload = "ERR 3 " + std::string(kMaxMessageBytes, 'x');
  EXPECT_THAT(ParseFdChannelMessage(payload),
              StatusIs(absl::StatusCode::kInvalidArgument, "over 4096 bytes"));
}

TEST(FdChannelCodec, MalformedMessageIsQuotedShort) {
  absl::StatusOr<FdChannelMessage> m = ParseFdChannelMessage("OK " + std::string(1000, '7'));
  EXPECT_EQ(m.status().message(),
            "malformed fd-channel message (OK count): 'OK " + std::string(61, '7') + "...[truncated]'");
}

}  // namespace
}  // namespace weightd
