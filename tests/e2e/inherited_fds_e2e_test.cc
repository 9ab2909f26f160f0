// The fds a daemon is told it inherited (LISTEN_FDS from a service manager,
// WEIGHTD_HANDOFF_FD from an in-place upgrade) name fd *numbers*. Before,
// they were taken after the daemon had opened its socket locks, metrics
// and peer transport, so LISTEN_FDS=2 with no fd passed, or a handoff
// number of 3, made restore adopt and close the daemon's own .lock fds: a
// second daemon then took over the sockets while the first still held its
// models. Now they are taken first thing in main(), and each is checked to
// be what its name claims. Real weightd processes under /bin/sh, which sets
// the environment and the fds exactly as a service manager would.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace weightd {
namespace {

using testing::CommandResult;
using testing::Process;

class InheritedFds : public ::testing::Test {
 protected:
  std::string Socket() const { return dir_.Join("w.sock"); }

  // weightd under `sh -c PRELUDE; exec weightd ...`: fds 3-9 closed first,
  // then PRELUDE (which may open fds and export LISTEN_*; $$ is the pid the
  // daemon will have).
  std::unique_ptr<Process> Start(const std::string& prelude) {
    std::string script = absl::StrCat("exec 3>&- 4>&- 5>&- 6>&- 7>&- 8>&- 9>&-; ", prelude,
                                      "; exec \"$0\" --socket \"$1\" --model-root \"$2\" --metrics-address '' "
                                      "--mlock false");
    auto p = std::make_unique<Process>(
        std::vector<std::string>{"/bin/sh", "-c", script, testing::WeightdBinary(), Socket(), dir_.path()},
        dir_.path());
    testing::WaitFor([&] { return Ctl({"ls"}).code == 0 || !p->Running(); }, std::chrono::seconds(20));
    return p;
  }
  CommandResult Ctl(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {testing::WeightctlBinary(), "--socket", Socket()};
    argv.insert(argv.end(), args.begin(), args.end());
    return testing::RunCommand(argv);
  }
  // The first daemon still holds its socket: a second one is refused.
  void ExpectSocketStillHeld() {
    Process second({testing::WeightdBinary(), "--socket", Socket(), "--metrics-address", "", "--mlock", "false"},
                   dir_.path());
    testing::WaitFor([&] { return !second.Running(); }, std::chrono::seconds(20));
    bool took_over = second.Running();
    if (took_over) second.Signal(SIGKILL);
    ASSERT_FALSE(took_over) << "a second daemon took over " << Socket() << ":\n" << second.Stderr();
    EXPECT_EQ(second.Wait(), 1) << second.Stderr();
    EXPECT_TRUE(absl::StrContains(second.Stderr(), absl::StrCat("another weightd is serving ", Socket())))
        << second.Stderr();
  }

  testing::TempDir dir_;
};

TEST_F(InheritedFds, ListenFdsNamingFdsThatWereNotPassedAreRefusedAndTheLocksKept) {
  auto d = Start("export LISTEN_PID=$$ LISTEN_FDS=2 LISTEN_FDNAMES=wd-rec-1:wd-seg-1");
  ASSERT_TRUE(d->Running()) << d->Stderr();
  std::string log = d->Stderr();
  EXPECT_TRUE(absl::StrContains(log, "LISTEN_FDS names fds from 3 on that were not passed (not open): nothing adopted"))
      << log;
  ExpectSocketStillHeld();
  EXPECT_EQ(Ctl({"ls"}).code, 0);
}

TEST_F(InheritedFds, AHandoffNumberThatIsNoSealedListIsLeftAlone) {
  auto d = Start("export WEIGHTD_HANDOFF_FD=3");
  ASSERT_TRUE(d->Running()) << d->Stderr();
  EXPECT_TRUE(absl::StrContains(d->Stderr(), "WEIGHTD_HANDOFF_FD=3 is not an open fd: nothing handed over"))
      << d->Stderr();
  ExpectSocketStillHeld();

  // An open fd under that number that is not a sealed memfd is not a list.
  d.reset();
  auto f = Start("exec 3</dev/null; export WEIGHTD_HANDOFF_FD=3");
  ASSERT_TRUE(f->Running()) << f->Stderr();
  EXPECT_TRUE(absl::StrContains(f->Stderr(), "WEIGHTD_HANDOFF_FD=3 is not a sealed fd list: nothing handed over"))
      << f->Stderr();
  ExpectSocketStillHeld();
}

TEST_F(InheritedFds, PassedFdsThatAreNotWhatTheirNamesClaimAreRefusedOneLineEach) {
  std::string fifo = dir_.Join("fifo"), file = dir_.Join("record");
  testing::RunCommand({"/usr/bin/mkfifo", fifo});
  testing::RunCommand({"/bin/sh", "-c", "echo not a record > \"$0\"", file});
  auto d = Start(absl::StrCat("exec 3<>'", fifo, "' 4<'", file,
                              "'; export LISTEN_PID=$$ LISTEN_FDS=2 LISTEN_FDNAMES=wd-seg-1:wd-rec-2"));
  ASSERT_TRUE(d->Running()) << d->Stderr();
  std::string log = d->Stderr();
  EXPECT_TRUE(absl::StrContains(
      log, "LISTEN_FDS names fd 3 (wd-seg-1), refused: it is a socket, directory or FIFO, not a memory segment"))
      << log;
  EXPECT_TRUE(absl::StrContains(
      log, "LISTEN_FDS names fd 4 (wd-rec-2), refused: a state record must be a memfd sealed against writes"))
      << log;
  // Refused fds are closed: the daemon does not keep the FIFO or the file.
  std::string fds = testing::RunCommand({"/bin/sh", "-c", absl::StrCat("ls -l /proc/", d->pid(), "/fd")}).out;
  EXPECT_FALSE(absl::StrContains(fds, fifo)) << fds;
  EXPECT_FALSE(absl::StrContains(fds, file)) << fds;
  ExpectSocketStillHeld();
}

}  // namespace
}  // namespace weightd
