// The fd channel's socket helpers: SOCK_SEQPACKET with SCM_RIGHTS.
#include "common/transport/unix_socket.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::TempDir;

// A memfd holding `contents`.
ScopedFd MemfdWith(const std::string& contents) {
  ScopedFd fd(memfd_create("unix-socket-test", MFD_CLOEXEC));
  if (fd.valid() && write(fd.get(), contents.data(), contents.size()) != static_cast<ssize_t>(contents.size())) {
    fd.Reset();
  }
  return fd;
}

std::string ReadAll(int fd) {
  std::string out(4096, '\0');
  ssize_t n = pread(fd, out.data(), out.size(), 0);
  out.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return out;
}

int CountOpenFds() {
  int n = 0;
  DIR* dir = opendir("/proc/self/fd");
  while (dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

// A listening socket in a temporary folder and one connected pair.
class UnixSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.Join("fd.sock");
    WEIGHTD_ASSERT_OK_AND_ASSIGN(listener_, ListenSeqpacket(path_, 0660));
    WEIGHTD_ASSERT_OK_AND_ASSIGN(client_, ConnectSeqpacket(path_));
    server_ = ScopedFd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    ASSERT_TRUE(server_.valid());
  }

  TempDir dir_;
  std::string path_;
  ScopedFd listener_, client_, server_;
};

TEST_F(UnixSocketTest, ListeningSocketHasRequestedMode) {
  struct stat st {};
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
}

TEST_F(UnixSocketTest, ListenReplacesAStaleSocketFile) {
  listener_.Reset();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ScopedFd again, ListenSeqpacket(path_, 0600));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ScopedFd client, ConnectSeqpacket(path_));
  EXPECT_TRUE(client.valid());
}

TEST(UnixStreamSocket, ListenStreamIsAStreamSocketWithTheRequestedMode) {
  TempDir dir;
  std::string path = dir.Join("w.sock");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ScopedFd listener, ListenStream(path, 0640));
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  int type = 0;
  socklen_t len = sizeof(type);
  ASSERT_EQ(getsockopt(listener.get(), SOL_SOCKET, SO_TYPE, &type, &len), 0);
  EXPECT_EQ(type, SOCK_STREAM);
  EXPECT_FALSE(ConnectSeqpacket(path).ok());  // EPROTOTYPE: a stream socket
}

TEST_F(UnixSocketTest, MessageCarriesPayloadAndThreeFds) {
  const std::vector<std::string> contents = {"alpha", "beta-beta", "gamma gamma gamma"};
  std::vector<ScopedFd> sent;
  std::vector<int> raw;
  for (const std::string& c : contents) {
    sent.push_back(MemfdWith(c));
    ASSERT_TRUE(sent.back().valid());
    raw.push_back(sent.back().get());
  }
  WEIGHTD_ASSERT_OK(SendMessage(client_.get(), "lease 0123", raw));
  sent.clear();  // the receiver's copies must outlive the sender's

  std::vector<ScopedFd> got;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string payload, ReceiveMessage(server_.get(), &got, 1000));
  EXPECT_EQ(payload, "lease 0123");
  ASSERT_EQ(got.size(), 3u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(ReadAll(got[i].get()), contents[i]) << "fd " << i;
    EXPECT_EQ(fcntl(got[i].get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC) << "fd " << i;
  }
}

TEST_F(UnixSocketTest, MessageWithoutFdsRoundTrips) {
  WEIGHTD_ASSERT_OK(SendMessage(server_.get(), "no fds here", {}));
  std::vector<ScopedFd> got;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string payload, ReceiveMessage(client_.get(), &got, 1000));
  EXPECT_EQ(payload, "no fds here");
  EXPECT_TRUE(got.empty());
}

TEST_F(UnixSocketTest, MaxFdsTravelInOneMessage) {
  ASSERT_EQ(kMaxFdsPerMessage, 250u);
  ScopedFd memfd = MemfdWith("same bytes");
  ASSERT_TRUE(memfd.valid());
  std::vector<int> raw(kMaxFdsPerMessage, memfd.get());
  WEIGHTD_ASSERT_OK(SendMessage(client_.get(), "many", raw));

  std::vector<ScopedFd> got;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string payload, ReceiveMessage(server_.get(), &got, 1000));
  EXPECT_EQ(payload, "many");
  ASSERT_EQ(got.size(), 250u);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NE(got[i].get(), memfd.get());
    ASSERT_EQ(ReadAll(got[i].get()), "same bytes") << "fd " << i;
  }
}

