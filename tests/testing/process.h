// Real processes for end-to-end tests: spawn a binary with its output going
// to files, wait for it, signal it; and a weightd daemon on a temporary
// socket.
#ifndef WEIGHTD_TESTS_TESTING_PROCESS_H_
#define WEIGHTD_TESTS_TESTING_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "tests/testing/shared_inputs.h"

namespace weightd::testing {

class Process {
 public:
  // Starts argv[0] (a path) with stdout/stderr redirected into files in `dir`.
  Process(const std::vector<std::string>& argv, const std::string& dir);
  ~Process();  // SIGKILLs and reaps a process still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  // Waits for exit; returns the exit status, or 128 + signal number.
  int Wait();
  bool Running();
  void Signal(int sig);
  std::string Stdout() const;
  std::string Stderr() const;

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string out_path_, err_path_;
};

struct CommandResult {
  int code;
  std::string out, err;
};
// Runs a command to completion.
CommandResult RunCommand(const std::vector<std::string>& argv);

// Polls `done` every 20 ms until it holds (true) or `timeout` passes (false).
bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout);

// The pids of `parent`'s children whose comm (/proc/PID/stat) is `comm`,
// e.g. "wd-peer-helper" (weightd's peer transfer helpers).
std::vector<pid_t> ChildrenNamed(pid_t parent, const std::string& comm);

// weightctl arguments that load the demo checkpoint at `path` as `name` with
// a TP=2 plan on the emulated GPUs 0 and 1 (attention and MLP projections
// split, embed_tokens host-resident), --json.
std::vector<std::string> Tp2Plan(const std::string& name, const std::string& path);

// WEIGHTD_BINARY / WEIGHTCTL_BINARY, set by CTest.
std::string WeightdBinary();
std::string WeightctlBinary();

// A weightd on <tmp>/w.sock with model roots <tmp>/models and ../shared
// (when present). Start() waits until the gRPC socket answers. `launcher`
// (e.g. {"/usr/bin/prlimit", "--nofile=64:64", "--"}) runs weightd, and must
// exec it so that pid() is the daemon's.
class DaemonProcess {
 public:
  explicit DaemonProcess(std::vector<std::string> extra_args = {}, std::vector<std::string> launcher = {});
  ~DaemonProcess();
  const std::string& socket() const { return socket_; }
  std::string models_dir() const { return dir_.Join("models"); }
  const TempDir& dir() const { return dir_; }
  pid_t pid() const { return process_->pid(); }
  Process& process() { return *process_; }
  // weightctl --socket <socket> args...
  CommandResult Ctl(const std::vector<std::string>& args) const;
  std::vector<std::string> CtlArgv(const std::vector<std::string>& args) const;
  // SIGTERM and wait: the exit status.
  int Stop();
  // The port of the daemon's "gRPC TCP listener on 127.0.0.1:<port>" log
  // line (a --grpc-address of 127.0.0.1:0). The TCP, health and peer
  // listeners start after the Unix socket answers, so this waits for the
  // line (up to 20 s, or until the daemon exits); 0 if it never came.
  int TcpListenerPort();
  // The port in the daemon's log after `prefix` + `host` + ":" (e.g.
  // "peer listener on ", "metrics on http://"); waits as TcpListenerPort
  // does; 0 if the line never came.
  int LoggedPort(const std::string& prefix, const std::string& host = "127.0.0.1");

 private:
  // The daemon's log once `found` holds for it, the daemon has exited, or 20 s passed.
  std::string AwaitLog(const std::function<bool(const std::string&)>& found);

  TempDir dir_;
  std::string socket_;
  std::unique_ptr<Process> process_;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_PROCESS_H_
