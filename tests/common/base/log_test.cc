#include "common/base/log.h"

#include "gtest/gtest.h"

namespace weightd {
namespace {

TEST(EscapeControlBytes, WritesNewlineEscAndDelAsHex) {
  EXPECT_EQ(EscapeControlBytes("a\nb\x1b[31mc\x7f"), "a\\x0ab\\x1b[31mc\\x7f");
  EXPECT_EQ(EscapeControlBytes(std::string("nul\0end", 7)), "nul\\x00end");
  EXPECT_EQ(EscapeControlBytes("tab\there\r"), "tab\\x09here\\x0d");
}

TEST(EscapeControlBytes, KeepsPrintableAsciiAndUtf8) {
  EXPECT_EQ(EscapeControlBytes("load of 'llama' from /models/ллама…: ok ~"), "load of 'llama' from /models/ллама…: ok ~");
  EXPECT_EQ(EscapeControlBytes(""), "");
}

}  // namespace
}  // namespace weightd
