// The CUDA device backends: "cuda-vmm" (VMM arenas exported as POSIX fds,
// --device-backend cuda) and
// "cuda-legacy-ipc" (cuMemAlloc arenas exported as cuIpcMemHandle bytes).
// This file holds what both share: GPUs enumerated by UUID, one retained
// primary context per GPU, pinned staging buffers and the factory. The arenas
// are in cuda_arena.cc (daemon side) and cuda_import.cc (client side).
#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/memory/cuda/cuda_internal.h"
#include "common/base/status.h"
#include "absl/synchronization/mutex.h"

namespace weightd {

std::string FormatGpuUuid(const CUuuid& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
                         b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

absl::StatusOr<std::shared_ptr<CudaContext>> CudaContext::Retain(const CudaDriver& driver, int ordinal) {
  const CudaFunctions& cu = driver.fn();
  CUdevice device = 0;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, DeviceGet, &device, ordinal));
  CUcontext context = nullptr;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, DevicePrimaryCtxRetain, &context, device));
  return std::shared_ptr<CudaContext>(new CudaContext(driver, ordinal, device, context));
}

CudaContext::~CudaContext() { cu().DevicePrimaryCtxRelease(device_); }

absl::StatusOr<ScopedContext> ScopedContext::Enter(const CudaContext& context) {
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(context.cu(), CtxPushCurrent, context.get()));
  return ScopedContext(&context.cu());
}

ScopedContext::ScopedContext(ScopedContext&& other) noexcept : cu_(std::exchange(other.cu_, nullptr)) {}

ScopedContext::~ScopedContext() {
  CUcontext popped = nullptr;
  if (cu_ != nullptr) cu_->CtxPopCurrent(&popped);
}

absl::Status CheckArenaRange(uint64_t size, uint64_t offset, uint64_t pitch, uint64_t width, uint64_t rows,
                             const char* what) {
  if (rows == 0 || width == 0) return absl::OkStatus();
  if (rows > 1 && pitch < width) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": pitch ", pitch, " is less than the row width ", width));
  }
  uint64_t end = 0;
  if (__builtin_mul_overflow(rows - 1, pitch, &end) || __builtin_add_overflow(end, width, &end) ||
      __builtin_add_overflow(end, offset, &end) || end > size) {
    return absl::OutOfRangeError(absl::StrCat(what, " of ", rows, " x ", width, " bytes at offset ", offset, " (pitch ",
                                              pitch, ") overruns a ", size, "-byte arena"));
  }
  return absl::OkStatus();
}

namespace {

struct CudaDevice {
  DeviceInfo info;
  bool vmm_fd_export = false;  // cuMemCreate + POSIX fd export supported
};

absl::StatusOr<CudaDevice> DescribeDevice(const CudaFunctions& cu, int ordinal) {
  CudaDevice d;
  CUdevice device = 0;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, DeviceGet, &device, ordinal));
  char name[256] = {};
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, DeviceGetName, name, sizeof(name) - 1, device));
  size_t total = 0;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, DeviceTotalMem, &total, device));
  CUuuid uuid = {};
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, DeviceGetUuid, &uuid, device));
  int vmm = 0, fd = 0;
  WEIGHTD_RETURN_IF_ERROR(
      WEIGHTD_CU(cu, DeviceGetAttribute, &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device));
  WEIGHTD_RETURN_IF_ERROR(
      WEIGHTD_CU(cu, DeviceGetAttribute, &fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device));
  d.info = DeviceInfo{ordinal, FormatGpuUuid(uuid), name, total};
  d.vmm_fd_export = vmm != 0 && fd != 0;
  return d;
}

// Every GPU this process sees (CUDA_VISIBLE_DEVICES applies), by ordinal.
absl::StatusOr<std::vector<CudaDevice>> EnumerateDevices(const CudaFunctions& cu) {
  int count = 0;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, DeviceGetCount, &count));
  std::vector<CudaDevice> devices;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<CudaDevice> d = DescribeDevice(cu, i);
    if (!d.ok()) return Annotate(d.status(), absl::StrCat("CUDA device ", i));
    devices.push_back(std::move(*d));
  }
  return devices;
}

