// What a segment is and how it leaves the daemon: one name per kind, spelled
// the same in code, in SegmentDescriptor.backend on the wire, in logs and in
// docs (docs/api.md, docs/devices.md).
//
//   memfd            a sealed host memfd, mapped read-only   exported by fd
//   cuda-vmm         a CUDA VMM arena (--device-backend cuda) exported by fd
//   cuda-legacy-ipc  a cuMemAlloc arena                      exported by handle bytes
//   emulated         a memfd standing in for device memory   exported by fd
//
// Pure functions; thread-safe.
#ifndef WEIGHTD_COMMON_MEMORY_SEGMENT_BACKEND_H_
#define WEIGHTD_COMMON_MEMORY_SEGMENT_BACKEND_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

enum class SegmentBackend { kMemfd, kCudaVmm, kCudaLegacyIpc, kEmulated };

// The wire name: "memfd", "cuda-vmm", "cuda-legacy-ipc", "emulated".
absl::string_view SegmentBackendName(SegmentBackend backend);
// The inverse of SegmentBackendName; also accepts "cuda", which daemons
// before the one vocabulary wrote for cuda-vmm. INVALID_ARGUMENT otherwise.
absl::StatusOr<SegmentBackend> ParseSegmentBackend(absl::string_view name);
// False for backends exported by handle bytes (no fd on the fd channel).
bool ExportsFd(SegmentBackend backend);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_MEMORY_SEGMENT_BACKEND_H_
