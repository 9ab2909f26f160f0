#include "tests/gpu/gpu_check_pin.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status.h"
#include "common/memory/cuda/cuda_internal.h"
#include "tests/gpu/gpu_check_protocol.h"
#include "weightd/client.h"

namespace weightd::gpu_checks {
namespace {

using Clock = std::chrono::steady_clock;

std::string GiB(uint64_t bytes) { return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / kGiB); }

struct Pinned {
  const TensorView* view;
  uint64_t device;
};

// Copies every pinned tensor from its device pointer into one device buffer
// (one stream, synchronised per pass), twice; the faster pass's seconds.
absl::StatusOr<double> TimeGpuReads(const CudaContext& context, const std::vector<Pinned>& pinned, uint64_t largest) {
  const CudaFunctions& cu = context.cu();
  WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(context));
  CUdeviceptr dst = 0;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemAlloc, &dst, largest));
  CUstream stream = nullptr;
  absl::Status s = WEIGHTD_CU(cu, StreamCreate, &stream, CU_STREAM_NON_BLOCKING);
  double best = 0;
  for (int pass = 0; s.ok() && pass < 2; ++pass) {
    Clock::time_point start = Clock::now();
    for (const Pinned& p : pinned) {
      if (s.ok()) s = WEIGHTD_CU(cu, MemcpyDtoDAsync, dst, p.device, p.view->nbytes, stream);
    }
    if (s.ok()) s = WEIGHTD_CU(cu, StreamSynchronize, stream);
    double seconds = MillisecondsSince(start) / 1e3;
    best = pass == 0 ? seconds : std::min(best, seconds);
  }
  if (stream != nullptr) cu.StreamDestroy(stream);
  cu.MemFree(dst);
  if (!s.ok()) return s;
  return best;
}

// The first MiB of `p` read through its device pointer equals the host view.
absl::StatusOr<bool> ReadBackMatches(const CudaContext& context, const Pinned& p) {
  WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(context));
  std::vector<char> back(std::min<uint64_t>(kMiB, p.view->nbytes));
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(context.cu(), MemcpyDtoH, back.data(), p.device, back.size()));
  return std::memcmp(back.data(), p.view->data, back.size()) == 0;
}

}  // namespace

std::vector<Row> CheckPinnedTable(const std::string& socket, const std::string& model, const CudaContext& context) {
  const std::string check = "attach --pin: register the host table (client path, 1 GiB chunks)";
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(socket);
  if (!client.ok()) return {{check, "FAIL", "", client.status().ToString()}};
  AttachOptions options;
  options.pin = PinOptions::AllHostTensors();
  Clock::time_point start = Clock::now();
  absl::StatusOr<MappedModel> attached = (*client)->Attach(model, 0, options);
  double attach_ms = MillisecondsSince(start);
  if (!attached.ok()) return {{check, "FAIL", "", attached.status().ToString()}};
  PinStatus at_return = attached->pin_status();
  absl::Status ready = attached->WaitPinned(absl::Minutes(10));
  PinStatus pin = attached->pin_status();
  if (!ready.ok()) return {{check, "FAIL", "", ready.ToString()}};
  std::vector<Row> rows;
  double gb = pin.bytes_total / 1e9;
  rows.push_back({check, "PASS", absl::StrFormat("%.3f s/GB", gb > 0 ? pin.register_seconds / gb : 0),
                  absl::StrFormat("%s of %d tensors in %d cuMemHostRegister calls (%s), %.3f s inside them; READY "
                                  "%.3f s after the attach began (driver load included)",
                                  GiB(pin.bytes_total), pin.tensors, pin.chunks_total,
                                  pin.read_only ? "DEVICEMAP|PORTABLE|READ_ONLY"
                                                : "DEVICEMAP|PORTABLE; the GPU lacks READ_ONLY_HOST_REGISTER_SUPPORTED",
                                  pin.register_seconds, pin.seconds)});
  rows.push_back({"attach --pin returns before the registration", at_return.state == "READY" ? "WARN" : "PASS",
                  absl::StrFormat("attach %.1f ms", attach_ms),
                  absl::StrFormat("pinning was %s with %s of %s registered when Attach returned", at_return.state,
                                  GiB(at_return.bytes_done), GiB(pin.bytes_total))});

  std::vector<Pinned> pinned;
  uint64_t bytes = 0, largest = 0;
  for (const TensorView& v : attached->tensors()) {
    uint64_t device = attached->device_ptr(v);
    if (device == 0) continue;
    pinned.push_back({&v, device});
    bytes += v.nbytes;
    largest = std::max(largest, v.nbytes);
  }
  const std::string read_check = "GPU read from the pinned table (cuMemcpyDtoDAsync device_ptr -> device memory)";
  if (pinned.empty()) {
    rows.push_back({read_check, "FAIL", "", "no pinned tensor has a device pointer"});
  } else {
    auto by_size = [](const Pinned& a, const Pinned& b) { return a.view->nbytes < b.view->nbytes; };
    const Pinned& biggest = *std::max_element(pinned.begin(), pinned.end(), by_size);
    absl::StatusOr<bool> equal = ReadBackMatches(context, biggest);
    absl::StatusOr<double> seconds = TimeGpuReads(context, pinned, largest);
    if (!equal.ok() || !seconds.ok()) {
      rows.push_back({read_check, "FAIL", "", (!equal.ok() ? equal.status() : seconds.status()).ToString()});
    } else {
      rows.push_back({read_check, *equal ? "PASS" : "FAIL", absl::StrFormat("%.2f GB/s", bytes / *seconds / 1e9),
                      absl::StrFormat("%zu tensors, %s, best of 2 passes; the first MiB of '%s' read back through "
                                      "its device pointer %s the host mapping",
                                      pinned.size(), GiB(bytes), biggest.view->info->name,
                                      *equal ? "equals" : "DIFFERS from")});
    }
  }
  start = Clock::now();
  { MappedModel detached = std::move(*attached); }  // unpins (cuCtxSynchronize + cuMemHostUnregister), unmaps
  rows.push_back({"detach unregisters the pinned table", "info", absl::StrFormat("%.1f ms", MillisecondsSince(start)),
                  absl::StrFormat("%d cuMemHostUnregister calls, then unmap and lease end", pin.chunks_total)});
  return rows;
}

}  // namespace weightd::gpu_checks
