// Destinations of a PeerConnection in tests (common/peer/peer_transport.h):
// size-sealed memfds, as a joiner's fresh segments are, mapped read-only
// here so a test can look at what arrived, and sealed against writes on
// request as the loader does (server/load/source_fill.h).
#ifndef WEIGHTD_TESTS_TESTING_PEER_DESTINATIONS_H_
#define WEIGHTD_TESTS_TESTING_PEER_DESTINATIONS_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/peer/peer_transport.h"

namespace weightd::testing {

class PeerDestinations {
 public:
  explicit PeerDestinations(std::vector<uint64_t> sizes) {
    for (uint64_t size : sizes) {
      int fd = memfd_create("peer-destination", MFD_CLOEXEC | MFD_ALLOW_SEALING);
      if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0 ||
          fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
        std::abort();  // a test machine without memfds
      }
      // Read-only through an O_RDONLY descriptor: this mapping does not
      // count as writable, so it never blocks the seal itself.
      int ro = open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_CLOEXEC);
      void* map = size == 0 || ro < 0 ? nullptr : mmap(nullptr, size, PROT_READ, MAP_SHARED, ro, 0);
      if (ro >= 0) close(ro);
      entries_.push_back({fd, size, map == MAP_FAILED ? nullptr : static_cast<const char*>(map)});
    }
  }
  ~PeerDestinations() {
    for (const Entry& e : entries_) {
      if (e.map != nullptr) munmap(const_cast<char*>(e.map), e.size);
      close(e.fd);
    }
  }
  PeerDestinations(const PeerDestinations&) = delete;
  PeerDestinations& operator=(const PeerDestinations&) = delete;

  PeerConnectOptions Options(uint32_t lanes = 1) const {
    PeerConnectOptions options;
    options.lanes = lanes;
    for (const Entry& e : entries_) options.destinations.push_back({e.fd, e.size});
    return options;
  }
  std::string Bytes(uint32_t d, uint64_t at, uint64_t n) const { return std::string(entries_[d].map + at, n); }
  // F_SEAL_WRITE: OK, or the errno the kernel answered (EBUSY while a
  // process maps the destination writable) as FAILED_PRECONDITION.
  absl::Status SealWrite(uint32_t d) const {
    if (fcntl(entries_[d].fd, F_ADD_SEALS, F_SEAL_WRITE) == 0) return absl::OkStatus();
    return absl::FailedPreconditionError(std::strerror(errno));
  }

 private:
  struct Entry {
    int fd;
    uint64_t size;
    const char* map;
  };
  std::vector<Entry> entries_;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_PEER_DESTINATIONS_H_
