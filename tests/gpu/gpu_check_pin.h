// The pinned-host-table rows of the GPU checks: a host-resident model that
// run_gpu_checks.sh loaded into a running daemon is attached through the
// client library with AttachOptions::pin (every host tensor), and the rows
// say how long registration took per GB, whether the attach returned before
// it, how fast the GPU reads the pinned table through the device pointers
// (cuMemcpyDtoDAsync from device_ptr into device memory, best of two), that
// those reads return the table's bytes, and how long the detach's
// unregistration takes.
#ifndef WEIGHTD_TESTS_GPU_GPU_CHECK_PIN_H_
#define WEIGHTD_TESTS_GPU_GPU_CHECK_PIN_H_

#include <array>
#include <string>
#include <vector>

namespace weightd {
class CudaContext;
}

namespace weightd::gpu_checks {

// (check, result, value, detail), as the table prints them.
using Row = std::array<std::string, 4>;

// Attaches rank 0 of `model` on the daemon at `socket`; copies run in
// `context` (GPU 0's primary context, the one the client registers with).
std::vector<Row> CheckPinnedTable(const std::string& socket, const std::string& model, const CudaContext& context);

}  // namespace weightd::gpu_checks

#endif  // WEIGHTD_TESTS_GPU_GPU_CHECK_PIN_H_