std::string Describe(const std::vector<CudaDevice>& devices) {
  std::vector<DeviceInfo> infos;
  for (const CudaDevice& d : devices) infos.push_back(d.info);
  return DeviceList(infos, /*with_names=*/true);
}

class CudaPinnedBuffer final : public PinnedBuffer {
 public:
  CudaPinnedBuffer(std::shared_ptr<CudaContext> context, char* data, uint64_t size)
      : context_(std::move(context)), data_(data), size_(size) {}
  ~CudaPinnedBuffer() override {
    absl::StatusOr<ScopedContext> scope = ScopedContext::Enter(*context_);
    if (scope.ok()) context_->cu().MemFreeHost(data_);
  }
  char* data() override { return data_; }
  uint64_t size() const override { return size_; }

 private:
  std::shared_ptr<CudaContext> context_;
  char* data_;
  uint64_t size_;
};

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend(const CudaDriver& driver, bool legacy_ipc, std::vector<CudaDevice> devices)
      : driver_(driver), legacy_ipc_(legacy_ipc), devices_(std::move(devices)) {}

  SegmentBackend segment_backend() const override {
    return legacy_ipc_ ? SegmentBackend::kCudaLegacyIpc : SegmentBackend::kCudaVmm;
  }

  absl::StatusOr<std::vector<DeviceInfo>> Devices() override {
    std::vector<DeviceInfo> out;
    for (const CudaDevice& d : devices_) out.push_back(d.info);
    return out;
  }

  absl::StatusOr<std::unique_ptr<DeviceArena>> Allocate(const DeviceInfo& device, uint64_t size) override {
    WEIGHTD_ASSIGN_OR_RETURN(const CudaDevice* d, Find(device));
    if (!legacy_ipc_ && !d->vmm_fd_export) {
      return absl::FailedPreconditionError(absl::StrCat("GPU ", d->info.uuid, " (", d->info.name,
                                                        ") cannot export CUDA VMM memory as a POSIX fd; "
                                                        "use --device-backend cuda-legacy-ipc"));
    }
    WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<CudaContext> context, Context(d->info.ordinal));
    return legacy_ipc_ ? AllocateLegacyArena(std::move(context), d->info, size)
                       : AllocateVmmArena(std::move(context), d->info, size);
  }

  // VMM arenas only: legacy IPC memory dies with the process that allocated it.
  absl::StatusOr<std::unique_ptr<DeviceArena>> Adopt(const DeviceInfo& device, ScopedFd fd, uint64_t size) override {
    if (legacy_ipc_) return DeviceBackend::Adopt(device, std::move(fd), size);
    WEIGHTD_ASSIGN_OR_RETURN(const CudaDevice* d, Find(device));
    WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<CudaContext> context, Context(d->info.ordinal));
    return AdoptVmmArena(std::move(context), d->info, std::move(fd), size);
  }

  absl::StatusOr<std::unique_ptr<PinnedBuffer>> AllocatePinned(uint64_t size) override {
    // Portable: pinned for every context, so one staging ring feeds all GPUs.
    WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<CudaContext> context, AnyContext());
    WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context));
    void* data = nullptr;
    absl::Status s = WEIGHTD_CU(context->cu(), MemHostAlloc, &data, std::max<uint64_t>(size, 1), CU_MEMHOSTALLOC_PORTABLE);
    if (!s.ok()) return Annotate(s, absl::StrCat("pinned staging buffer of ", size, " bytes"));
    return std::make_unique<CudaPinnedBuffer>(std::move(context), static_cast<char*>(data), size);
  }

  absl::StatusOr<std::unique_ptr<ImportedArena>> Import(ArenaExport exported) override {
    absl::StatusOr<SegmentBackend> kind = ParseSegmentBackend(exported.backend);
    if (!exported.backend.empty() && (!kind.ok() || *kind != segment_backend())) {
      return absl::InvalidArgumentError(
          absl::StrCat("a '", exported.backend, "' arena cannot be imported by the ", name(), " backend"));
    }
    WEIGHTD_RETURN_IF_ERROR(CheckCopyOnWrite(segment_backend(), exported));
    WEIGHTD_ASSIGN_OR_RETURN(const CudaDevice* d, FindUuid(exported.gpu_uuid));
    WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<CudaContext> context, Context(d->info.ordinal));
    return legacy_ipc_ ? ImportLegacyArena(std::move(context), std::move(exported))
                       : ImportVmmArena(std::move(context), std::move(exported));
  }

 private:
  absl::StatusOr<const CudaDevice*> FindUuid(const std::string& uuid) const {
    for (const CudaDevice& d : devices_) {
      if (absl::EqualsIgnoreCase(d.info.uuid, uuid)) return &d;
    }
    return absl::NotFoundError(absl::StrCat("GPU ", uuid, " is not visible to this process (visible: ", Describe(devices_),
                                            "; check CUDA_VISIBLE_DEVICES)"));
  }

  // By UUID when given (ordinals differ between processes), else by ordinal.
  absl::StatusOr<const CudaDevice*> Find(const DeviceInfo& device) const {
    if (!device.uuid.empty()) return FindUuid(device.uuid);
    if (device.ordinal >= 0 && device.ordinal < static_cast<int>(devices_.size())) return &devices_[device.ordinal];
    return absl::NotFoundError(absl::StrCat("no CUDA device with ordinal ", device.ordinal, " (visible: ",
                                            Describe(devices_), ")"));
  }

  absl::StatusOr<std::shared_ptr<CudaContext>> Context(int ordinal) {
    absl::MutexLock lock(&mu_);
    auto it = contexts_.find(ordinal);
    if (it != contexts_.end()) return it->second;
    absl::StatusOr<std::shared_ptr<CudaContext>> retained = CudaContext::Retain(driver_, ordinal);
    if (!retained.ok()) return Annotate(retained.status(), devices_[ordinal].info.uuid);
    contexts_[ordinal] = *retained;
    return *retained;
  }

  // A context already in use, so that pinned memory does not create one on a
  // GPU this process otherwise leaves alone; the first GPU's when none is.
  absl::StatusOr<std::shared_ptr<CudaContext>> AnyContext() {
    {
      absl::MutexLock lock(&mu_);
      if (!contexts_.empty()) return contexts_.begin()->second;
    }
    return Context(devices_.front().info.ordinal);
  }

  const CudaDriver& driver_;
  const bool legacy_ipc_;
  const std::vector<CudaDevice> devices_;
  absl::Mutex mu_;
  std::map<int, std::shared_ptr<CudaContext>> contexts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(bool legacy_ipc) {
  WEIGHTD_ASSIGN_OR_RETURN(CudaDriver * driver, CudaDriver::Load());
  WEIGHTD_ASSIGN_OR_RETURN(std::vector<CudaDevice> devices, EnumerateDevices(driver->fn()));
  if (devices.empty()) {
    return absl::UnavailableError(absl::StrCat("no CUDA device: driver ", driver->version(), " reports 0 GPUs"));
  }
  if (!legacy_ipc && std::none_of(devices.begin(), devices.end(), [](const CudaDevice& d) { return d.vmm_fd_export; })) {
    return absl::UnavailableError(absl::StrCat("no CUDA device can export VMM memory as a POSIX fd (",
                                               Describe(devices), "); use --device-backend cuda-legacy-ipc"));
  }
  return std::make_unique<CudaBackend>(*driver, legacy_ipc, std::move(devices));
}

}  // namespace weightd
