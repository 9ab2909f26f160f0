// A stand-in for systemd's file descriptor store, for tests on machines where
// systemd is not PID 1. It speaks the documented protocol from the service
// manager's side (sd_notify(3), sd_pid_notify_with_fds(3), sd_listen_fds(3)):
//   - it listens on its own NOTIFY_SOCKET (an AF_UNIX datagram socket) and
//     takes "FDSTORE=1" messages with their fds (SCM_RIGHTS) under their
//     "FDNAME=", "FDSTOREREMOVE=1" (closes every fd of that FDNAME), and
//     counts "READY=1";
//   - Start() runs a program the way systemd starts a service that has
//     stored fds: NOTIFY_SOCKET set, the stored fds at 3, 4, ... and
//     LISTEN_FDS, LISTEN_FDNAMES (":"-separated) and LISTEN_PID (the child's
//     own pid) in its environment.
// Unlike systemd it does not merge two stores of the same file (a daemon
// that stores one segment twice shows up here as two fds).
//
// Thread-safety: every method may be called from any thread; one receiver
// thread reads the socket.
#ifndef WEIGHTD_TESTS_TESTING_FD_STORE_STANDIN_H_
#define WEIGHTD_TESTS_TESTING_FD_STORE_STANDIN_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/base/scoped_fd.h"

namespace weightd::testing {

class FdStoreStandIn {
 public:
  // The socket is `dir`/notify.sock; output of started programs goes to
  // `dir`/run-<n>.out and .err.
  explicit FdStoreStandIn(const std::string& dir);
  ~FdStoreStandIn();  // SIGKILLs and reaps a program still running
  FdStoreStandIn(const FdStoreStandIn&) = delete;
  FdStoreStandIn& operator=(const FdStoreStandIn&) = delete;

  // Starts `argv` (argv[0] a path) with the stored fds; returns its pid.
  pid_t Start(const std::vector<std::string>& argv);
  // Sends `sig` to the running program and reaps it; returns its exit
  // status, or 128 + the signal number.
  int Kill(int sig);
  // Waits for the running program to exit on its own.
  int Wait();
  pid_t pid() const { return pid_; }
  bool Running();
  // Stdout and stderr of the n-th start (0-based).
  std::string Stdout(int run) const;
  std::string Stderr(int run) const;
  int runs() const { return runs_; }

  // Stored fd names, each with how many fds it holds.
  std::map<std::string, int> Stored() const;
  // READY=1 messages received since construction.
  int ready_count() const { return ready_.load(); }
  // Polls `done` every 10 ms until it holds or `timeout` passes.
  static bool WaitUntil(const std::function<bool()>& done, std::chrono::milliseconds timeout);

  // Test faults: replace the fds stored under `name` with `fd` (ownership
  // taken); drop them; or get a copy of the first (caller owns it).
  void Replace(const std::string& name, ScopedFd fd);
  void Erase(const std::string& name);
  ScopedFd Copy(const std::string& name) const;
  const std::string& notify_socket() const { return socket_path_; }

 private:
  void Receive();

  std::string dir_;
  std::string socket_path_;
  ScopedFd socket_;
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, ScopedFd>> store_;  // in store order
  std::atomic<int> ready_{0};
  std::atomic<bool> stop_{false};
  std::thread receiver_;
  pid_t pid_ = -1;
  int runs_ = 0;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FD_STORE_STANDIN_H_
