// GPU checks of the CUDA device backends, run by tests/gpu/run_gpu_checks.sh
// (and by CTest under the label "gpu"). On a machine with an NVIDIA GPU it
// exports arenas from this process and imports them in a child process, the
// way weightd and its clients do, and prints one Markdown table:
//   - VMM export/import across processes, byte for byte; 2D strided copies
//   - a client dropping an import while queued GPU copies still read it
//     (VMM and legacy IPC): the copies must complete intact
//   - what a client's write into a read-only (PROT_READ) mapping does
//   - legacy IPC export/import across processes
//   - open+map time by arena size (64 MiB, 512 MiB, 2 GiB, 8 GiB)
//   - weightd's load throughput (from --load-json) against a plain pinned
//     cuMemcpyHtoD of the same checkpoint bytes, measured in the same run,
//     and a client's verified attach of that load (from --attach-json)
//   - cuMemHostRegister of a 4 GiB host mapping, read-only where supported
//   - a pinned host table through the client library (--socket, --pin-model:
//     AttachOptions::pin on a daemon's host-resident model): register seconds
//     per GB, GPU read bandwidth through the device pointers, unregister time
//     (tests/gpu/gpu_check_pin.h)
//   - a runtime layout (--socket, --layout-model: a model with rank 0 on GPU
//     0): a 1 GiB DEVICE tensor published through the client library (the
//     daemon hashes the sealed staging memfd and copies it into its own
//     cuMemCreate arena), attached back and read with cuMemcpyDtoH
//     (tests/gpu/gpu_check_layout.h)
// Without a driver or GPU it prints "SKIPPED: ..." and exits 77. Exit status
// 1 when a check failed.
//
// Usage: gpu_checks [--quick] [--checkpoint DIR --load-json FILE [--load-error FILE]
//                              [--attach-json FILE [--attach-error FILE]]]
//                              [--socket SOCKET --pin-model NAME] [--layout-model NAME]
//        (--quick registers 256 MiB instead of 4 GiB of host memory, and
//        publishes a 16 MiB device tensor instead of 1 GiB)
//        gpu_checks --probe        (0 and one line when a driver and GPU are here, else 77)
//        gpu_checks --child FD     (internal: the importing process)
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "common/memory/cuda/cuda_internal.h"
#include "common/memory/device.h"
#include "common/base/status.h"
#include "common/transport/unix_socket.h"
#include "nlohmann/json.hpp"
#include "tests/gpu/gpu_check_layout.h"
#include "tests/gpu/gpu_check_layout.h"
#include "tests/gpu/gpu_check_pin.h"
#include "tests/gpu/gpu_check_protocol.h"

namespace weightd::gpu_checks {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kSkipped = 77;

struct Options {
  std::string checkpoint, load_json, load_error, attach_json, attach_error;
  std::string socket, pin_model;  // a running daemon and a host-resident model of it
  uint64_t register_bytes = 4 * kGiB;  // --quick: 256 MiB
  std::string layout_model;            // a model of that daemon with rank 0 on GPU 0
  uint64_t layout_bytes = kGiB;        // the layout's device tensor; --quick: 16 MiB
};

class Table {
 public:
  void Add(std::string check, std::string result, std::string value, std::string detail) {
    if (result == "FAIL") failed_ = true;
    std::cerr << "[gpu_checks] " << check << ": " << result << " " << value << " " << detail << std::endl;
    rows_.push_back({std::move(check), std::move(result), std::move(value), std::move(detail)});
  }
  void Print() const {
    std::cout << "| check | result | value | detail |\n|---|---|---|---|\n";
    for (const auto& r : rows_) {
      std::cout << "| " << r[0] << " | " << r[1] << " | " << r[2] << " | " << r[3] << " |\n";
    }
  }
  bool failed() const { return failed_; }

 private:
  std::vector<std::array<std::string, 4>> rows_;
  bool failed_ = false;
};

std::string Size(uint64_t bytes) {
  if (bytes >= kGiB && bytes % kGiB == 0) return absl::StrCat(bytes / kGiB, " GiB");
  if (bytes >= kGiB) return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / kGiB);
  return absl::StrCat(bytes / kMiB, " MiB");
}

std::string GBps(uint64_t bytes, double seconds) {
  return seconds > 0 ? absl::StrFormat("%.2f GB/s", bytes / seconds / 1e9) : "n/a";
}

