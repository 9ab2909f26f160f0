#include "tests/testing/fd_store_standin.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/transport/unix_socket.h"

extern char** environ;

namespace weightd::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

FdStoreStandIn::FdStoreStandIn(const std::string& dir) : dir_(dir), socket_path_(dir + "/notify.sock") {
  socket_ = ScopedFd(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_path_.c_str(), sizeof(addr.sun_path) - 1);
  unlink(socket_path_.c_str());
  if (bind(socket_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    socket_.Reset();
    return;
  }
  int buffer = 8 << 20;
  setsockopt(socket_.get(), SOL_SOCKET, SO_RCVBUFFORCE, &buffer, sizeof(buffer));
  receiver_ = std::thread([this] { Receive(); });
}

FdStoreStandIn::~FdStoreStandIn() {
  if (pid_ > 0) Kill(SIGKILL);
  stop_ = true;
  if (receiver_.joinable()) receiver_.join();
  unlink(socket_path_.c_str());
}

void FdStoreStandIn::Receive() {
  while (!stop_) {
    std::vector<ScopedFd> fds;
    absl::StatusOr<std::string> data = ReceiveMessage(socket_.get(), &fds, 20);
    if (!data.ok()) continue;  // nothing within 20 ms
    std::map<std::string, std::string> fields;
    for (absl::string_view line : absl::StrSplit(*data, '\n', absl::SkipEmpty())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
      fields[kv.first] = kv.second;
    }
    if (fields["READY"] == "1") ++ready_;
    std::lock_guard<std::mutex> lock(mu_);
    if (fields["FDSTORE"] == "1") {
      std::string name = fields.count("FDNAME") ? fields["FDNAME"] : "stored";
      for (ScopedFd& fd : fds) store_.emplace_back(name, std::move(fd));
    } else if (fields["FDSTOREREMOVE"] == "1") {
      std::erase_if(store_, [&](const auto& e) { return e.first == fields["FDNAME"]; });
    }
  }
}

pid_t FdStoreStandIn::Start(const std::vector<std::string>& argv) {
  std::vector<int> fds;
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [name, fd] : store_) {
      fds.push_back(fd.get());
      names.push_back(name);
    }
  }
  // Everything the child needs is prepared here: after fork only
  // async-signal-safe calls.
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string s = *e;
    if (s.rfind("LISTEN_", 0) != 0 && s.rfind("NOTIFY_SOCKET=", 0) != 0) env.push_back(s);
  }
  env.push_back("NOTIFY_SOCKET=" + socket_path_);
  if (!fds.empty()) {
    env.push_back(absl::StrCat("LISTEN_FDS=", fds.size()));
    env.push_back("LISTEN_FDNAMES=" + absl::StrJoin(names, ":"));
    env.push_back("LISTEN_PID=0000000000");  // the child writes its pid here
  }
  std::vector<char*> cenv, cargv;
  for (std::string& e : env) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  char* listen_pid = fds.empty() ? nullptr : cenv[cenv.size() - 2] + std::strlen("LISTEN_PID=");
  std::string out = absl::StrCat(dir_, "/run-", runs_, ".out"), err = absl::StrCat(dir_, "/run-", runs_, ".err");
  ++runs_;
  int n = static_cast<int>(fds.size());
  pid_t pid = fork();
  if (pid == 0) {
    if (listen_pid != nullptr) {  // the decimal pid, no leading zeros (systemd parses "0..." as octal)
      char digits[16];
      int len = 0;
      for (pid_t self = getpid(); self > 0; self /= 10) digits[len++] = static_cast<char>('0' + self % 10);
      for (int i = 0; i < len; ++i) listen_pid[i] = digits[len - 1 - i];
      listen_pid[len] = '\0';
    }
    for (int i = 0; i < n; ++i) fds[i] = fcntl(fds[i], F_DUPFD, 3 + n + 16);
    for (int i = 0; i < n; ++i) {
      dup2(fds[i], 3 + i);
      close(fds[i]);
    }
    int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(o, 1);
    dup2(e, 2);
    execve(cargv[0], cargv.data(), cenv.data());
    _exit(127);
  }
  pid_ = pid;
  return pid;
}

int FdStoreStandIn::Kill(int sig) {
  if (pid_ <= 0) return -1;
  kill(pid_, sig);
  return Wait();
}

int FdStoreStandIn::Wait() {
  if (pid_ <= 0) return -1;
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool FdStoreStandIn::Running() {
  if (pid_ <= 0) return false;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    pid_ = -1;
    return false;
  }
  return true;
}

std::string FdStoreStandIn::Stdout(int run) const { return ReadFile(absl::StrCat(dir_, "/run-", run, ".out")); }
std::string FdStoreStandIn::Stderr(int run) const { return ReadFile(absl::StrCat(dir_, "/run-", run, ".err")); }

std::map<std::string, int> FdStoreStandIn::Stored() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, int> names;
  for (const auto& [name, fd] : store_) ++names[name];
  return names;
}

bool FdStoreStandIn::WaitUntil(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

void FdStoreStandIn::Replace(const std::string& name, ScopedFd fd) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [n, stored] : store_) {
    if (n == name) {
      stored = std::move(fd);
      return;
    }
  }
}

void FdStoreStandIn::Erase(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(store_, [&](const auto& e) { return e.first == name; });
}

ScopedFd FdStoreStandIn::Copy(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [n, stored] : store_) {
    if (n == name) return ScopedFd(fcntl(stored.get(), F_DUPFD_CLOEXEC, 3));
  }
  return ScopedFd();
}

}  // namespace weightd::testing
