#include "tests/testing/process.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <regex>
#include <thread>

extern char** environ;

namespace weightd::testing {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string EnvOr(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v ? v : fallback;
}

}  // namespace

Process::Process(const std::vector<std::string>& argv, const std::string& dir) {
  static int counter = 0;
  std::string stem = dir + "/proc" + std::to_string(getpid()) + "_" + std::to_string(counter++);
  out_path_ = stem + ".out";
  err_path_ = stem + ".err";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
  posix_spawn_file_actions_destroy(&actions);
}

Process::~Process() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    Wait();
  }
}

int Process::Wait() {
  if (pid_ <= 0) return 127;
  if (!reaped_) {
    while (waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
    }
    reaped_ = true;
  }
  return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
}

bool Process::Running() {
  if (pid_ <= 0 || reaped_) return false;
  pid_t r = waitpid(pid_, &status_, WNOHANG);
  if (r == pid_) reaped_ = true;
  return !reaped_;
}

void Process::Signal(int sig) {
  if (pid_ > 0 && !reaped_) kill(pid_, sig);
}

std::string Process::Stdout() const { return ReadAll(out_path_); }
std::string Process::Stderr() const { return ReadAll(err_path_); }

bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

CommandResult RunCommand(const std::vector<std::string>& argv) {
  TempDir dir;
  Process p(argv, dir.path());
  int code = p.Wait();
  return {code, p.Stdout(), p.Stderr()};
}

std::vector<pid_t> ChildrenNamed(pid_t parent, const std::string& comm) {
  std::vector<pid_t> out;
  DIR* d = opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    std::ifstream in(std::string("/proc/") + e->d_name + "/stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos || stat.substr(open + 1, close - open - 1) != comm) {
      continue;
    }
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(static_cast<pid_t>(pid));
  }
  closedir(d);
  return out;
}

std::vector<std::string> Tp2Plan(const std::string& name, const std::string& path) {
  return {"load", name, path, "--tp-size", "2",
          "--tp-rule", "q_proj:0", "--tp-rule", "k_proj:0", "--tp-rule", "v_proj:0",
          "--tp-rule", "gate_proj:0", "--tp-rule", "up_proj:0",
          "--tp-rule", "o_proj:1", "--tp-rule", "down_proj:1",
          "--host-resident", "embed_tokens", "--devices", "GPU-emulated-0,GPU-emulated-1", "--json"};
}

std::string WeightdBinary() { return EnvOr("WEIGHTD_BINARY", WEIGHTD_BINARY_PATH); }
std::string WeightctlBinary() { return EnvOr("WEIGHTCTL_BINARY", WEIGHTCTL_BINARY_PATH); }

DaemonProcess::DaemonProcess(std::vector<std::string> extra_args, std::vector<std::string> launcher) {
  socket_ = dir_.Join("w.sock");
  mkdir(models_dir().c_str(), 0755);
  std::vector<std::string> argv = {WeightdBinary(), "--socket", socket_, "--model-root", models_dir(),
                                   "--metrics-address", ""};
  if (auto shared = SharedDir()) {
    argv.push_back("--model-root");
    argv.push_back(*shared);
  }
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  argv.insert(argv.begin(), launcher.begin(), launcher.end());
  process_ = std::make_unique<Process>(argv, dir_.path());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline && process_->Running()) {
    if (Ctl({"ls", "--json"}).code == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

DaemonProcess::~DaemonProcess() { Stop(); }

std::vector<std::string> DaemonProcess::CtlArgv(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {WeightctlBinary(), "--socket", socket_};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

CommandResult DaemonProcess::Ctl(const std::vector<std::string>& args) const { return RunCommand(CtlArgv(args)); }

// The Unix socket answers before the TCP, health and peer listeners start (daemon.cc starts them in that
// order), so a port is looked for in the log until it appears, the daemon exits, or 20 s pass.
std::string DaemonProcess::AwaitLog(const std::function<bool(const std::string&)>& found) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (true) {
    bool running = process_->Running();
    std::string log = process_->Stderr();
    if (found(log) || !running || std::chrono::steady_clock::now() >= deadline) return log;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int DaemonProcess::TcpListenerPort() {
  const std::regex listener(R"(gRPC TCP listener on 127\.0\.0\.1:(\d+))");
  std::string log = AwaitLog([&](const std::string& l) { return std::regex_search(l, listener); });
  std::smatch m;
  if (!std::regex_search(log, m, listener)) return 0;
  return std::stoi(m[1]);
}

int DaemonProcess::LoggedPort(const std::string& prefix, const std::string& host) {
  std::string needle = prefix + host + ":";
  std::string log = AwaitLog([&](const std::string& l) { return l.find(needle) != std::string::npos; });
  size_t at = log.find(needle);
  if (at == std::string::npos) return 0;
  return std::atoi(log.c_str() + at + needle.size());
}

int DaemonProcess::Stop() {
  process_->Signal(SIGTERM);
  return process_->Wait();
}

}  // namespace weightd::testing