// The importing child process, started by exec (CUDA does not survive fork).
class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn() {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return absl::InternalError("socketpair failed");
    std::string fd_arg = std::to_string(sv[1]);
    char arg0[] = "gpu_checks", arg1[] = "--child";
    char* argv[] = {arg0, arg1, fd_arg.data(), nullptr};
    pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {  // only async-signal-safe calls until exec
      fcntl(sv[1], F_SETFD, 0);
      execv("/proc/self/exe", argv);
      _exit(127);
    }
    close(sv[1]);
    return std::unique_ptr<ChildProcess>(new ChildProcess(pid, ScopedFd(sv[0])));
  }
  ~ChildProcess() {
    if (pid_ > 0) {
      (void)Ask("quit");
      Wait();
    }
  }
  // Sends one request (with `fds`), waits up to 5 minutes for the reply.
  absl::StatusOr<Message> Ask(const std::string& request, const std::vector<int>& fds = {}) {
    absl::Status sent = SendMessage(sock_.get(), request, fds);
    if (!sent.ok()) return sent;
    std::vector<ScopedFd> none;
    absl::StatusOr<std::string> reply = ReceiveMessage(sock_.get(), &none, 300000);
    if (!reply.ok()) return reply.status();
    return ParseMessage(*reply);
  }
  // Waits for the child to exit (after "quit", or after a write request).
  int Wait() {
    int status = 0;
    if (pid_ > 0) waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  ChildProcess(pid_t pid, ScopedFd sock) : pid_(pid), sock_(std::move(sock)) {}
  pid_t pid_;
  ScopedFd sock_;
};

// What every check needs: the driver, both backends, device 0 and its context.
struct Gpu {
  CudaDriver* driver = nullptr;
  absl::StatusOr<std::unique_ptr<DeviceBackend>> vmm = absl::UnknownError("not made");
  absl::StatusOr<std::unique_ptr<DeviceBackend>> legacy = absl::UnknownError("not made");
  DeviceInfo device;
  std::shared_ptr<CudaContext> context;
  const CudaFunctions& cu() const { return driver->fn(); }
};

std::string Name(const Gpu& gpu, CUresult r) {
  const char* name = nullptr;
  return gpu.cu().GetErrorName(r, &name) == CUDA_SUCCESS && name != nullptr ? name : absl::StrCat("CUresult ", r);
}

