// The status helpers: Annotate keeps payloads, names are elided in messages,
// messages are capped where they leave the process.
#include "common/base/status.h"

#include <cerrno>
#include <string>

#include "absl/strings/cord.h"
#include "gtest/gtest.h"

namespace weightd {
namespace {

TEST(Annotate, PrefixesTheMessageAndKeepsCodeAndPayloads) {
  absl::Status status = absl::InvalidArgumentError("truncated");
  status.SetPayload("type.example/Reason", absl::Cord("truncated"));
  absl::Status annotated = Annotate(status, "x.safetensors");
  EXPECT_EQ(annotated.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(annotated.message(), "x.safetensors: truncated");
  EXPECT_EQ(annotated.GetPayload("type.example/Reason"), absl::Cord("truncated"));
  EXPECT_TRUE(Annotate(absl::OkStatus(), "x").ok());
}

TEST(ElideName, KeepsNamesUpTo200Bytes) {
  EXPECT_EQ(ElideName("model.layers.0.mlp.weight"), "model.layers.0.mlp.weight");
  EXPECT_EQ(ElideName(std::string(200, 'n')), std::string(200, 'n'));
  EXPECT_EQ(ElideName(""), "");
}

TEST(ElideName, KeepsBothEndsOfALongNameAndSaysItsLength) {
  std::string name = std::string(96, 'a') + std::string(19'808, 'm') + std::string(96, 'z');
  EXPECT_EQ(ElideName(name), std::string(96, 'a') + "…(20000 bytes)…" + std::string(96, 'z'));
  EXPECT_EQ(ElideName(std::string(201, 'n')), std::string(96, 'n') + "…(201 bytes)…" + std::string(96, 'n'));
}

std::string Repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

// Cutting inside a character would make the message invalid UTF-8, which
// weightctl --json (nlohmann::json::dump) refuses to print.
TEST(ElideName, CutsOnCharacterBoundaries) {
  std::string name = "x" + Repeat("é", 100);  // 201 bytes; byte 96 is the second byte of an é
  EXPECT_EQ(ElideName(name), "x" + Repeat("é", 47) + "…(201 bytes)…" + Repeat("é", 48));
}

TEST(QuoteName, QuotesTheElidedName) {
  EXPECT_EQ(QuoteName("a"), "'a'");
  EXPECT_EQ(QuoteName(std::string(300, 'q')), "'" + std::string(96, 'q') + "…(300 bytes)…" + std::string(96, 'q') + "'");
}

TEST(CapMessage, KeepsMessagesUpToTheCap) {
  EXPECT_EQ(CapMessage("no model named 'm'"), "no model named 'm'");
  EXPECT_EQ(CapMessage(std::string(1024, 'm')), std::string(1024, 'm'));
}

TEST(CapMessage, CutsALongMessageWithAVisibleMarker) {
  std::string capped = CapMessage(std::string(1 << 20, 'm'));
  std::string marker = "…[truncated, 1048576 bytes in all]";
  EXPECT_EQ(capped, std::string(1024 - marker.size(), 'm') + marker);
  EXPECT_EQ(capped.size(), 1024u);
  std::string short_marker = "…[truncated, 50 bytes in all]";
  EXPECT_EQ(CapMessage(std::string(50, 'm'), 40), std::string(40 - short_marker.size(), 'm') + short_marker);
}

TEST(CapMessage, CutsOnCharacterBoundaries) {
  std::string capped = CapMessage(Repeat("é", 1000));
  std::string marker = "…[truncated, 2000 bytes in all]";
  ASSERT_EQ(marker.size(), 33u);
  // 1024 - 33 = 991 bytes left: 495 whole é (990 bytes).
  EXPECT_EQ(capped, Repeat("é", 495) + marker);
}

}  // namespace
}  // namespace weightd
