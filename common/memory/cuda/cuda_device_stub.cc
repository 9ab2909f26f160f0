// MakeCudaBackend and MakeCudaHostRegistrar for builds without the CUDA toolkit.
#include "common/memory/device.h"
#include "common/memory/host_registrar.h"

namespace weightd {

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(bool) {
  return absl::UnimplementedError("weightd was built without the CUDA toolkit; the cuda backends are unavailable");
}

absl::StatusOr<std::unique_ptr<HostRegistrar>> MakeCudaHostRegistrar(int) {
  return absl::UnimplementedError("weightd was built without the CUDA toolkit; host tensors cannot be pinned for GPUs");
}

}  // namespace weightd
