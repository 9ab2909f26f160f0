// What the two processes of the GPU checks share: the byte pattern written by
// the exporting (daemon-like) parent and verified by the importing child, and
// the one-line messages they exchange over a SOCK_SEQPACKET socketpair.
//
//   parent -> child: "import backend=cuda uuid=GPU-... size=N verify=full|ends|none seed=S write=0|1 [handle=HEX]"
//                    with the arena fd attached (SCM_RIGHTS) for backend=cuda
//   parent -> child: "hello" | "quit"
//   child -> parent: "ok key=value ..." or "error <message>"
#ifndef WEIGHTD_TESTS_GPU_GPU_CHECK_PROTOCOL_H_
#define WEIGHTD_TESTS_GPU_GPU_CHECK_PROTOCOL_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace weightd::gpu_checks {

inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint64_t kGiB = uint64_t{1} << 30;
// verify=ends checks this many bytes at each end of the arena.
inline constexpr uint64_t kEndBytes = kMiB;

// Writes the pattern for arena bytes [offset, offset + n) to `dst`.
// `offset` and `n` are multiples of 8.
void FillPattern(char* dst, uint64_t offset, uint64_t n, uint64_t seed);
// The first arena offset in [offset, offset + n) whose byte differs from the
// pattern, or -1 when all match.
int64_t FindMismatch(const char* src, uint64_t offset, uint64_t n, uint64_t seed);

// A message as its first word ("import", "ok", ...) and key=value fields;
// for "error", fields["message"] is the rest of the line.
struct Message {
  std::string verb;
  std::map<std::string, std::string> fields;
  std::string Get(const std::string& key) const;
};
absl::StatusOr<Message> ParseMessage(const std::string& line);

inline double MillisecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The child's main loop on socket `sock` (runs until "quit" or EOF).
int ChildMain(int sock);

}  // namespace weightd::gpu_checks

#endif  // WEIGHTD_TESTS_GPU_GPU_CHECK_PROTOCOL_H_
