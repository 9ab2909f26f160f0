// Device memory behind one small interface, chosen at run time
// (--device-backend): CUDA VMM (cuMemCreate + POSIX fd export), legacy CUDA
// IPC (cudaIpcGetMemHandle), or an emulated backend whose "device memory" is
// a memfd, so machines without a GPU run the whole device path end to end.
// No CUDA header appears outside the CUDA implementation file.
//
// Daemon side: DeviceBackend::Allocate() gives a DeviceArena (one allocation
// on one GPU) that the load pipeline fills with asynchronous copies from
// pinned staging buffers, then Seal()s and exports.
// Client side: DeviceBackend::Import() maps an exported arena in another
// process and gives its device pointer.
//
// Thread-safety: a DeviceBackend may be used from any thread. A DeviceArena
// is filled by one thread at a time (the loader serialises per arena); an
// ImportedArena is immutable.
#ifndef WEIGHTD_COMMON_MEMORY_DEVICE_H_
#define WEIGHTD_COMMON_MEMORY_DEVICE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/scoped_fd.h"
#include "common/memory/segment_backend.h"

namespace weightd {

struct DeviceInfo {
  int ordinal = -1;        // this process's ordinal (CUDA_VISIBLE_DEVICES applies)
  std::string uuid;        // "GPU-8f3c..." (CUDA) or "GPU-emulated-<n>"
  std::string name;        // "NVIDIA H200", "emulated"
  uint64_t total_bytes = 0;
};

// One allocation on one device, owned by the daemon.
class DeviceArena {
 public:
  virtual ~DeviceArena() = default;
  virtual uint64_t size() const = 0;
  virtual const DeviceInfo& device() const = 0;
  // Enqueues a copy of `rows` rows of `width` bytes from host `src` (rows
  // `src_pitch` bytes apart) to arena byte `dst_offset` (rows `dst_pitch`
  // apart); rows == 1 is a plain copy. `src` must stay valid and unchanged
  // until a fence recorded after this call has completed. Bounds-checked.
  virtual absl::Status CopyFromHost(uint64_t dst_offset, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                                    uint64_t width, uint64_t rows) = 0;
  // A token for every copy enqueued so far; WaitFence blocks until they are done.
  virtual absl::StatusOr<uint64_t> RecordFence() = 0;
  virtual absl::Status WaitFence(uint64_t fence) = 0;
  // Copies arena bytes back to host memory (synchronous; for verification).
  virtual absl::Status CopyToHost(uint64_t offset, void* dst, uint64_t n) = 0;
  // After the last copy: makes the arena immutable where the backend can and
  // prepares the export. Idempotent.
  virtual absl::Status Seal() = 0;
  // The fd sent over SCM_RIGHTS (owned by the arena), or -1 when the backend
  // exports by handle bytes instead.
  virtual int export_fd() const = 0;
  // Handle bytes carried in the Attach response (cudaIpcMemHandle_t for
  // cuda-legacy-ipc), or empty.
  virtual std::string export_handle() const = 0;
};

// Host memory the device can copy from at full speed (cudaHostAlloc'd, or
// plain page-aligned memory for the emulated backend). Owns its memory.
class PinnedBuffer {
 public:
  virtual ~PinnedBuffer() = default;
  virtual char* data() = 0;
  virtual uint64_t size() const = 0;
};

// What a client needs to import an arena: from the Attach response, plus the
// fd received on the fd socket (invalid for handle-exported backends).
struct ArenaExport {
  std::string backend;  // a SegmentBackendName (or "cuda", from older daemons)
  std::string gpu_uuid;
  uint64_t size = 0;
  std::string handle;
  ScopedFd fd;
  // Map copy-on-write: reads share the exporter's memory, writes go to pages
  // private to this process. Backends whose memory has no private pages
  // (CUDA) refuse with FAILED_PRECONDITION.
  bool copy_on_write = false;
};

// An exported arena mapped into this (client) process. Unmaps on
// destruction; the CUDA imports first wait for all work queued in this
// process's primary context on the device (cuCtxSynchronize, as cudaFree
// does), since unmapping does not wait for kernels still reading the arena.
class ImportedArena {
 public:
  virtual ~ImportedArena() = default;
  virtual const void* device_pointer() const = 0;  // CUdeviceptr as a pointer, or host address (emulated)
  virtual int device_ordinal() const = 0;          // this process's ordinal for the arena's GPU
  virtual uint64_t size() const = 0;
  // Whether the mapping is read-only (CUDA VMM: CU_MEM_ACCESS_FLAGS_PROT_READ
  // set and reported back by cuMemGetAccess; whether the GPU enforces it is
  // what tests/gpu's write check shows).
  virtual bool read_only() const = 0;
  // Copies device bytes to host memory (synchronous).
  virtual absl::Status CopyToHost(uint64_t offset, void* dst, uint64_t n) const = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // The kind of segment this backend's arenas are: kCudaVmm (selected with
  // --device-backend cuda), kCudaLegacyIpc or kEmulated.
  virtual SegmentBackend segment_backend() const = 0;
  // Its wire name: "cuda-vmm", "cuda-legacy-ipc", "emulated".
  std::string name() const { return std::string(SegmentBackendName(segment_backend())); }
  // The backend's GPUs. UNAVAILABLE when none can be used.
  virtual absl::StatusOr<std::vector<DeviceInfo>> Devices() = 0;
  // A zero-filled arena of `size` bytes on `device` (RESOURCE_EXHAUSTED when
  // the device has no room). Sizes are rounded up to the backend's granularity.
  virtual absl::StatusOr<std::unique_ptr<DeviceArena>> Allocate(const DeviceInfo& device, uint64_t size) = 0;
  virtual absl::StatusOr<std::unique_ptr<PinnedBuffer>> AllocatePinned(uint64_t size) = 0;
  virtual absl::StatusOr<std::unique_ptr<ImportedArena>> Import(ArenaExport exported) = 0;
  // Daemon side, after a restart: takes over an arena of `size` bytes on
  // `device` that this backend exported as `fd` in an earlier daemon process
  // (kept by the fd store, server/restart/fd_store.h). The result is sealed and
  // exports the same fd. Errors: FAILED_PRECONDITION when the fd is not such
  // an arena (size, seals); UNIMPLEMENTED for backends that cannot adopt
  // (the default; cuda-legacy-ipc memory dies with its process).
  virtual absl::StatusOr<std::unique_ptr<DeviceArena>> Adopt(const DeviceInfo& device, ScopedFd fd, uint64_t size);
};

// "0=GPU-8f3c..., 1=GPU-..." for logs and messages; `with_names` adds each
// device's name: "0=GPU-8f3c... (NVIDIA H200)".
std::string DeviceList(const std::vector<DeviceInfo>& devices, bool with_names = false);

// The backend for --device-backend NAME: "auto" picks "cuda" when the CUDA
// driver loads and reports a GPU, else returns nullptr (host only);
// "none" returns nullptr; "emulated" always works. `chosen` receives one
// human-readable line saying what was found and chosen, for the log.
absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeDeviceBackend(const std::string& name, std::string* chosen);

// The emulated backend with `device_count` devices "GPU-emulated-<i>".
std::unique_ptr<DeviceBackend> MakeEmulatedBackend(int device_count = 8);

// CUDA backends (common/cuda_device.cc; only when built with the CUDA
// toolkit, else UNIMPLEMENTED). Every driver symbol is resolved at run time.
absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(bool legacy_ipc);

// The backend able to import segments of `backend_name` (a wire name, see
// ParseSegmentBackend) in a client process. Owned by this module; lives for
// the process. INVALID_ARGUMENT for names that are no device backend.
absl::StatusOr<DeviceBackend*> ClientBackendFor(const std::string& backend_name);

// OK when `exported` does not ask for copy_on_write or its backend can map
// privately (emulated arenas are memfds); else FAILED_PRECONDITION naming
// the backend and GPU. Each backend's Import() applies it.
absl::Status CheckCopyOnWrite(SegmentBackend backend, const ArenaExport& exported);

// Client side: imports `exported` with ClientBackendFor(exported.backend),
// refusing a copy-on-write import that the backend cannot do before any
// driver is loaded. Errors as ClientBackendFor and DeviceBackend::Import.
absl::StatusOr<std::unique_ptr<ImportedArena>> ImportArena(ArenaExport exported);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_MEMORY_DEVICE_H_
