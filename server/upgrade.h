// In-place upgrade: the daemon re-executes its binary and the new image
// takes over every READY model, as after a restart through the fd store
// (server/fd_store.h, server/restore.h), but without a service manager, so
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
#ifndef WEIGHTD_SERVER_UPGRADE_H_
#define WEIGHTD_SERVER_UPGRADE_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/fd_store.h"

namespace weightd {

inline constexpr char kHandoffEnv[] = "WEIGHTD_HANDOFF_FD";
inline constexpr size_t kMaxHandoffFds = 1 << 20;

// The path of the running binary (readlink /proc/self/exe), taken at start:
// an upgrade execs that path, which is the new binary once a package
// manager has replaced the file.
absl::StatusOr<std::string> SelfBinaryPath();

// OK when `binary` is a regular file this process may execute; otherwise
// FAILED_PRECONDITION naming it. Checked before the daemon stops serving.
absl::Status CheckUpgradable(const std::string& binary);

// Hands `fds` to a new image of `binary` with `argv` (argv[0] included).
// Returns only on failure.
absl::Status ExecUpgrade(const std::string& binary, const std::vector<std::string>& argv, std::vector<NamedFd> fds);

// The new image's side: the fds of WEIGHTD_HANDOFF_FD (which it unsets),
// made close-on-exec; std::nullopt when the variable is not set. A list
// that does not parse, or names an fd that is not open, yields what did
// parse and a warning in the log.
std::optional<std::vector<NamedFd>> TakeHandoffFds();

}  // namespace weightd

#endif  // WEIGHTD_SERVER_UPGRADE_H_
