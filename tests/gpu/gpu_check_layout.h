// The runtime-layout rows of the GPU checks (docs/api.md "Runtime layouts"):
// a layout with one DEVICE tensor and one HOST tensor is published on rank 0
// of a model that run_gpu_checks.sh loaded onto GPU 0 (the daemon seals and
// hashes the staged memfd, then copies the device tensor into an arena it
// allocated with cuMemCreate), attached back through the client library
// (the arena imported like a checkpoint's), read back with cuMemcpyDtoH and
// compared with what was written, then dropped. The rows give the commit's
// seconds and GB/s for the device bytes, and the attach time.
#ifndef WEIGHTD_TESTS_GPU_GPU_CHECK_LAYOUT_H_
#define WEIGHTD_TESTS_GPU_GPU_CHECK_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tests/gpu/gpu_check_pin.h"

namespace weightd {
class CudaContext;
}

namespace weightd::gpu_checks {

// Publishes `device_bytes` bytes as the device tensor on `model`'s rank 0
// at `socket`; reads run in `context` (GPU 0's primary context).
std::vector<Row> CheckLayout(const std::string& socket, const std::string& model, uint64_t device_bytes,
                             const CudaContext& context);

}  // namespace weightd::gpu_checks

#endif  // WEIGHTD_TESTS_GPU_GPU_CHECK_LAYOUT_H_
