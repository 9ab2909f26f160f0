// RecordKey (server/restart/record_key.h): the file it keeps, the rules a key file
// must meet, and the HMAC.
#include "server/restart/record_key.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <string>

#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;

TEST(RecordKey, IsMadeOnceAsA0600FileOf32BytesAndReadBackTheSame) {
  TempDir dir;
  std::string path = RecordKeyPath(dir.Join("w.sock"));
  EXPECT_EQ(path, dir.Join("w.sock.key"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(RecordKey made, RecordKey::Load(path));
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_size, 32);
  EXPECT_EQ(st.st_uid, geteuid());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(RecordKey again, RecordKey::Load(path));
  EXPECT_EQ(again.Mac("record"), made.Mac("record"));
  EXPECT_EQ(made.Mac("record").size(), kRecordMacBytes);
  EXPECT_TRUE(again.Verify("record", made.Mac("record")));
  EXPECT_FALSE(again.Verify("record!", made.Mac("record")));
  EXPECT_FALSE(again.Verify("record", made.Mac("record").substr(0, 31)));
  // Another daemon's key (another socket) is another key.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(RecordKey other, RecordKey::Load(RecordKeyPath(dir.Join("x.sock"))));
  EXPECT_NE(other.Mac("record"), made.Mac("record"));
}

// RFC 4231 test case 2 ("Jefe"), with the key zero-padded to 32 bytes, which
// HMAC does itself for a key shorter than the block: the same MAC.
TEST(RecordKey, MacIsHmacSha256) {
  std::array<uint8_t, kRecordKeyBytes> key{};
  std::string jefe = "Jefe";
  std::copy(jefe.begin(), jefe.end(), key.begin());
  std::string mac = RecordKey::FromBytes(key).Mac("what do ya want for nothing?");
  static const char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : mac) hex += {kHex[c >> 4], kHex[c & 15]};
  EXPECT_EQ(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(RecordKey, AKeyFileOthersCouldReadOrChangeIsRefusedByName) {
  TempDir dir;
  std::string wide = dir.Join("wide.key");
  WriteFile(wide, std::string(32, 'k'));
  ASSERT_EQ(chmod(wide.c_str(), 0644), 0);
  EXPECT_THAT(RecordKey::Load(wide).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "record key " + wide + ": has mode 0644 (group or others have access; must be 0600)"));
  std::string shortkey = dir.Join("short.key");
  WriteFile(shortkey, std::string(31, 'k'));
  ASSERT_EQ(chmod(shortkey.c_str(), 0600), 0);
  EXPECT_THAT(RecordKey::Load(shortkey).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "record key " + shortkey + ": is 31 bytes, not 32"));
  std::string link = dir.Join("link.key");
  ASSERT_EQ(symlink(shortkey.c_str(), link.c_str()), 0);
  EXPECT_THAT(RecordKey::Load(link).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "record key " + link + ": is a symbolic link"));
  std::string folder = dir.Join("folder.key");
  ASSERT_EQ(mkdir(folder.c_str(), 0700), 0);
  EXPECT_THAT(RecordKey::Load(folder).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "record key " + folder + ": is not a regular file"));
  if (geteuid() == 0) {  // only root can give a file away
    std::string theirs = dir.Join("theirs.key");
    WriteFile(theirs, std::string(32, 'k'));
    ASSERT_EQ(chmod(theirs.c_str(), 0600), 0);
    ASSERT_EQ(chown(theirs.c_str(), 65534, 65534), 0);
    EXPECT_THAT(RecordKey::Load(theirs).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         "record key " + theirs + ": is owned by uid 65534, not this daemon's user (0)"));
  }
}

}  // namespace
}  // namespace weightd
