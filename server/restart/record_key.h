// RecordKey: the secret that authenticates state records (server/restart/state_record.h)
// between a daemon and its own successor (its next image after an in-place
// upgrade, or the process the service manager starts after a restart).
//
// Why: whoever can hand a daemon fds at start (a stand-in service manager, a
// wrong LISTEN_FDS) could write a record that names a sealed memfd of their
// own and recompute its checksum. A record that carries a valid HMAC under
// this key was written by a daemon that held the key, so its content hashes
// are the ones verified at load and its inodes name the very memfds that
// were stored, sealed against writes: a restore then needs no second pass
// over the bytes (milliseconds, whatever the model size). A record without a
// valid HMAC is still restored, after every host tensor is hashed again
// (server/restart/restore.h).
//
// The key is 32 random bytes (getrandom(2)) in a file only the daemon's user
// can read: `<--socket>.key`, beside the socket's `.lock`. Under systemd the
// socket's directory is the unit's RuntimeDirectory, kept across restarts
// (RuntimeDirectoryPreserve=restart) and removed with the fd store when the
// unit stops. The HMAC is HMAC-SHA256 (RFC 2104, OpenSSL's HMAC(3)).
//
// Thread-safety: immutable after Load(); every method may be called from any
// thread.
#ifndef WEIGHTD_SERVER_RESTART_RECORD_KEY_H_
#define WEIGHTD_SERVER_RESTART_RECORD_KEY_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

inline constexpr size_t kRecordKeyBytes = 32;
inline constexpr size_t kRecordMacBytes = 32;  // HMAC-SHA256

class RecordKey {
 public:
  // The key in `path`, made (mode 0600, O_EXCL) when there is none. The file
  // is opened once with O_NOFOLLOW and must be a regular file of
  // kRecordKeyBytes owned by this process's effective user with no group or
  // other permission bits; FAILED_PRECONDITION naming the path and the rule
  // otherwise (the caller goes on without a key: restores hash every byte).
  static absl::StatusOr<RecordKey> Load(const std::string& path);

  // A key of the given bytes (tests).
  static RecordKey FromBytes(const std::array<uint8_t, kRecordKeyBytes>& bytes) { return RecordKey(bytes); }

  // HMAC-SHA256 of `bytes` under the key: kRecordMacBytes bytes.
  std::string Mac(absl::string_view bytes) const;
  // Whether `mac` is Mac(bytes), compared in constant time.
  bool Verify(absl::string_view bytes, absl::string_view mac) const;

 private:
  explicit RecordKey(const std::array<uint8_t, kRecordKeyBytes>& bytes) : key_(bytes) {}
  std::array<uint8_t, kRecordKeyBytes> key_;
};

// `socket` + ".key": where a daemon serving `socket` keeps its record key.
std::string RecordKeyPath(const std::string& socket);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_RESTART_RECORD_KEY_H_
