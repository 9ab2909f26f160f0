// MakeCudaBackend for builds without the CUDA toolkit.
#include "common/memory/device.h"

namespace weightd {

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(bool) {
  return absl::UnimplementedError("weightd was built without the CUDA toolkit; the cuda backends are unavailable");
}

}  // namespace weightd
