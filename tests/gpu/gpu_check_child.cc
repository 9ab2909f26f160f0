// The importing side of the GPU checks: a separate process (exec'ed, never
// just forked: CUDA does not survive fork) that imports the parent's arenas
// through the weightd client path (MakeCudaBackend + Import), verifies their
// bytes, times the mapping, and on request writes into an imported mapping.
#include <unistd.h>

#include <memory>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/memory/cuda/cuda_internal.h"
#include "common/memory/device.h"
#include "common/transport/unix_socket.h"
#include "tests/gpu/gpu_check_protocol.h"

namespace weightd::gpu_checks {
namespace {

using Clock = std::chrono::steady_clock;

std::string ResultName(const CudaFunctions& cu, CUresult r) {
  const char* name = nullptr;
  if (cu.GetErrorName(r, &name) == CUDA_SUCCESS && name != nullptr) return name;
  return absl::StrCat("CUresult_", static_cast<int>(r));
}

// Verifies `spec` ("full", "ends" or "none") of the imported arena; returns
// the bytes verified or the first mismatch as an error.
absl::StatusOr<uint64_t> Verify(const ImportedArena& arena, const std::string& spec, uint64_t seed) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // offset, length
  if (spec == "full") {
    for (uint64_t off = 0; off < arena.size(); off += 64 * kMiB) ranges.push_back({off, std::min(64 * kMiB, arena.size() - off)});
  } else if (spec == "ends") {
    ranges.push_back({0, std::min(kEndBytes, arena.size())});
    if (arena.size() >= 2 * kEndBytes) ranges.push_back({arena.size() - kEndBytes, kEndBytes});
  }
  std::vector<char> host;
  uint64_t verified = 0;
  for (auto [offset, n] : ranges) {
    host.resize(n);
    absl::Status s = arena.CopyToHost(offset, host.data(), n);
    if (!s.ok()) return s;
    int64_t bad = FindMismatch(host.data(), offset, n, seed);
    if (bad >= 0) return absl::DataLossError(absl::StrCat("byte ", bad, " differs from what the exporter wrote"));
    verified += n;
  }
  return verified;
}

// Writes 1 MiB into the imported mapping with a raw cuMemsetD8 and waits;
// the context may be unusable afterwards (a write fault is sticky).
std::string WriteIntoMapping(const ImportedArena& arena) {
  absl::StatusOr<CudaDriver*> driver = CudaDriver::Load();
  if (!driver.ok()) return "memset=not_run";
  absl::StatusOr<std::shared_ptr<CudaContext>> context = CudaContext::Retain(**driver, arena.device_ordinal());
  if (!context.ok()) return "memset=not_run";
  absl::StatusOr<ScopedContext> scope = ScopedContext::Enter(**context);
  if (!scope.ok()) return "memset=not_run";
  const CudaFunctions& cu = (*driver)->fn();
  auto ptr = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(arena.device_pointer()));
  CUresult memset = cu.MemsetD8(ptr, 0xA5, std::min<uint64_t>(kMiB, arena.size()));
  CUresult sync = cu.CtxSynchronize();
  return absl::StrCat("memset=", ResultName(cu, memset), " sync=", ResultName(cu, sync));
}

// Queues 16 device-to-device copies that read the whole imported arena
// (several milliseconds of GPU work), then drops the import at once, as a
// framework's DLPack deleter may: the import must wait for the copies before
// unmapping. Reports the copies' outcome, the last copy's bytes verified
// (the arena's ends) and how long the drop took.
std::string DropWhileBusy(std::unique_ptr<ImportedArena>* arena, uint64_t seed) {
  absl::StatusOr<CudaDriver*> driver = CudaDriver::Load();
  if (!driver.ok()) return absl::StrCat("busy_error=", driver.status().code());
  absl::StatusOr<std::shared_ptr<CudaContext>> context = CudaContext::Retain(**driver, (*arena)->device_ordinal());
  if (!context.ok()) return "busy_error=context";
  absl::StatusOr<ScopedContext> scope = ScopedContext::Enter(**context);
  if (!scope.ok()) return "busy_error=context";
  const CudaFunctions& cu = (*driver)->fn();
  const uint64_t size = (*arena)->size();
  auto src = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>((*arena)->device_pointer()));
  CUdeviceptr local = 0;
  CUstream stream = nullptr;
  if (cu.MemAlloc(&local, size) != CUDA_SUCCESS) return "busy_error=cuMemAlloc";
  if (cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
    cu.MemFree(local);
    return "busy_error=cuStreamCreate";
  }
  CUresult queued = CUDA_SUCCESS;
  for (int i = 0; i < 16 && queued == CUDA_SUCCESS; ++i) queued = cu.MemcpyDtoDAsync(local, src, size, stream);
  Clock::time_point start = Clock::now();
  arena->reset();
  double drop_ms = MillisecondsSince(start);
  CUresult sync = cu.StreamSynchronize(stream);
  uint64_t verified = 0;
  std::vector<char> host(std::min(kEndBytes, size));
  for (uint64_t offset : {uint64_t{0}, size - host.size()}) {
    if (sync == CUDA_SUCCESS && cu.MemcpyDtoH(host.data(), local + offset, host.size()) == CUDA_SUCCESS &&
        FindMismatch(host.data(), offset, host.size(), seed) < 0) {
      verified += host.size();
    }
  }
  cu.StreamDestroy(stream);
  cu.MemFree(local);
  return absl::StrFormat("busy_queued=%s busy_sync=%s busy_verified=%d drop_ms=%.3f", ResultName(cu, queued),
                         ResultName(cu, sync), verified, drop_ms);
}

