#include "common/base/log.h"

#include "gtest/gtest.h"

namespace weightd {
namespace {

TEST(EscapeForLog, WritesAsciiControlBytesAsHex) {
  EXPECT_EQ(EscapeForLog("a\nb\x1b[31mc\x7f"), "a\\x0ab\\x1b[31mc\\x7f");
  EXPECT_EQ(EscapeForLog(std::string("nul\0end", 7)), "nul\\x00end");
  EXPECT_EQ(EscapeForLog("tab\there\r"), "tab\\x09here\\x0d");
}

TEST(EscapeForLog, ABackslashCannotImitateAnEscape) {
  EXPECT_EQ(EscapeForLog("a\\x0ab"), "a\\\\x0ab");  // typed by a client: not a newline
}

TEST(EscapeForLog, C1ControlsAndBidiOverridesAreWrittenAsCodePoints) {
  EXPECT_EQ(EscapeForLog("csi\xc2\x9b" "2J"), "csi\\u{009b}2J");             // U+009B, a terminal's CSI
  EXPECT_EQ(EscapeForLog("gpj.\xe2\x80\xae" "exe"), "gpj.\\u{202e}exe");        // U+202E RIGHT-TO-LEFT OVERRIDE
  EXPECT_EQ(EscapeForLog("\xe2\x81\xa6x\xe2\x81\xa9"), "\\u{2066}x\\u{2069}");  // isolates
}

TEST(IsValidUtf8, FollowsRfc3629) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"));
  EXPECT_FALSE(IsValidUtf8("\xff\xfe"));
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // a surrogate
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // above U+10FFFF
  EXPECT_FALSE(IsValidUtf8("ok\xe2\x82"));         // cut short
}

TEST(EscapeForLog, InvalidUtf8BytesAreWrittenAsHex) {
  EXPECT_EQ(EscapeForLog("a\xff" "b"), "a\\xffb");
  EXPECT_EQ(EscapeForLog("\xc0\xaf"), "\\xc0\\xaf");          // an overlong '/'
  EXPECT_EQ(EscapeForLog("\xed\xa0\x80"), "\\xed\\xa0\\x80");  // a surrogate
  EXPECT_EQ(EscapeForLog("cut\xe2\x80"), "cut\\xe2\\x80");     // a sequence cut short
}

TEST(EscapeForLog, KeepsPrintableAsciiAndUtf8) {
  EXPECT_EQ(EscapeForLog("load of 'llama' from /models/ллама…: ok ~ 🦙"), "load of 'llama' from /models/ллама…: ok ~ 🦙");
  EXPECT_EQ(EscapeForLog(""), "");
}

}  // namespace
}  // namespace weightd
