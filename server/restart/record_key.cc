#include "server/restart/record_key.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/base/scoped_fd.h"
#include "common/base/status.h"

namespace weightd {
namespace {

absl::Status Refuse(const std::string& path, absl::string_view rule) {
  return absl::FailedPreconditionError(absl::StrCat("record key ", path, ": ", rule));
}

// Reads the whole key from `fd`, whose file was checked by the caller.
absl::StatusOr<std::array<uint8_t, kRecordKeyBytes>> ReadKey(int fd, const std::string& path) {
  std::array<uint8_t, kRecordKeyBytes> key{};
  size_t done = 0;
  while (done < key.size()) {
    ssize_t got = pread(fd, key.data() + done, key.size() - done, static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return ErrnoToStatus(absl::StrCat("reading record key ", path), got < 0 ? errno : EIO);
    done += static_cast<size_t>(got);
  }
  return key;
}

absl::StatusOr<std::array<uint8_t, kRecordKeyBytes>> MakeKey(const std::string& path) {
  std::array<uint8_t, kRecordKeyBytes> key{};
  if (getrandom(key.data(), key.size(), 0) != static_cast<ssize_t>(key.size())) {
    return ErrnoToStatus("getrandom for the record key", errno);
  }
  ScopedFd fd(open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoToStatus(absl::StrCat("creating record key ", path), errno);
  size_t done = 0;
  while (done < key.size()) {
    ssize_t put = write(fd.get(), key.data() + done, key.size() - done);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      int err = put < 0 ? errno : EIO;
      unlink(path.c_str());  // ours (O_EXCL): a short key must not be read back later
      return ErrnoToStatus(absl::StrCat("writing record key ", path), err);
    }
    done += static_cast<size_t>(put);
  }
  return key;
}

}  // namespace

absl::StatusOr<RecordKey> RecordKey::Load(const std::string& path) {
  ScopedFd fd(open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  if (!fd.valid() && errno == ENOENT) {
    WEIGHTD_ASSIGN_OR_RETURN(auto key, MakeKey(path));
    return RecordKey(key);
  }
  if (!fd.valid()) {
    if (errno == ELOOP) return Refuse(path, "is a symbolic link");
    return ErrnoToStatus(absl::StrCat("opening record key ", path), errno);
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return ErrnoToStatus(absl::StrCat("fstat record key ", path), errno);
  if (!S_ISREG(st.st_mode)) return Refuse(path, "is not a regular file");
  if (st.st_uid != geteuid()) {
    return Refuse(path, absl::StrCat("is owned by uid ", st.st_uid, ", not this daemon's user (", geteuid(), ")"));
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Refuse(path, absl::StrCat("has mode ", mode, " (group or others have access; must be 0600)"));
  }
  if (static_cast<uint64_t>(st.st_size) != kRecordKeyBytes) {
    return Refuse(path, absl::StrCat("is ", st.st_size, " bytes, not ", kRecordKeyBytes));
  }
  WEIGHTD_ASSIGN_OR_RETURN(auto key, ReadKey(fd.get(), path));
  return RecordKey(key);
}

std::string RecordKey::Mac(absl::string_view bytes) const {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  HMAC(EVP_sha256(), key_.data(), static_cast<int>(key_.size()), reinterpret_cast<const unsigned char*>(bytes.data()),
       bytes.size(), out, &n);
  return std::string(reinterpret_cast<const char*>(out), n);
}

bool RecordKey::Verify(absl::string_view bytes, absl::string_view mac) const {
  std::string expected = Mac(bytes);
  return mac.size() == expected.size() && CRYPTO_memcmp(mac.data(), expected.data(), expected.size()) == 0;
}

std::string RecordKeyPath(const std::string& socket) { return socket + ".key"; }

}  // namespace weightd
