#include "tests/gpu/gpu_check_layout.h"

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

constexpr const char* kKey = "gpu-check/layout";
constexpr uint64_t kHostBytes = kMiB;

char Pattern(uint64_t i, char salt) { return static_cast<char>((i * 131 + (i >> 12) + salt) & 0xff); }

// Whether the `n` bytes at device pointer `device` equal Pattern(salt).
absl::StatusOr<bool> DeviceBytesMatch(const CudaContext& context, const void* device, uint64_t n, char salt) {
  WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(context));
  std::vector<char> back(n);
  WEIGHTD_RETURN_IF_ERROR(
      WEIGHTD_CU(context.cu(), MemcpyDtoH, back.data(), reinterpret_cast<CUdeviceptr>(device), n));
  for (uint64_t i = 0; i < n; ++i) {
    if (back[i] != Pattern(i, salt)) return false;
  }
  return true;
}

}  // namespace

std::vector<Row> CheckLayout(const std::string& socket, const std::string& model, uint64_t device_bytes,
                             const CudaContext& context) {
  const std::string check = "runtime layout: publish (seal + hash a staged memfd, daemon H2D into its own arena)";
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(socket);
  if (!client.ok()) return {{check, "FAIL", "", client.status().ToString()}};
  LayoutOptions options;
  options.model = model;
  options.key = kKey;
  options.identity = {{"check", "gpu"}};
  options.tensors = {{"fused.weight", "U8", {device_bytes}, {}, Location::kDevice},
                     {"table", "U8", {kHostBytes}, {}, Location::kHost}};
  absl::StatusOr<LayoutWriter> writer = (*client)->BeginLayout(options);
  if (!writer.ok()) return {{check, "FAIL", "", writer.status().ToString()}};
  for (WritableTensor& t : const_cast<std::vector<WritableTensor>&>(writer->tensors())) {
    char salt = t.info.name == "table" ? 7 : 3;
    for (uint64_t i = 0; i < t.info.nbytes; ++i) t.data[i] = Pattern(i, salt);
  }
  Clock::time_point start = Clock::now();
  absl::StatusOr<LayoutCommitInfo> committed = writer->Commit();
  double commit_ms = MillisecondsSince(start);
  if (!committed.ok()) return {{check, "FAIL", "", committed.status().ToString()}};
  std::vector<Row> rows;
  rows.push_back({check, "PASS",
                  absl::StrFormat("%.3f s (%.2f GB/s)", committed->seconds,
                                  committed->seconds > 0 ? device_bytes / committed->seconds / 1e9 : 0),
                  absl::StrFormat("%s on the GPU + %s on the host; daemon seconds %.3f, client round trip %.1f ms",
                                  absl::StrFormat("%.0f MiB", device_bytes / double(kMiB)),
                                  absl::StrFormat("%.0f MiB", kHostBytes / double(kMiB)), committed->seconds,
                                  commit_ms)});
  const std::string read = "runtime layout: attach, read the device tensor back (cuMemcpyDtoH)";
  AttachOptions attach;
  attach.layout = kKey;
  attach.identity = options.identity;
  start = Clock::now();
  absl::StatusOr<MappedModel> attached = (*client)->Attach(model, 0, attach);
  double attach_ms = MillisecondsSince(start);
  if (!attached.ok()) {
    rows.push_back({read, "FAIL", "", attached.status().ToString()});
  } else {
    const TensorView* device = attached->Find("fused.weight");
    const TensorView* host = attached->Find("table");
    absl::StatusOr<bool> equal = device == nullptr ? absl::StatusOr<bool>(absl::NotFoundError("no fused.weight"))
                                                   : DeviceBytesMatch(context, device->data, device->nbytes, 3);
    bool host_equal = host != nullptr && host->location == Location::kHost;
    for (uint64_t i = 0; host_equal && i < host->nbytes; ++i) {
      host_equal = static_cast<const char*>(host->data)[i] == Pattern(i, 7);
    }
    if (!equal.ok()) {
      rows.push_back({read, "FAIL", "", equal.status().ToString()});
    } else {
      rows.push_back({read, *equal && host_equal ? "PASS" : "FAIL", absl::StrFormat("attach %.1f ms", attach_ms),
                      absl::StrFormat("device tensor on %s %s what the writer wrote; host tensor %s",
                                      device->gpu_uuid, *equal ? "equals" : "DIFFERS from",
                                      host_equal ? "equals it too" : "DIFFERS")});
    }
  }
  if (attached.ok()) MappedModel detached = std::move(*attached);  // unmaps, ends the lease
  absl::StatusOr<uint32_t> dropped = (*client)->DropLayout(model, kKey);
  if (!dropped.ok()) rows.push_back({"runtime layout: drop", "FAIL", "", dropped.status().ToString()});
  return rows;
}

}  // namespace weightd::gpu_checks
