#include "server/restart/upgrade.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <elf.h>
#include <string.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "absl/strings/match.h"
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
  std::string self(path, static_cast<size_t>(n));
  // proc(5): a running image whose file was replaced or removed reads
  // "PATH (deleted)"; PATH is where its successor is (an image that an
  // upgrade fell back to runs such a file).
  constexpr absl::string_view kDeleted = " (deleted)";
  if (absl::EndsWith(self, kDeleted)) self.resize(self.size() - kDeleted.size());
  return self;
}

namespace {

absl::Status NotUpgradable(const std::string& binary, absl::string_view why) {
  return absl::FailedPreconditionError(absl::StrCat("cannot upgrade in place: ", binary, " ", why));
}

bool ReadAt(int fd, void* out, size_t n, uint64_t offset) {
  return pread(fd, out, n, static_cast<off_t>(offset)) == static_cast<ssize_t>(n);
}

// The ELF header of the running image, read once: what a new binary must match.
const Elf64_Ehdr* SelfHeader() {
  static const Elf64_Ehdr* self = [] {
    auto* header = new Elf64_Ehdr{};
    ScopedFd fd(open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
    if (!fd.valid() || !ReadAt(fd.get(), header, sizeof *header, 0)) {
      delete header;
      return static_cast<Elf64_Ehdr*>(nullptr);
    }
    return header;
  }();
  return self;
}

// The rules of elf(5) that decide whether execve(2) of this file can start:
// see OpenUpgradable.
absl::Status CheckElf(int fd, const std::string& binary, uint64_t size) {
  constexpr size_t kMaxProgramHeaders = 256;
  constexpr size_t kMaxInterpBytes = 4096;
  Elf64_Ehdr header{};
  if (size < sizeof header || !ReadAt(fd, &header, sizeof header, 0) ||
      memcmp(header.e_ident, ELFMAG, SELFMAG) != 0) {
    return NotUpgradable(binary, "is not an ELF executable (execve(2) would fail with ENOEXEC)");
  }
  const Elf64_Ehdr* self = SelfHeader();
  if (self == nullptr) return NotUpgradable(binary, "cannot be compared with the running image (/proc/self/exe)");
  if (header.e_ident[EI_CLASS] != self->e_ident[EI_CLASS] || header.e_ident[EI_DATA] != self->e_ident[EI_DATA] ||
      header.e_machine != self->e_machine) {
    return NotUpgradable(binary, absl::StrCat("is an ELF file for another machine (class ", header.e_ident[EI_CLASS],
                                              ", byte order ", header.e_ident[EI_DATA], ", e_machine ",
                                              header.e_machine, "; this one runs e_machine ", self->e_machine, ")"));
  }
  if (header.e_type != ET_EXEC && header.e_type != ET_DYN) {
    return NotUpgradable(binary, absl::StrCat("is an ELF file of type ", header.e_type, ", not an executable"));
  }
  if (header.e_phentsize != sizeof(Elf64_Phdr) || header.e_phnum == 0 || header.e_phnum > kMaxProgramHeaders ||
      header.e_phoff > size || (size - header.e_phoff) / sizeof(Elf64_Phdr) < header.e_phnum) {
    return NotUpgradable(binary, "has no valid program header table within the file (truncated?)");
  }
  std::vector<Elf64_Phdr> headers(header.e_phnum);
  if (!ReadAt(fd, headers.data(), headers.size() * sizeof(Elf64_Phdr), header.e_phoff)) {
    return NotUpgradable(binary, "has a program header table that cannot be read");
  }
  bool loads = false;
  for (const Elf64_Phdr& ph : headers) {
    if (ph.p_type != PT_LOAD && ph.p_type != PT_INTERP) continue;
    if (ph.p_offset > size || ph.p_filesz > size - ph.p_offset) {
      return NotUpgradable(binary, absl::StrCat("is truncated: a segment ends at byte ", ph.p_offset + ph.p_filesz,
                                                " of a ", size, "-byte file"));
    }
    loads = loads || ph.p_type == PT_LOAD;
    if (ph.p_type != PT_INTERP) continue;
    std::string interp(std::min<uint64_t>(ph.p_filesz, kMaxInterpBytes), '\0');
    if (!ReadAt(fd, interp.data(), interp.size(), ph.p_offset)) return NotUpgradable(binary, "has an unreadable PT_INTERP");
    interp.resize(strnlen(interp.c_str(), interp.size()));
    if (interp.empty() || access(interp.c_str(), X_OK) != 0) {
      return NotUpgradable(binary, absl::StrCat("needs the loader ", ElideName(interp), ", which is not executable here"));
    }
  }
  if (!loads) return NotUpgradable(binary, "has no loadable segment");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ScopedFd> OpenUpgradable(const std::string& binary) {
  ScopedFd fd(open(binary.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return NotUpgradable(binary, absl::StrCat("cannot be opened: ", strerror(errno)));
  struct stat st {};
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return NotUpgradable(binary, "is not a regular file");
  // access(2) on the path checks what exec(2) checks: the mode for this
  // process's ids, and a noexec mount.
  if (access(binary.c_str(), X_OK) != 0) return NotUpgradable(binary, "is not executable");
  WEIGHTD_RETURN_IF_ERROR(CheckElf(fd.get(), binary, static_cast<uint64_t>(st.st_size)));
  return fd;
}

absl::Status CheckUpgradable(const std::string& binary) { return OpenUpgradable(binary).status(); }

absl::Status ExecUpgrade(ScopedFd binary_fd, const std::string& binary, const std::vector<std::string>& argv,
                         std::vector<NamedFd> fds) {
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
    absl::string_view var(*e);
    if (!absl::StartsWith(var, absl::StrCat(kHandoffEnv, "=")) && !absl::StartsWith(var, absl::StrCat(kUpgradeErrorEnv, "="))) {
      env.emplace_back(var);
    }
  }
  env.push_back(absl::StrCat(kHandoffEnv, "=", list_fd->get()));
  auto exec = [&](int fd, const char* path) {
    std::vector<char*> cargv, cenv;
    for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    for (const std::string& e : env) cenv.push_back(const_cast<char*>(e.c_str()));
    cenv.push_back(nullptr);
    if (fd >= 0) return fexecve(fd, cargv.data(), cenv.data());
    return execve(path, cargv.data(), cenv.data());
  };
  exec(binary_fd.get(), nullptr);
  std::string failure = CapMessage(absl::StrCat("execve ", binary, ": ", strerror(errno)), kMaxUpgradeErrorBytes);
  LogError(absl::StrCat("in-place upgrade failed: ", failure,
                        "; executing the running image (/proc/self/exe) again so that every model keeps being served"));
  env.push_back(absl::StrCat(kUpgradeErrorEnv, "=", failure));
  exec(-1, "/proc/self/exe");
  return ErrnoToStatus(absl::StrCat(failure, "; and execve /proc/self/exe"), errno);  // the copies close with `fds`
}

const std::string& UpgradeFallbackError() {
  static const std::string* error = [] {
    const char* value = std::getenv(kUpgradeErrorEnv);
    auto* taken = new std::string(value == nullptr ? "" : CapMessage(value, kMaxUpgradeErrorBytes));
    unsetenv(kUpgradeErrorEnv);
    return taken;
  }();
  return *error;
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
  // The list an upgrade writes is a sealed memfd; any other fd under that
  // number was not handed over by an upgrade, and is left alone.
  if (!SealedAgainstWrites(list_fd)) {
    LogWarning(absl::StrCat(kHandoffEnv, "=", list_fd, " is not a sealed fd list: nothing handed over"));
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
