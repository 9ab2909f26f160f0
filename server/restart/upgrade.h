// In-place upgrade: the daemon re-executes its binary and the new image
// takes over every READY model, as after a restart through the fd store
// (server/restart/fd_store.h, server/restart/restore.h), but without a service manager, so
// it works in a Kubernetes pod too.
//
// The old image stops serving (ShutdownForUpgrade), copies every stored fd
// (FdStoreKeeper::Handoff), writes "<fd>\t<name>\n" per fd into a sealed
// memfd, and execv(2)s the binary path it started from with the same
// arguments and WEIGHTD_HANDOFF_FD=<that memfd> in the environment. The
// copies are the only descriptors without FD_CLOEXEC, so nothing else
// crosses the exec. Same process: the pid (systemd's MAINPID, a pod's PID 1)
// does not change.
//
// Thread-safety: ExecUpgrade is called by main() after the daemon is gone.
#ifndef WEIGHTD_SERVER_RESTART_UPGRADE_H_
#define WEIGHTD_SERVER_RESTART_UPGRADE_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/restart/fd_store.h"

namespace weightd {

inline constexpr char kHandoffEnv[] = "WEIGHTD_HANDOFF_FD";
inline constexpr size_t kMaxHandoffFds = 1 << 20;

// The path of the running binary (readlink /proc/self/exe), taken at start:
// an upgrade execs that path, which is the new binary once a package
// manager has replaced the file.
absl::StatusOr<std::string> SelfBinaryPath();

// Set in the environment of an image that an in-place upgrade fell back to.
inline constexpr char kUpgradeErrorEnv[] = "WEIGHTD_UPGRADE_ERROR";
inline constexpr size_t kMaxUpgradeErrorBytes = 1024;

// `binary` opened once (O_RDONLY) and checked before the daemon stops
// serving, so that what stops it is only a binary this machine can run; the
// upgrade then executes this fd (fexecve), so the file checked is the file
// executed even if the path is replaced in between. FAILED_PRECONDITION
// naming `binary` and the rule broken: not a regular file; not executable
// by this process; not an ELF executable (a script, a text file: execve(2)
// would fail with ENOEXEC after the daemon stopped); another ELF class, byte
// order or machine than the running image (elf(5): e_ident, e_machine); a
// program header table or a PT_LOAD segment past the end of the file (a
// truncated copy); a PT_INTERP loader that is missing or not executable.
absl::StatusOr<ScopedFd> OpenUpgradable(const std::string& binary);
// OpenUpgradable, the fd closed: for a caller that only reports.
absl::Status CheckUpgradable(const std::string& binary);

// Hands `fds` to a new image executed from `binary_fd` (OpenUpgradable of
// `binary`) with `argv` (argv[0] included). When that exec fails all the
// same (ETXTBSY: the file is still open for writing, E2BIG, ENOMEM, ...),
// re-executes the running image (/proc/self/exe: the inode this process
// runs, even when the path now names another file) with the same fds and
// kUpgradeErrorEnv saying why, so the daemon comes back serving every model
// on its old binary and reports the failure (UpgradeFallbackError). Returns
// only when both execs fail.
absl::Status ExecUpgrade(ScopedFd binary_fd, const std::string& binary, const std::vector<std::string>& argv,
                         std::vector<NamedFd> fds);

// Why the in-place upgrade that started this image fell back to the old
// binary; "" when this image is not such a fallback. Taken from
// kUpgradeErrorEnv (which it unsets, capped at kMaxUpgradeErrorBytes) on the
// first call; main() calls it at start, before the daemon starts. Thread-safe.
const std::string& UpgradeFallbackError();

// The new image's side: the fds of WEIGHTD_HANDOFF_FD (which it unsets),
// made close-on-exec; std::nullopt when the variable is not set. A list fd
// that is not open or not a sealed memfd yields nothing (and is left
// alone); a list that does not parse, or names an fd that is not open,
// yields what did parse; each with a warning in the log. Called through
// TakeListenFds, first thing in main().
std::optional<std::vector<NamedFd>> TakeHandoffFds();

}  // namespace weightd

#endif  // WEIGHTD_SERVER_RESTART_UPGRADE_H_
