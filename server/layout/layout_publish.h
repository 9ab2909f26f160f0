// Publishing a runtime layout (server/model/layout.h, docs/api.md "Runtime
// layouts"): checking what a writer declares, staging writable memory for
// it, and turning what it wrote, sealed and hashed, into a Layout.
//
// Staging (StageLayout): every tensor gets a 256-byte aligned place in one
// of at most two new memfds, one for the HOST tensors and one for the
// DEVICE tensors, each zero-filled with its size sealed (F_SEAL_SHRINK |
// F_SEAL_GROW) before its fd goes to the writer: the writer may write
// bytes, never resize memory the daemon maps.
//
// Committing (SealLayout), in this order:
//   1. every expected hash names a tensor and is 16 hex digits;
//   2. each staged memfd is sealed against writes (F_SEAL_WRITE, which the
//      kernel refuses with EBUSY while any process maps it writable:
//      FAILED_PRECONDITION "still mapped writable", the writer may unmap
//      and commit again; fcntl(2), memfd_create(2));
//   3. every byte no tensor covers is still zero (a writer may write its
//      tensors' bytes only; nothing else it wrote is ever served);
//   4. every tensor is hashed (xxh3-64) from the sealed bytes, in parallel,
//      and checked against the expected hashes;
//   5. the device staging memfd is copied into a fresh arena on the GPU,
//      which the daemon allocated and only the daemon can write, and sealed.
// Sealing before hashing means no byte can change between the check and
// the serving: the writer keeps its fds, but write(2) on them fails (EPERM)
// and a new shared writable mapping is refused.
//
// The arena is then served like a checkpoint's: mapped read-only where the
// driver grants it to every process that attaches it (CUDA has no seal for
// device memory), so its immutability is a checkpoint arena's, no more.
//
// Why device tensors are staged in host memory rather than in an arena the
// writer maps: a CUDA VMM or IPC mapping in another process cannot be
// revoked or write-protected once granted (there is no F_SEAL_WRITE for
// device memory), so a writer that kept its mapping could change served
// bytes after the commit. A staging arena copied device-to-device at commit
// would close that too, at a D2D copy instead of the writer's D2H plus the
// daemon's H2D, but its bytes could then only be hashed by copying them
// back to the host; the sealed memfd is hashed where it lies. The staging
// memfd is dropped after the commit (its pages live on only while the
// writer still holds its fd; the clients close it after committing).
//
// Thread-safety: a StagedLayout is changed by one thread at a time (the
// registry's LayoutWriters table lets one commit run); the fd socket may
// read its segments' fds meanwhile.
#ifndef WEIGHTD_SERVER_LAYOUT_LAYOUT_PUBLISH_H_
#define WEIGHTD_SERVER_LAYOUT_LAYOUT_PUBLISH_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/format/dtype.h"
#include "common/memory/device.h"
#include "common/memory/host_segment.h"
#include "server/model/layout.h"
#include "server/model/memory_admission.h"
#include "server/model/model.h"