TEST_F(UnixSocketTest, MoreThanMaxFdsIsInvalidArgument) {
  ScopedFd memfd = MemfdWith("x");
  std::vector<int> raw(kMaxFdsPerMessage + 1, memfd.get());
  EXPECT_THAT(SendMessage(client_.get(), "too many", raw), StatusIs(absl::StatusCode::kInvalidArgument, "too many fds"));
}

TEST_F(UnixSocketTest, PayloadLongerThanMaxIsInvalidArgument) {
  EXPECT_THAT(SendMessage(client_.get(), std::string(kMaxMessageBytes + 1, 'p'), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "message too long"));
}

TEST_F(UnixSocketTest, ReceiveTimesOutWithDeadlineExceeded) {
  std::vector<ScopedFd> got;
  EXPECT_THAT(ReceiveMessage(server_.get(), &got, 20), StatusIs(absl::StatusCode::kDeadlineExceeded, "timed out"));
  EXPECT_TRUE(got.empty());
}

TEST_F(UnixSocketTest, PeerCloseIsUnavailable) {
  client_.Reset();
  std::vector<ScopedFd> got;
  EXPECT_THAT(ReceiveMessage(server_.get(), &got, 1000), StatusIs(absl::StatusCode::kUnavailable, "closed by peer"));
}

TEST_F(UnixSocketTest, ReceiveWithoutFdVectorClosesReceivedFds) {
  ScopedFd memfd = MemfdWith("dropped");
  WEIGHTD_ASSERT_OK(SendMessage(client_.get(), "drop", {memfd.get()}));
  int before = CountOpenFds();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string payload, ReceiveMessage(server_.get(), nullptr, 1000));
  EXPECT_EQ(payload, "drop");
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_F(UnixSocketTest, PeerCredentialsAreThisProcess) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PeerCredentials from_server, GetPeerCredentials(server_.get()));
  EXPECT_EQ(from_server.pid, getpid());
  EXPECT_EQ(from_server.uid, getuid());
  EXPECT_EQ(from_server.gid, getgid());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PeerCredentials from_client, GetPeerCredentials(client_.get()));
  EXPECT_EQ(from_client.pid, getpid());
  EXPECT_EQ(from_client.uid, getuid());
}

// Regression (review of issue 12): `weightd --socket data.txt` deleted data.txt.
TEST(UnixSocket, ListenNeverReplacesAFileThatIsNotASocket) {
  testing::TempDir dir;
  std::string path = dir.Join("data.txt");
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "IMPORTANT", 9), 9);
  close(fd);
  EXPECT_EQ(ListenStream(path, 0660).status(),
            absl::FailedPreconditionError(path + ": exists and is not a socket; refusing to replace it (choose another path)"));
  EXPECT_EQ(ListenSeqpacket(path, 0660).status().code(), absl::StatusCode::kFailedPrecondition);
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_size, 9);
}

TEST(UnixSocket, SocketPathTooLongIsInvalidArgument) {
  std::string path = "/tmp/" + std::string(200, 'p') + ".sock";
  EXPECT_THAT(ListenSeqpacket(path, 0660), StatusIs(absl::StatusCode::kInvalidArgument, "107-byte limit"));
  EXPECT_THAT(ConnectSeqpacket(path), StatusIs(absl::StatusCode::kInvalidArgument, "107-byte limit"));
}

TEST(UnixSocket, ConnectToMissingSocketIsNotFound) {
  TempDir dir;
  EXPECT_THAT(ConnectSeqpacket(dir.Join("absent.sock")), StatusIs(absl::StatusCode::kNotFound, "absent.sock"));
}

TEST(UnixSocket, ScopedFdClosesOnDestructionAndRelease) {
  int raw;
  {
    ScopedFd fd(memfd_create("scoped", MFD_CLOEXEC));
    raw = fd.get();
    ASSERT_GE(raw, 0);
  }
  EXPECT_EQ(fcntl(raw, F_GETFD), -1);
  ScopedFd fd(memfd_create("released", MFD_CLOEXEC));
  int kept = fd.Release();
  EXPECT_FALSE(fd.valid());
  EXPECT_NE(fcntl(kept, F_GETFD), -1);
  close(kept);
}

}  // namespace
}  // namespace weightd