// Writes the pattern into [offset, offset + n) of the arena through pinned
// staging buffers (two, alternating, each reused only after its fence).
absl::Status FillArena(DeviceBackend& backend, DeviceArena& arena, uint64_t offset, uint64_t n, uint64_t seed) {
  constexpr uint64_t kChunk = 16 * kMiB;
  std::unique_ptr<PinnedBuffer> staging[2];
  uint64_t fences[2] = {0, 0};
  for (auto& s : staging) {
    absl::StatusOr<std::unique_ptr<PinnedBuffer>> b = backend.AllocatePinned(kChunk);
    if (!b.ok()) return b.status();
    s = std::move(*b);
  }
  for (uint64_t done = 0, i = 0; done < n; done += kChunk, ++i) {
    uint64_t len = std::min(kChunk, n - done);
    int k = i % 2;
    if (fences[k] != 0) WEIGHTD_RETURN_IF_ERROR(arena.WaitFence(fences[k]));
    FillPattern(staging[k]->data(), offset + done, len, seed);
    WEIGHTD_RETURN_IF_ERROR(arena.CopyFromHost(offset + done, len, staging[k]->data(), len, len, 1));
    absl::StatusOr<uint64_t> fence = arena.RecordFence();
    if (!fence.ok()) return fence.status();
    fences[k] = *fence;
  }
  for (uint64_t f : fences) {
    if (f != 0) WEIGHTD_RETURN_IF_ERROR(arena.WaitFence(f));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> FindArenaMismatch(DeviceArena& arena, uint64_t seed) {
  std::vector<char> host(64 * kMiB);
  for (uint64_t off = 0; off < arena.size(); off += host.size()) {
    uint64_t n = std::min<uint64_t>(host.size(), arena.size() - off);
    WEIGHTD_RETURN_IF_ERROR(arena.CopyToHost(off, host.data(), n));
    int64_t bad = FindMismatch(host.data(), off, n, seed);
    if (bad >= 0) return bad;
  }
  return -1;
}

// A sealed arena of `size` bytes holding the pattern (everywhere, or only
// at both ends), and the request that makes the child import it.
struct Exported {
  std::unique_ptr<DeviceArena> arena;
  std::string request;
  double alloc_ms = 0, seal_ms = 0;
};

absl::StatusOr<Exported> Export(DeviceBackend& backend, const DeviceInfo& device, uint64_t size, uint64_t seed,
                                const std::string& verify, bool write) {
  Exported e;
  Clock::time_point start = Clock::now();
  absl::StatusOr<std::unique_ptr<DeviceArena>> arena = backend.Allocate(device, size);
  if (!arena.ok()) return arena.status();
  e.arena = std::move(*arena);
  absl::StatusOr<uint64_t> zeroed = e.arena->RecordFence();  // allocation includes the zero fill
  if (!zeroed.ok()) return zeroed.status();
  WEIGHTD_RETURN_IF_ERROR(e.arena->WaitFence(*zeroed));
  e.alloc_ms = MillisecondsSince(start);
  if (verify == "full") {
    WEIGHTD_RETURN_IF_ERROR(FillArena(backend, *e.arena, 0, e.arena->size(), seed));
  } else if (verify == "ends") {
    WEIGHTD_RETURN_IF_ERROR(FillArena(backend, *e.arena, 0, kEndBytes, seed));
    WEIGHTD_RETURN_IF_ERROR(FillArena(backend, *e.arena, e.arena->size() - kEndBytes, kEndBytes, seed));
  }
  start = Clock::now();
  WEIGHTD_RETURN_IF_ERROR(e.arena->Seal());
  e.seal_ms = MillisecondsSince(start);
  e.request = absl::StrCat("import backend=", backend.name(), " uuid=", device.uuid, " size=", e.arena->size(),
                           " verify=", verify, " seed=", seed, " write=", write ? 1 : 0);
  if (!e.arena->export_handle().empty()) absl::StrAppend(&e.request, " handle=", absl::BytesToHexString(e.arena->export_handle()));
  return e;
}

std::vector<int> FdsOf(const Exported& e) {
  return e.arena->export_fd() >= 0 ? std::vector<int>{e.arena->export_fd()} : std::vector<int>{};
}

// Exports a fully patterned 64 MiB arena, has the child import and verify it.
void CheckRoundTrip(const std::string& check, DeviceBackend& backend, const Gpu& gpu, ChildProcess& child,
                    uint64_t seed, Table& table) {
  absl::StatusOr<Exported> e = Export(backend, gpu.device, 64 * kMiB, seed, "full", false);
  if (!e.ok()) return table.Add(check, "FAIL", "", absl::StrCat("export: ", e.status().ToString()));
  absl::StatusOr<Message> reply = child.Ask(e->request, FdsOf(*e));
  if (!reply.ok()) return table.Add(check, "FAIL", "", absl::StrCat("child: ", reply.status().ToString()));
  if (reply->verb != "ok") return table.Add(check, "FAIL", "", reply->Get("message"));
  bool all = reply->Get("verified") == std::to_string(e->arena->size());
  table.Add(check, all ? "PASS" : "FAIL", absl::StrCat(Size(e->arena->size()), " verified"),
            absl::StrCat("child mapping read-only: ", reply->Get("read_only") == "1" ? "yes" : "no", "; import ",
                         reply->Get("import_ms"), " ms, unmap ", reply->Get("unmap_ms"), " ms"));
}

// The child queues GPU copies that read an imported 512 MiB arena and drops
// the import while they run; the copies must finish intact.
void CheckDropWhileBusy(DeviceBackend& backend, const Gpu& gpu, ChildProcess& child, Table& table) {
  const std::string check = absl::StrCat("drop an import while 16 queued cuMemcpyDtoDAsync read it (", backend.name(), ")");
  absl::StatusOr<Exported> e = Export(backend, gpu.device, 512 * kMiB, 5, "ends", false);
  if (!e.ok()) return table.Add(check, "FAIL", "", absl::StrCat("export: ", e.status().ToString()));
  absl::StatusOr<Message> reply = child.Ask(absl::StrCat(e->request, " busy=1"), FdsOf(*e));
  if (!reply.ok()) return table.Add(check, "FAIL", "", absl::StrCat("child: ", reply.status().ToString()));
  if (reply->verb != "ok") return table.Add(check, "FAIL", "", reply->Get("message"));
  if (!reply->Get("busy_error").empty()) return table.Add(check, "FAIL", "", reply->Get("busy_error"));
  bool ok = reply->Get("busy_queued") == "CUDA_SUCCESS" && reply->Get("busy_sync") == "CUDA_SUCCESS" &&
            reply->Get("busy_verified") == std::to_string(2 * kEndBytes);
  table.Add(check, ok ? "PASS" : "FAIL", absl::StrCat("drop ", reply->Get("drop_ms"), " ms"),
            absl::StrCat("copies queued ", reply->Get("busy_queued"), ", stream sync ", reply->Get("busy_sync"),
                         ", copied ends verified ", reply->Get("busy_verified"), " bytes; ",
                         ok ? "the drop waited for them" : "the copies did not survive the drop"));
}

// Rows r of `width` bytes, `src_pitch` apart in host memory, land `dst_pitch`
// apart in the arena at `offset`; everything else stays zero. The rows come
// from a pinned buffer, as in the loader (cuMemcpy2DAsync from pinned memory
// is truly asynchronous; from pageable memory the driver stages it).
void Check2DCopy(DeviceBackend& backend, const Gpu& gpu, Table& table) {
  const std::string check = "2D strided copy (CopyFromHost from pinned memory, 300 rows)";
  constexpr uint64_t kRows = 300, kWidth = 1496, kSrcPitch = 5000, kDstPitch = 2048, kOffset = 4096 + 256;
  absl::StatusOr<std::unique_ptr<DeviceArena>> arena = backend.Allocate(gpu.device, 4 * kMiB);
  if (!arena.ok()) return table.Add(check, "FAIL", "", arena.status().ToString());
  absl::StatusOr<std::unique_ptr<PinnedBuffer>> pinned = backend.AllocatePinned(kRows * kSrcPitch);
  if (!pinned.ok()) return table.Add(check, "FAIL", "", pinned.status().ToString());
  absl::Span<char> src((*pinned)->data(), kRows * kSrcPitch);
  FillPattern(src.data(), 0, src.size(), 7);
  absl::Status s = (*arena)->CopyFromHost(kOffset, kDstPitch, src.data(), kSrcPitch, kWidth, kRows);
  absl::StatusOr<uint64_t> fence = s.ok() ? (*arena)->RecordFence() : absl::StatusOr<uint64_t>(s);
  if (fence.ok()) s = (*arena)->WaitFence(*fence);
  std::vector<char> back((*arena)->size());
  if (s.ok()) s = (*arena)->CopyToHost(0, back.data(), back.size());
  if (!s.ok()) return table.Add(check, "FAIL", "", s.ToString());
  std::vector<char> want(back.size(), 0);
  for (uint64_t r = 0; r < kRows; ++r) std::copy_n(&src[r * kSrcPitch], kWidth, &want[kOffset + r * kDstPitch]);
  bool equal = back == want;
  absl::Status overrun = (*arena)->CopyFromHost((*arena)->size() - 100, kDstPitch, src.data(), kSrcPitch, kWidth, 2);
  bool refused = overrun.code() == absl::StatusCode::kOutOfRange;
  table.Add(check, equal && refused ? "PASS" : "FAIL", equal ? "rows verified" : "rows differ",
            absl::StrCat("an overrunning copy is ", refused ? "refused (OUT_OF_RANGE)" : overrun.ToString()));
}

void CheckOpenMapTimes(DeviceBackend& backend, const Gpu& gpu, ChildProcess& child, Table& table) {
  for (uint64_t size : {64 * kMiB, 512 * kMiB, 2 * kGiB, 8 * kGiB}) {
    const std::string check = absl::StrCat("open+map ", Size(size), " (", backend.name(), ")");
    size_t free_bytes = 0, total = 0;
    {
      absl::StatusOr<ScopedContext> scope = ScopedContext::Enter(*gpu.context);
      if (scope.ok()) gpu.cu().MemGetInfo(&free_bytes, &total);
    }
    if (free_bytes < size + kGiB) {
      table.Add(check, "skipped", "", absl::StrCat("only ", Size(free_bytes), " free on the GPU"));
      continue;
    }
    absl::StatusOr<Exported> e = Export(backend, gpu.device, size, size / kMiB, "ends", false);
    if (!e.ok()) {
      table.Add(check, "FAIL", "", e.status().ToString());
      continue;
    }
    absl::StatusOr<Message> reply = child.Ask(e->request, FdsOf(*e));
    if (!reply.ok() || reply->verb != "ok") {
      table.Add(check, "FAIL", "", reply.ok() ? reply->Get("message") : reply.status().ToString());
      continue;
    }
    table.Add(check, "PASS", absl::StrCat(reply->Get("import_ms"), " ms"),
              absl::StrFormat("client import+reserve+map+access %s ms, unmap %s ms, read-only %s; daemon "
                              "allocate+zero %.1f ms, seal+export %.2f ms; both ends verified",
                              reply->Get("import_ms"), reply->Get("unmap_ms"),
                              reply->Get("read_only") == "1" ? "yes" : "no", e->alloc_ms, e->seal_ms));
  }
}

// The client writes 1 MiB into its (read-only, if granted) mapping of an
// arena; the daemon's copy is then compared with what it wrote. Last check
// with the child: a write fault ends the child's context.
void CheckReadOnlyWrite(DeviceBackend& backend, const Gpu& gpu, ChildProcess& child, Table& table) {
  const std::string check = "client write into its mapping (cuMemsetD8 + cuCtxSynchronize)";
  absl::StatusOr<Exported> e = Export(backend, gpu.device, 64 * kMiB, 3, "full", true);
  if (!e.ok()) return table.Add(check, "FAIL", "", e.status().ToString());
  absl::StatusOr<Message> reply = child.Ask(e->request, FdsOf(*e));
  child.Wait();
  if (!reply.ok() || reply->verb != "ok") {
    return table.Add(check, "FAIL", "", reply.ok() ? reply->Get("message") : reply.status().ToString());
  }
  absl::StatusOr<int64_t> bad = FindArenaMismatch(*e->arena, 3);
  bool read_only = reply->Get("read_only") == "1";
  std::string value = absl::StrCat("memset ", reply->Get("memset"), ", sync ", reply->Get("sync"));
  if (!bad.ok()) return table.Add(check, "FAIL", value, absl::StrCat("daemon read-back: ", bad.status().ToString()));
  std::string intact = *bad < 0 ? "the daemon's bytes are intact" : absl::StrCat("the daemon's byte ", *bad, " changed");
  if (read_only) {
    table.Add(check, *bad < 0 ? "PASS" : "FAIL", value, absl::StrCat("mapping PROT_READ; ", intact));
  } else {
    table.Add(check, "WARN", value,
              absl::StrCat("the driver did not grant PROT_READ (refused it, or cuMemGetAccess reports read-write), "
                           "the client mapped read-write; ", intact));
  }
}

absl::StatusOr<std::vector<std::string>> CheckpointFiles(const std::string& dir) {
  std::vector<std::string> files;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return absl::NotFoundError(absl::StrCat("cannot open ", dir));
  while (dirent* entry = readdir(d)) {
    std::string name = entry->d_name;
    if (name.size() > 12 && name.substr(name.size() - 12) == ".safetensors") files.push_back(dir + "/" + name);
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  if (files.empty()) return absl::NotFoundError(absl::StrCat("no .safetensors files in ", dir));
  return files;
}

// weightd's own number, from `weightctl load ... --json`; its GB/s or 0.
double ReportWeightdLoad(const Options& options, Table& table) {
  const std::string check = "weightd load, page cache -> GPU (--device-backend cuda)";
  std::ifstream in(options.load_json);
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.value("bytes", nlohmann::json()).is_number() ||
      !doc.value("seconds", nlohmann::json()).is_number()) {
    std::ifstream err(options.load_error);
    std::string line;
    std::getline(err, line);
    table.Add(check, "FAIL", "", line.empty() ? "no load result" : line);
    return 0;
  }
  uint64_t bytes = doc["bytes"].get<uint64_t>();
  double seconds = doc["seconds"].get<double>();
  std::string state = doc.value("state", "");
  table.Add(check, state == "READY" ? "PASS" : "FAIL", GBps(bytes, seconds),
            absl::StrFormat("%s in %.3f s, state %s, device_bytes %s", Size(bytes), seconds, state,
                            doc.value("device_bytes", nlohmann::json()).dump()));
  return seconds > 0 ? bytes / seconds / 1e9 : 0;
}

// `weightctl attach --rank 0 --verify DIR --json`: the client library imports
// the daemon's arenas and compares every tensor with the checkpoint.
void ReportAttach(const Options& options, Table& table) {
  const std::string check = "weightctl attach --verify (client imports the daemon's arenas)";
  std::ifstream in(options.attach_json);
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("verified") ||
      !doc.value("bytes", nlohmann::json()).is_number() || !doc.value("attach_seconds", nlohmann::json()).is_number()) {
    std::ifstream err(options.attach_error);
    std::string line;
    std::getline(err, line);
    return table.Add(check, "FAIL", "", line.empty() ? "no attach result" : line);
  }
  bool verified = doc["verified"].is_boolean() && doc["verified"].get<bool>();
  table.Add(check, verified ? "PASS" : "FAIL",
            absl::StrFormat("attach %.1f ms", doc.value("attach_seconds", 0.0) * 1e3),
            absl::StrFormat("%s tensors, %s; every tensor compared with the checkpoint: %s",
                            doc.value("tensors", nlohmann::json()).dump(), Size(doc.value("bytes", uint64_t{0})),
                            verified ? "equal" : "not verified"));
}

// Appends the whole file to `dst`, in 16 MiB preads; returns the bytes read.
absl::StatusOr<uint64_t> ReadFile(const std::string& path, char* dst) {
  ScopedFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  struct stat st;
  if (!fd.valid() || fstat(fd.get(), &st) != 0) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  uint64_t size = st.st_size;
  for (uint64_t off = 0; off < size;) {
    ssize_t n = pread(fd.get(), dst + off, std::min<uint64_t>(16 * kMiB, size - off), off);
    if (n <= 0) return absl::DataLossError(absl::StrCat("short read of ", path, " at ", off));
    off += n;
  }
  return size;
}

uint64_t FileBytes(const std::vector<std::string>& files) {
  uint64_t total = 0;
  for (const std::string& f : files) {
    struct stat st;
    if (stat(f.c_str(), &st) == 0) total += st.st_size;
  }
  return total;
}

// The same checkpoint bytes the plain way: pread from the page cache into one
// pinned buffer, then one synchronous cuMemcpyHtoD (best of two). Returns the
// copy's GB/s or 0.
double CheckBaseline(const Options& options, const Gpu& gpu, Table& table) {
  const std::string check = "baseline: pinned cuMemcpyHtoD of the checkpoint bytes";
  absl::StatusOr<std::vector<std::string>> files = CheckpointFiles(options.checkpoint);
  if (!files.ok()) return table.Add(check, "FAIL", "", files.status().ToString()), 0;
  uint64_t total = FileBytes(*files);
  absl::StatusOr<ScopedContext> scope = ScopedContext::Enter(*gpu.context);
  if (!scope.ok()) return table.Add(check, "FAIL", "", scope.status().ToString()), 0;
  const CudaFunctions& cu = gpu.cu();
  void* pinned = nullptr;
  CUresult r = cu.MemHostAlloc(&pinned, total, 0);
  if (r != CUDA_SUCCESS) return table.Add(check, "FAIL", "", absl::StrCat("cuMemHostAlloc: ", Name(gpu, r))), 0;
  Clock::time_point start = Clock::now();
  uint64_t at = 0;
  for (const std::string& f : *files) {
    absl::StatusOr<uint64_t> n = ReadFile(f, static_cast<char*>(pinned) + at);
    if (!n.ok()) {
      cu.MemFreeHost(pinned);
      return table.Add(check, "FAIL", "", n.status().ToString()), 0;
    }
    at += *n;
  }
  double read_s = MillisecondsSince(start) / 1e3;
  double copy_s = 0;
  CUdeviceptr device = 0;
  r = cu.MemAlloc(&device, total);
  for (int rep = 0; r == CUDA_SUCCESS && rep < 2; ++rep) {
    start = Clock::now();
    r = cu.MemcpyHtoD(device, pinned, total);
    double s = MillisecondsSince(start) / 1e3;
    copy_s = rep == 0 ? s : std::min(copy_s, s);
  }
  if (device != 0) cu.MemFree(device);
  cu.MemFreeHost(pinned);
  if (r != CUDA_SUCCESS) {
    return table.Add(check, "FAIL", "", absl::StrCat("cuMemAlloc/cuMemcpyHtoD: ", Name(gpu, r))), 0;
  }
  table.Add(check, "info", GBps(total, copy_s),
            absl::StrFormat("%s (all .safetensors files) in %.3f s, best of 2", Size(total), copy_s));
  table.Add("baseline: pread page cache -> pinned (1 thread)", "info", GBps(total, read_s),
            absl::StrFormat("%s in %.3f s; read then copy, one after the other: %s", Size(total), read_s,
                            GBps(total, read_s + copy_s)));
  return total / copy_s / 1e9;
}

// cuMemHostRegister of a `size`-byte shared mapping of a memfd (as a client
// registers a host-resident table): read-only with CU_MEMHOSTREGISTER_READ_ONLY
// where supported, and read-write without it.
void CheckHostRegister(const Gpu& gpu, uint64_t size, Table& table) {
  const uint64_t kSize = size;
  const std::string what = absl::StrCat("cuMemHostRegister ", Size(size));
  const CudaFunctions& cu = gpu.cu();
  absl::StatusOr<ScopedContext> scope = ScopedContext::Enter(*gpu.context);
  int fd = memfd_create("weightd-gpu-check", MFD_CLOEXEC);
  if (!scope.ok() || fd < 0 || ftruncate(fd, kSize) != 0) {
    return table.Add(what, "FAIL", "", "memfd or context setup failed");
  }
  ScopedFd memfd(fd);
  char* rw = static_cast<char*>(mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  if (rw == MAP_FAILED) return table.Add(what, "FAIL", "", "mmap failed");
  for (uint64_t off = 0; off < kSize; off += 64 * kMiB) FillPattern(rw + off, off, 64 * kMiB, 11);
  int ro_supported = 0;
  cu.DeviceGetAttribute(&ro_supported, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, gpu.context->device());

  auto measure = [&](const std::string& check, char* base, unsigned flags) {
    Clock::time_point start = Clock::now();
    CUresult r = cu.MemHostRegister(base, kSize, flags);
    double reg_s = MillisecondsSince(start) / 1e3;
    if (r != CUDA_SUCCESS) return table.Add(check, "FAIL", "", absl::StrCat("cuMemHostRegister: ", Name(gpu, r)));
    CUdeviceptr dptr = 0;
    std::vector<char> back(kMiB);
    r = cu.MemHostGetDevicePointer(&dptr, base, 0);
    if (r == CUDA_SUCCESS) r = cu.MemcpyDtoH(back.data(), dptr + kSize / 2, kMiB);
    bool seen = r == CUDA_SUCCESS && FindMismatch(back.data(), kSize / 2, kMiB, 11) < 0;
    start = Clock::now();
    cu.MemHostUnregister(base);
    double unreg_s = MillisecondsSince(start) / 1e3;
    table.Add(check, seen ? "PASS" : "FAIL", absl::StrFormat("%.3f s/GB", reg_s / (kSize / 1e9)),
              absl::StrFormat("register %.3f s, unregister %.3f s; device reads through the mapping: %s", reg_s, unreg_s,
                              seen ? "verified" : Name(gpu, r)));
  };
  char* ro = static_cast<char*>(mmap(nullptr, kSize, PROT_READ, MAP_SHARED, fd, 0));
  if (ro == MAP_FAILED) {
    table.Add(what + " read-only mapping", "FAIL", "", "mmap PROT_READ failed");
  } else if (ro_supported) {
    measure(what + " read-only mapping (DEVICEMAP, READ_ONLY)", ro,
            CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_READ_ONLY);
  } else {
    table.Add(what + " read-only mapping (DEVICEMAP, READ_ONLY)", "skipped", "",
              "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0 on this GPU");
  }
  measure(what + " read-write mapping (DEVICEMAP)", rw, CU_MEMHOSTREGISTER_DEVICEMAP);
  if (ro != MAP_FAILED) munmap(ro, kSize);
  munmap(rw, kSize);
}

// The driver and device 0, or the reason to skip.
absl::StatusOr<Gpu> OpenGpu() {
  Gpu gpu;
  absl::StatusOr<CudaDriver*> driver = CudaDriver::Load();
  if (!driver.ok()) return driver.status();
  gpu.driver = *driver;
  int count = 0;
  CUresult r = gpu.cu().DeviceGetCount(&count);
  if (r != CUDA_SUCCESS || count == 0) return absl::UnavailableError(absl::StrCat("no CUDA device (", Name(gpu, r), ")"));
  absl::StatusOr<std::shared_ptr<CudaContext>> context = CudaContext::Retain(*gpu.driver, 0);
  if (!context.ok()) return context.status();
  gpu.context = *context;
  gpu.vmm = MakeCudaBackend(false);
  gpu.legacy = MakeCudaBackend(true);
  absl::StatusOr<std::vector<DeviceInfo>> devices =
      gpu.legacy.ok() ? (*gpu.legacy)->Devices() : absl::StatusOr<std::vector<DeviceInfo>>(gpu.legacy.status());
  if (!devices.ok()) return devices.status();
  gpu.device = devices->front();
  return gpu;
}

// Whether there is a driver and a GPU: 0 (and one line about them) or 77.
int Probe() {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  if (!gpu.ok()) {
    std::cout << "SKIPPED: no CUDA driver/GPU on this machine (" << gpu.status().message() << ")" << std::endl;
    return kSkipped;
  }
  std::cout << "CUDA driver " << gpu->driver->version() << ", GPU 0 " << gpu->device.uuid << " (" << gpu->device.name
            << "); cuda backend: " << (gpu->vmm.ok() ? "ok" : gpu->vmm.status().ToString())
            << "; cuda-legacy-ipc backend: " << (gpu->legacy.ok() ? "ok" : gpu->legacy.status().ToString()) << std::endl;
  return 0;
}

int ParentMain(const Options& options) {
  absl::StatusOr<Gpu> opened = OpenGpu();
  if (!opened.ok()) {
    std::cout << "SKIPPED: no CUDA driver/GPU on this machine (" << opened.status().message() << ")" << std::endl;
    return kSkipped;
  }
  Gpu& gpu = *opened;
  Table table;
  table.Add("driver and GPU 0", "info", absl::StrCat("driver ", gpu.driver->version()),
            absl::StrFormat("%s, %s, %s", gpu.device.uuid, gpu.device.name, Size(gpu.device.total_bytes)));
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn();
  absl::StatusOr<Message> hello = child.ok() ? (*child)->Ask("hello") : absl::StatusOr<Message>(child.status());
  if (!hello.ok() || hello->verb != "ok") {
    table.Add("client process", "FAIL", "", hello.ok() ? hello->Get("message") : hello.status().ToString());
    table.Print();
    return 1;
  }
  table.Add("client process: driver load + primary context", "info", absl::StrCat(hello->Get("startup_ms"), " ms"),
            "what a fresh rank pays once, before its first import");
  if (gpu.vmm.ok()) {
    CheckRoundTrip("VMM export/import across processes (fd over SCM_RIGHTS)", **gpu.vmm, gpu, **child, 1, table);
    Check2DCopy(**gpu.vmm, gpu, table);
    CheckDropWhileBusy(**gpu.vmm, gpu, **child, table);
  } else {
    table.Add("VMM backend (cuda)", "FAIL", "", gpu.vmm.status().ToString());
  }
  if (gpu.legacy.ok()) {
    CheckRoundTrip("legacy IPC export/import across processes (handle bytes)", **gpu.legacy, gpu, **child, 2, table);
    CheckDropWhileBusy(**gpu.legacy, gpu, **child, table);
  } else {
    table.Add("legacy IPC backend (cuda-legacy-ipc)", "FAIL", "", gpu.legacy.status().ToString());
  }
  if (gpu.vmm.ok()) CheckOpenMapTimes(**gpu.vmm, gpu, **child, table);
  double weightd_gbps = options.load_json.empty() ? 0 : ReportWeightdLoad(options, table);
  if (!options.attach_json.empty()) ReportAttach(options, table);
  double h2d_gbps = options.checkpoint.empty() ? 0 : CheckBaseline(options, gpu, table);
  if (weightd_gbps > 0 && h2d_gbps > 0) {
    table.Add("weightd load / pinned cuMemcpyHtoD", "info", absl::StrFormat("%.2f", weightd_gbps / h2d_gbps),
              "1.00 would mean the load runs at the PCIe copy's speed");
  }
  if (options.load_json.empty() && options.checkpoint.empty()) {
    table.Add("load throughput", "skipped", "", "needs --checkpoint and --load-json (tests/gpu/run_gpu_checks.sh)");
  }
  CheckHostRegister(gpu, options.register_bytes, table);
  if (!options.socket.empty() && !options.pin_model.empty()) {
    for (Row& row : CheckPinnedTable(options.socket, options.pin_model, *gpu.context)) {
      table.Add(std::move(row[0]), std::move(row[1]), std::move(row[2]), std::move(row[3]));
    }
  } else {
    table.Add("pinned host table (attach --pin)", "skipped", "",
              "needs --socket and --pin-model (tests/gpu/run_gpu_checks.sh)");
  }
  if (!options.socket.empty() && !options.layout_model.empty()) {
    for (Row& row : CheckLayout(options.socket, options.layout_model, options.layout_bytes, *gpu.context)) {
      table.Add(std::move(row[0]), std::move(row[1]), std::move(row[2]), std::move(row[3]));
    }
  } else {
    table.Add("runtime layout (publish a device tensor, attach it)", "skipped", "",
              "needs --socket and --layout-model (tests/gpu/run_gpu_checks.sh)");
  }
  if (gpu.vmm.ok()) CheckReadOnlyWrite(**gpu.vmm, gpu, **child, table);
  table.Print();
  return table.failed() ? 1 : 0;
}

}  // namespace
}  // namespace weightd::gpu_checks

