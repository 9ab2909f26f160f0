#include "server/upgrade.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/log.h"
#include "common/base/status.h"

extern char** environ;

namespace weightd {

absl::StatusOr<std::string> SelfBinaryPath() {
  char path[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return ErrnoToStatus("readlink /proc/self/exe", errno);
  return std::string(path, static_cast<size_t>(n));
}

absl::Status CheckUpgradable(const std::string& binary) {
  struct stat st {};
  if (stat(binary.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("cannot upgrade in place: ", binary, " is not a regular file"));
  }
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot upgrade in place: ", binary, " is not executable"));
  }
  return absl::OkStatus();
}

absl::Status ExecUpgrade(const std::string& binary, const std::vector<std::string>& argv, std::vector<NamedFd> fds) {
  std::string list;
  for (const NamedFd& f : fds) {
    if (!f.fd.valid()) continue;
    absl::StrAppend(&list, f.fd.get(), "\t", f.name, "\n");
  }
  absl::StatusOr<ScopedFd> list_fd = SealedMemfd("handoff", list);
  if (!list_fd.ok()) return list_fd.status();
  for (const NamedFd& f : fds) {
    if (f.fd.valid() && fcntl(f.fd.get(), F_SETFD, 0) != 0) return ErrnoToStatus("clear FD_CLOEXEC", errno);
  }
  if (fcntl(list_fd->get(), F_SETFD, 0) != 0) return ErrnoToStatus("clear FD_CLOEXEC", errno);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string(*e).rfind(absl::StrCat(kHandoffEnv, "="), 0) != 0) env.push_back(*e);
  }
  env.push_back(absl::StrCat(kHandoffEnv, "=", list_fd->get()));
  std::vector<char*> cargv, cenv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const std::string& e : env) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  execve(binary.c_str(), cargv.data(), cenv.data());
  return ErrnoToStatus(absl::StrCat("execve ", binary), errno);  // the copies close with `fds`
}

std::optional<std::vector<NamedFd>> TakeHandoffFds() {
  const char* value = std::getenv(kHandoffEnv);
  if (value == nullptr) return std::nullopt;
  int list_fd = -1;
  bool parsed = absl::SimpleAtoi(value, &list_fd) && list_fd > 2;
  unsetenv(kHandoffEnv);
  std::vector<NamedFd> fds;
  if (!parsed || fcntl(list_fd, F_GETFD) < 0) {
    LogWarning(absl::StrCat(kHandoffEnv, "=", value, " is not an open fd: nothing handed over"));
    return fds;
  }
  ScopedFd list(list_fd);
  struct stat st {};
  if (fstat(list.get(), &st) != 0 || st.st_size < 0 || static_cast<uint64_t>(st.st_size) > (64ull << 20)) {
    LogWarning("the upgrade's fd list is unreadable or over 64 MiB: nothing handed over");
    return fds;
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  if (pread(list.get(), text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    LogWarning("cannot read the upgrade's fd list: nothing handed over");
    return fds;
  }
  std::set<int> taken;  // an fd listed twice is owned once
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits('\t', 1));
    int fd = -1;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &fd) || fd <= 2 || fd == list_fd || fcntl(fd, F_GETFD) < 0 ||
        fds.size() >= kMaxHandoffFds || !taken.insert(fd).second) {
      LogWarning(absl::StrCat("the upgrade's fd list has a bad line: '", line.substr(0, 80), "'"));
      continue;
    }
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    fds.push_back({std::string(parts[1]), ScopedFd(fd)});
  }
  return fds;
}

}  // namespace weightd