namespace weightd {

// Bounds of a BeginLayout request (proto/weightd/v1/weightd.proto).
inline constexpr size_t kMaxLayoutKeyBytes = 256;
inline constexpr size_t kMaxLayoutTensors = 1 << 20;
inline constexpr size_t kMaxLayoutTensorNameBytes = 1024;
inline constexpr size_t kMaxLayoutDims = 16;
inline constexpr size_t kMaxIdentityEntries = 64;
inline constexpr size_t kMaxIdentityKeyBytes = 128;
inline constexpr size_t kMaxIdentityValueBytes = 1024;
inline constexpr uint64_t kMaxLayoutBytes = uint64_t{1} << 40;  // 1 TiB
inline constexpr double kMaxLayoutWaitSeconds = 3600;
// Where tensors start in a staged segment (CUDA's allocation alignment, so
// a device tensor's pointer suits every kernel that asks 256 bytes).
inline constexpr uint64_t kLayoutTensorAlignment = 256;

// Why a publish ended without a layout (a metric label and a log word).
inline constexpr const char* kLayoutAbortReasons[] = {"aborted_by_writer", "writer_disconnected", "claim_timeout",
                                                      "verification_failed", "unloaded", "superseded"};

struct LayoutTensorSpec {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> strides;  // in elements; empty: contiguous
  Placement placement = Placement::kHost;
};

struct LayoutRequest {
  std::string model;
  std::string key;
  LayoutIdentity identity;
  uint32_t rank = 0;
  std::vector<LayoutTensorSpec> tensors;
  std::string gpu_uuid;     // device tensors' GPU; empty: the rank's
  uint64_t generation = 0;  // 0: the current one
  double wait_seconds = 0;
};

// INVALID_ARGUMENT naming the rule broken: a key of 1..kMaxLayoutKeyBytes
// bytes of [A-Za-z0-9._:/+=-].
absl::Status ValidateLayoutKey(const std::string& key);
// INVALID_ARGUMENT naming the field: at most kMaxIdentityEntries entries,
// keys 1..kMaxIdentityKeyBytes of [A-Za-z0-9._-], values at most
// kMaxIdentityValueBytes of printable ASCII.
absl::Status ValidateLayoutIdentity(const LayoutIdentity& identity);
// The bytes tensor `spec` occupies: elements * bits / 8 when contiguous
// (whole bytes only, as the safetensors spec requires of packed dtypes);
// with strides, the span they reach: (1 + sum((shape[i] - 1) * strides[i]))
// elements, 0 when a dimension is 0. INVALID_ARGUMENT naming the tensor for
// more than kMaxLayoutDims dims, strides of another rank than the shape,
// strides on a sub-byte dtype, or a size over kMaxLayoutBytes (overflow
// included).
absl::StatusOr<uint64_t> LayoutTensorBytes(const LayoutTensorSpec& spec);
// Every check of a request but the model's and generation's (the
// registry's): key, identity, tensor count, names (non-empty, unique, at
// most kMaxLayoutTensorNameBytes), shapes and strides, total bytes,
// wait_seconds within [0, kMaxLayoutWaitSeconds].
absl::Status ValidateLayoutRequest(const LayoutRequest& request);

// One staged memfd and what it holds.
struct StagedLayoutSegment {
  std::shared_ptr<HostSegment> memory;
  Placement holds = Placement::kHost;  // kDevice: the device tensors' staging
};

struct StagedLayout {
  LayoutRequest request;  // tensors cleared: they are in `tensors`
  uint64_t generation = 0;
  DeviceInfo device;                 // for device tensors
  DeviceBackend* backend = nullptr;  // for device tensors; not owned
  std::vector<StagedLayoutSegment> segments;
  // In request order; record.segment indexes `segments`, content_hash 0.
  std::vector<LayoutTensor> tensors;
  uint64_t bytes_staged = 0;  // bytes of the staged memfds
  uint64_t device_bytes = 0;  // of those, the device staging's
  // The staged bytes promised by host memory admission, held until the
  // publish ends (the memfds' pages come into being only as the writer
  // writes, so a promise dropped at staging would let writers overcommit).
  HostMemoryAdmission::Reservation reservation;
};

// Stages `request` (ValidateLayoutRequest'ed by the caller) of
// `generation`. Device tensors need `backend` and `device` (the registry
// resolves the GPU). RESOURCE_EXHAUSTED when `admission` (may be null)
// cannot promise the staged host bytes or memfds cannot be made. Nothing is
// left behind on error.
absl::StatusOr<std::unique_ptr<StagedLayout>> StageLayout(LayoutRequest request, uint64_t generation,
                                                          const DeviceInfo& device, DeviceBackend* backend,
                                                          HostMemoryAdmission* admission);

// The outcome of one try at SealLayout: the layout, or why not and whether
// the staged memfds were sealed by then (a sealed publish can only be
// aborted; one refused before sealing may commit again).
struct LayoutCommitAttempt {
  absl::StatusOr<std::shared_ptr<Layout>> layout = absl::UnknownError("not attempted");
  bool sealed = false;
};

// Steps 1-5 above; the Layout is complete but for published_at and the
// caller's publication. `mlock` locks the sealed host memfd where
// RLIMIT_MEMLOCK allows.
LayoutCommitAttempt SealLayout(StagedLayout& staged, const std::map<std::string, std::string>& expected_hashes,
                               bool mlock);

// Gives the staged memfds' pages back (HostSegment::Discard) so that a
// writer still holding their fds keeps empty files; for a publish that ends
// without a commit.
void DiscardStagedLayout(StagedLayout& staged);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LAYOUT_LAYOUT_PUBLISH_H_