int main(int argc, char** argv) {
  using namespace weightd::gpu_checks;
  signal(SIGPIPE, SIG_IGN);  // a child that died shows as a failed send
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value = i + 1 < argc ? argv[i + 1] : "";
    int fd = -1;
    if (arg == "--child" && absl::SimpleAtoi(value, &fd)) return ChildMain(fd);
    if (arg == "--probe") return Probe();
    if (arg == "--quick") {
      options.register_bytes = 256 * kMiB;
      options.layout_bytes = 16 * kMiB;
      continue;
    }
    if (arg == "--checkpoint") options.checkpoint = value;
    else if (arg == "--load-json") options.load_json = value;
    else if (arg == "--load-error") options.load_error = value;
    else if (arg == "--attach-json") options.attach_json = value;
    else if (arg == "--attach-error") options.attach_error = value;
    else if (arg == "--socket") options.socket = value;
    else if (arg == "--pin-model") options.pin_model = value;
    else if (arg == "--layout-model") options.layout_model = value;
    else {
      std::cerr << "usage: gpu_checks [--quick] [--checkpoint DIR --load-json FILE [--load-error FILE]\n"
                   "                  [--attach-json FILE [--attach-error FILE]]] [--socket SOCKET --pin-model NAME]\n"
                   "                  [--layout-model NAME]\n";
      return 2;
    }
    ++i;
  }
  return ParentMain(options);
}