class Child {
 public:
  explicit Child(int sock) : sock_(sock) {}

  // Loads the driver and creates device 0's primary context, so that import
  // times do not include them; reports what that first use cost (what a
  // restarted rank pays before its first import).
  std::string Hello() {
    Clock::time_point start = Clock::now();
    absl::StatusOr<CudaDriver*> driver = CudaDriver::Load();
    if (!driver.ok()) return absl::StrCat("error ", driver.status().ToString());
    absl::StatusOr<std::shared_ptr<CudaContext>> context = CudaContext::Retain(**driver, 0);
    if (!context.ok()) return absl::StrCat("error ", context.status().ToString());
    warm_ = *context;  // cuDevicePrimaryCtxRetain created it; keep it alive
    return absl::StrFormat("ok startup_ms=%.1f pid=%d", MillisecondsSince(start), getpid());
  }

  // Returns the reply, and whether the child must exit after sending it.
  std::pair<std::string, bool> Import(const Message& m, std::vector<ScopedFd> fds) {
    ArenaExport exported;
    exported.backend = m.Get("backend");
    exported.gpu_uuid = m.Get("uuid");
    uint64_t seed = 0;
    if (!absl::SimpleAtoi(m.Get("size"), &exported.size) || !absl::SimpleAtoi(m.Get("seed"), &seed)) {
      return {"error bad size or seed", false};
    }
    if (!m.Get("handle").empty()) exported.handle = absl::HexStringToBytes(m.Get("handle"));
    if (!fds.empty()) exported.fd = std::move(fds.front());
    absl::StatusOr<DeviceBackend*> backend = ClientBackendFor(exported.backend);
    if (!backend.ok()) return {absl::StrCat("error ", backend.status().ToString()), false};

    Clock::time_point start = Clock::now();
    absl::StatusOr<std::unique_ptr<ImportedArena>> arena = (*backend)->Import(std::move(exported));
    double import_ms = MillisecondsSince(start);
    if (!arena.ok()) return {absl::StrCat("error ", arena.status().ToString()), false};
    start = Clock::now();
    absl::StatusOr<uint64_t> verified = Verify(**arena, m.Get("verify"), seed);
    double verify_ms = MillisecondsSince(start);
    if (!verified.ok()) return {absl::StrCat("error verify: ", verified.status().ToString()), false};
    std::string reply = absl::StrFormat("ok import_ms=%.3f verify_ms=%.1f verified=%d read_only=%d ordinal=%d", import_ms,
                                        verify_ms, *verified, (*arena)->read_only() ? 1 : 0, (*arena)->device_ordinal());
    if (m.Get("busy") == "1") return {absl::StrCat(reply, " ", DropWhileBusy(&*arena, seed)), false};
    if (m.Get("write") == "1") {
      // Leave the mapping and context as they are: the process exits next.
      absl::StrAppend(&reply, " ", WriteIntoMapping(**arena));
      arena->release();
      return {reply, true};
    }
    start = Clock::now();
    arena->reset();
    return {absl::StrFormat("%s unmap_ms=%.3f", reply, MillisecondsSince(start)), false};
  }

  int Run() {
    for (;;) {
      std::vector<ScopedFd> fds;
      absl::StatusOr<std::string> line = ReceiveMessage(sock_, &fds, /*timeout_ms=*/-1);
      if (!line.ok()) return 0;  // the parent went away
      absl::StatusOr<Message> m = ParseMessage(*line);
      std::pair<std::string, bool> reply{"error unknown request", false};
      if (!m.ok()) {
        reply.first = absl::StrCat("error ", m.status().ToString());
      } else if (m->verb == "hello") {
        reply.first = Hello();
      } else if (m->verb == "import") {
        reply = Import(*m, std::move(fds));
      } else if (m->verb == "quit") {
        reply = {"ok", true};
      }
      if (!SendMessage(sock_, reply.first, {}).ok()) return 1;
      if (reply.second) _exit(0);  // skip destructors: the context may be broken
    }
  }

 private:
  int sock_;
  std::shared_ptr<CudaContext> warm_;
};

}  // namespace

int ChildMain(int sock) { return Child(sock).Run(); }

}  // namespace weightd::gpu_checks
