// A fake NVIDIA driver (built as fake-driver/libcuda.so.1) that serves the
// CUDA driver API weightd uses from host memory, so the CUDA backends, the
// GPU check program and run_gpu_checks.sh run end to end on machines without
// a GPU (LD_LIBRARY_PATH=<build>/tests/gpu/fake-driver). It checks what the
// real driver requires and what weightd could get wrong: cuInit first, a
// current context for context-bound calls, granularity-aligned VMM sizes,
// device pointers inside live mappings, access set before use, unmap before
// free. It does not model timing; every copy is a memcpy, but the source
// ranges of device-to-device copies stay "in flight" until their stream or
// the context is synchronised, and unmapping one of them faults the context
// (sticky CUDA_ERROR_ILLEGAL_ADDRESS) as unmapping memory a kernel still
// reads does on a GPU.
//
// Device memory is a memfd per allocation: VMM handles export it as an fd
// (as CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR does), cuMemMap maps it at a
// reserved address, cuMemSetAccess is mprotect, and legacy IPC handles carry
// "pid fd" so the importer opens /proc/<pid>/fd/<fd>. A write through a
// PROT_READ mapping is reported as the real driver would: the call succeeds
// and the context's next synchronisation returns CUDA_ERROR_ILLEGAL_ADDRESS.
//
// Registered host memory (cuMemHostRegister) is device-visible at the same
// address, with the checks cuda.h documents: page-aligned ranges, no overlap
// with a registered range (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED),
// CU_MEMHOSTREGISTER_READ_ONLY only where the device reports
// CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED (else
// CUDA_ERROR_NOT_SUPPORTED), and, as on platforms without pageable memory
// access, a read-only mapping registered without that flag is refused
// (CUDA_ERROR_INVALID_VALUE: the driver cannot pin its pages for writing).
// Tests read the registrations back through the extern "C" hook
// weightd_fake_cuda_host_registrations at the end of this file.
//
// Knobs (environment): FAKE_CUDA_DEVICES (default 1), FAKE_CUDA_REFUSE_READ_ONLY=1
// (cuMemSetAccess refuses PROT_READ), FAKE_CUDA_SILENT_READ_WRITE=1 (it
// accepts PROT_READ but maps read-write, as cuMemGetAccess then reports),
// FAKE_CUDA_FREE_BYTES (default 64 GiB), FAKE_CUDA_NO_READ_ONLY_HOST_REGISTER=1
// (READ_ONLY_HOST_REGISTER_SUPPORTED is 0), FAKE_CUDA_HOST_REGISTER_LIMIT
// (bytes of host memory that may be registered at once; beyond it
// cuMemHostRegister fails with CUDA_ERROR_OUT_OF_MEMORY, as when the
// locked-memory limit is reached).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr uint64_t kGranularity = uint64_t{2} << 20;

enum class Kind { kVmm, kAlloc, kIpc, kHost };

struct Mapping {
  uint64_t size = 0;
  int fd = -1;       // the memfd behind device memory (owned), or -1
  int prot = PROT_NONE;
  Kind kind = Kind::kVmm;
  unsigned host_flags = 0;  // kHost: the cuMemHostRegister flags
};

struct State {
  std::mutex mu;
  bool initialized = false;
  CUresult sticky = CUDA_SUCCESS;  // a device fault, reported at the next synchronisation
  std::map<CUmemGenericAllocationHandle, std::pair<int, uint64_t>> handles;  // VMM handle -> memfd, size
  CUmemGenericAllocationHandle next_handle = 1;
  std::map<uintptr_t, uint64_t> reservations;
  std::map<uintptr_t, Mapping> mappings;  // by base address
  std::map<void*, uint64_t> host_allocs;
  struct InFlight {
    CUstream stream;
    uintptr_t p;
    uint64_t n;
  };
  std::vector<InFlight> in_flight;  // reads of unsynchronised cuMemcpyDtoDAsync calls
};

State& S() {
  static State* s = new State();
  return *s;
}

thread_local std::vector<CUcontext> t_contexts;

uint64_t EnvU64(const char* name, uint64_t fallback) {
  const char* v = getenv(name);
  return v != nullptr && *v != 0 ? strtoull(v, nullptr, 10) : fallback;
}
int DeviceCount() { return static_cast<int>(EnvU64("FAKE_CUDA_DEVICES", 1)); }

// Returns the mapping holding [p, p + n), or null.
Mapping* Find(uintptr_t p, uint64_t n, uintptr_t* base = nullptr) {
  auto& m = S().mappings;
  auto it = m.upper_bound(p);
  if (it == m.begin()) return nullptr;
  --it;
  if (p + n > it->first + it->second.size) return nullptr;
  if (base != nullptr) *base = it->first;
  return &it->second;
}

#define FAKE_NEEDS_INIT() \
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED
#define FAKE_NEEDS_CONTEXT()                                   \
  FAKE_NEEDS_INIT();                                           \
  if (t_contexts.empty()) return CUDA_ERROR_INVALID_CONTEXT

int NewMemfd(uint64_t size) {
  int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
  if (fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// --- errors, init, devices ---------------------------------------------------

CUresult GetErrorName(CUresult r, const char** out) {
  switch (r) {
    case CUDA_SUCCESS: *out = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *out = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: *out = "CUDA_ERROR_OUT_OF_MEMORY"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_INITIALIZED: *out = "CUDA_ERROR_NOT_INITIALIZED"; return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE: *out = "CUDA_ERROR_NO_DEVICE"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_DEVICE: *out = "CUDA_ERROR_INVALID_DEVICE"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_CONTEXT: *out = "CUDA_ERROR_INVALID_CONTEXT"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_HANDLE: *out = "CUDA_ERROR_INVALID_HANDLE"; return CUDA_SUCCESS;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *out = "CUDA_ERROR_ILLEGAL_ADDRESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_SUPPORTED: *out = "CUDA_ERROR_NOT_SUPPORTED"; return CUDA_SUCCESS;
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: *out = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; return CUDA_SUCCESS;
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: *out = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"; return CUDA_SUCCESS;
    default: *out = nullptr; return CUDA_ERROR_INVALID_VALUE;
  }
}
CUresult GetErrorString(CUresult r, const char** out) {
  const char* name = nullptr;
  if (GetErrorName(r, &name) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
  *out = "reported by the fake CUDA driver";
  return CUDA_SUCCESS;
}

CUresult Init(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (DeviceCount() == 0) return CUDA_ERROR_NO_DEVICE;
  S().initialized = true;
  return CUDA_SUCCESS;
}

CUresult DeviceGet(CUdevice* d, int ordinal) {
  FAKE_NEEDS_INIT();
  if (ordinal < 0 || ordinal >= DeviceCount()) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult DeviceGetCount(int* n) {
  FAKE_NEEDS_INIT();
  *n = DeviceCount();
  return CUDA_SUCCESS;
}
CUresult DeviceGetName(char* name, int len, CUdevice d) {
  FAKE_NEEDS_INIT();
  snprintf(name, len, "Fake CUDA Device %d", d);
  return CUDA_SUCCESS;
}
CUresult DeviceTotalMem(size_t* bytes, CUdevice) {
  FAKE_NEEDS_INIT();
  *bytes = size_t{80} << 30;
  return CUDA_SUCCESS;
}
CUresult DeviceGetUuid(CUuuid* uuid, CUdevice d) {
  FAKE_NEEDS_INIT();
  for (int i = 0; i < 16; ++i) uuid->bytes[i] = static_cast<char>(0xf0 + i);
  uuid->bytes[15] = static_cast<char>(d);
  return CUDA_SUCCESS;
}
CUresult DeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
  FAKE_NEEDS_INIT();
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
      *v = 1;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED:
      *v = EnvU64("FAKE_CUDA_NO_READ_ONLY_HOST_REGISTER", 0) != 0 ? 0 : 1;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH:
      *v = 2147483647;
      return CUDA_SUCCESS;
    default:
      *v = 0;
      return CUDA_SUCCESS;
  }
}

// --- contexts ----------------------------------------------------------------

CUcontext ContextOf(CUdevice d) { return reinterpret_cast<CUcontext>(uintptr_t{0x1000} + d); }

CUresult DevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  FAKE_NEEDS_INIT();
  if (d < 0 || d >= DeviceCount()) return CUDA_ERROR_INVALID_DEVICE;
  *c = ContextOf(d);
  return CUDA_SUCCESS;
}
CUresult DevicePrimaryCtxRelease(CUdevice d) {
  FAKE_NEEDS_INIT();
  return d >= 0 && d < DeviceCount() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}
CUresult CtxPushCurrent(CUcontext c) {
  FAKE_NEEDS_INIT();
  if (c == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  t_contexts.push_back(c);
  return CUDA_SUCCESS;
}
CUresult CtxPopCurrent(CUcontext* c) {
  FAKE_NEEDS_CONTEXT();
  if (c != nullptr) *c = t_contexts.back();
  t_contexts.pop_back();
  return CUDA_SUCCESS;
}
CUresult TakeSticky() {
  std::lock_guard<std::mutex> lock(S().mu);
  return S().sticky;
}
CUresult CtxSynchronize() {
  FAKE_NEEDS_CONTEXT();
  {
    std::lock_guard<std::mutex> lock(S().mu);
    S().in_flight.clear();
  }
  return TakeSticky();
}
// Unmapping [p, p + n) while a queued copy reads it: the copy faults.
// Requires S().mu.
void FaultInFlightReads(uintptr_t p, uint64_t n) {
  auto& f = S().in_flight;
  auto overlaps = [&](const State::InFlight& r) { return r.p < p + n && p < r.p + r.n; };
  if (std::any_of(f.begin(), f.end(), overlaps)) S().sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
  std::erase_if(f, overlaps);
}

// --- streams and events (every operation is already complete) -------------------

CUresult StreamCreate(CUstream* s, unsigned int) {
  FAKE_NEEDS_CONTEXT();
  *s = reinterpret_cast<CUstream>(new int(0));
  return CUDA_SUCCESS;
}
CUresult StreamDestroy(CUstream s) {
  FAKE_NEEDS_CONTEXT();
  delete reinterpret_cast<int*>(s);
  return CUDA_SUCCESS;
}
CUresult StreamSynchronize(CUstream s) {
  FAKE_NEEDS_CONTEXT();
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  {
    std::lock_guard<std::mutex> lock(S().mu);
    std::erase_if(S().in_flight, [&](const State::InFlight& r) { return r.stream == s; });
  }
  return TakeSticky();
}
CUresult EventCreate(CUevent* e, unsigned int flags) {
  FAKE_NEEDS_CONTEXT();
  constexpr unsigned int kKnown = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if ((flags & ~kKnown) != 0) return CUDA_ERROR_INVALID_VALUE;
  // cuEventCreate: INTERPROCESS "must be used with CU_EVENT_DISABLE_TIMING".
  if ((flags & CU_EVENT_INTERPROCESS) != 0 && (flags & CU_EVENT_DISABLE_TIMING) == 0) return CUDA_ERROR_INVALID_VALUE;
  *e = reinterpret_cast<CUevent>(new int(0));
  return CUDA_SUCCESS;
}
CUresult EventRecord(CUevent e, CUstream s) {
  FAKE_NEEDS_CONTEXT();
  return e == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}
CUresult EventSynchronize(CUevent e) {
  FAKE_NEEDS_INIT();
  return e == nullptr ? CUDA_ERROR_INVALID_HANDLE : TakeSticky();
}
CUresult EventDestroy(CUevent e) {
  FAKE_NEEDS_INIT();
  delete reinterpret_cast<int*>(e);
  return CUDA_SUCCESS;
}

// --- VMM -----------------------------------------------------------------------

CUresult MemGetInfo(size_t* free_bytes, size_t* total) {
  FAKE_NEEDS_CONTEXT();
  *free_bytes = EnvU64("FAKE_CUDA_FREE_BYTES", uint64_t{64} << 30);
  *total = size_t{80} << 30;
  return CUDA_SUCCESS;
}
bool ValidProp(const CUmemAllocationProp* p) {
  return p != nullptr && p->type == CU_MEM_ALLOCATION_TYPE_PINNED && p->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
         p->location.id >= 0 && p->location.id < DeviceCount() &&
         p->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}
CUresult MemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* prop, CUmemAllocationGranularity_flags) {
  FAKE_NEEDS_INIT();
  if (!ValidProp(prop)) return CUDA_ERROR_INVALID_VALUE;
  *g = kGranularity;
  return CUDA_SUCCESS;
}
CUresult MemCreate(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* prop, unsigned long long flags) {
  FAKE_NEEDS_INIT();
  if (!ValidProp(prop) || flags != 0 || size == 0 || size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (size > EnvU64("FAKE_CUDA_FREE_BYTES", uint64_t{64} << 30)) return CUDA_ERROR_OUT_OF_MEMORY;
  int fd = NewMemfd(size);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(S().mu);
  *h = S().next_handle++;
  S().handles[*h] = {fd, size};
  return CUDA_SUCCESS;
}
CUresult MemRelease(CUmemGenericAllocationHandle h) {
  FAKE_NEEDS_INIT();
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  close(it->second.first);  // mappings keep the memory alive
  S().handles.erase(it);
  return CUDA_SUCCESS;
}
CUresult MemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType type,
                                    unsigned long long flags) {
  FAKE_NEEDS_INIT();
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().handles.find(h);
  if (it == S().handles.end() || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || flags != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *static_cast<int*>(out) = dup(it->second.first);
  return CUDA_SUCCESS;
}
CUresult MemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os_handle, CUmemAllocationHandleType type) {
  FAKE_NEEDS_INIT();
  int fd = static_cast<int>(reinterpret_cast<uintptr_t>(os_handle));
  struct stat st;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || fstat(fd, &st) != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> lock(S().mu);
  *h = S().next_handle++;
  S().handles[*h] = {fcntl(fd, F_DUPFD_CLOEXEC, 0), static_cast<uint64_t>(st.st_size)};
  return CUDA_SUCCESS;
}
CUresult MemAddressReserve(CUdeviceptr* p, size_t size, size_t, CUdeviceptr addr, unsigned long long flags) {
  FAKE_NEEDS_INIT();
  if (size == 0 || size % kGranularity != 0 || addr != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  void* m = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(S().mu);
  *p = reinterpret_cast<uintptr_t>(m);
  S().reservations[*p] = size;
  return CUDA_SUCCESS;
}
CUresult MemAddressFree(CUdeviceptr p, size_t size) {
  FAKE_NEEDS_INIT();
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().reservations.find(p);
  if (it == S().reservations.end() || it->second != size || Find(p, 1) != nullptr) return CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(p), size);
  S().reservations.erase(it);
  return CUDA_SUCCESS;
}
CUresult MemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
  FAKE_NEEDS_INIT();
  std::lock_guard<std::mutex> lock(S().mu);
  auto handle = S().handles.find(h);
  auto reservation = S().reservations.upper_bound(p);
  if (handle == S().handles.end() || reservation == S().reservations.begin() || offset != 0 || flags != 0 ||
      size > handle->second.second || size % kGranularity != 0 || Find(p, 1) != nullptr) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  --reservation;
  if (p + size > reservation->first + reservation->second) return CUDA_ERROR_INVALID_VALUE;
  if (mmap(reinterpret_cast<void*>(p), size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle->second.first, 0) == MAP_FAILED) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  S().mappings[p] = Mapping{size, fcntl(handle->second.first, F_DUPFD_CLOEXEC, 0), PROT_NONE, Kind::kVmm};
  return CUDA_SUCCESS;
}
CUresult MemUnmap(CUdeviceptr p, size_t size) {
  FAKE_NEEDS_INIT();
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().mappings.find(p);
  if (it == S().mappings.end() || it->second.kind != Kind::kVmm || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
  FaultInFlightReads(p, size);
  mmap(reinterpret_cast<void*>(p), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  close(it->second.fd);
  S().mappings.erase(it);
  return CUDA_SUCCESS;
}
CUresult MemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc* desc, size_t count) {
  FAKE_NEEDS_INIT();
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().mappings.find(p);
  if (it == S().mappings.end() || it->second.size != size || count != 1 ||
      desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc->location.id < 0 || desc->location.id >= DeviceCount()) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  int prot = PROT_NONE;
  if (desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READ) {
    if (EnvU64("FAKE_CUDA_REFUSE_READ_ONLY", 0) != 0) return CUDA_ERROR_INVALID_VALUE;
    prot = PROT_READ;
  } else if (desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
    prot = PROT_READ | PROT_WRITE;
  } else {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // FAKE_CUDA_SILENT_READ_WRITE=1: a driver that accepts PROT_READ but maps
  // read-write anyway (cuMemGetAccess tells).
  if (prot == PROT_READ && EnvU64("FAKE_CUDA_SILENT_READ_WRITE", 0) != 0) prot = PROT_READ | PROT_WRITE;
  if (mprotect(reinterpret_cast<void*>(p), size, prot) != 0) return CUDA_ERROR_INVALID_VALUE;
  it->second.prot = prot;
  return CUDA_SUCCESS;
}
// The access of any address inside a VMM mapping.
CUresult MemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr p) {
  FAKE_NEEDS_INIT();
  if (flags == nullptr || location == nullptr || location->type != CU_MEM_LOCATION_TYPE_DEVICE ||
      location->id < 0 || location->id >= DeviceCount()) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().mappings.upper_bound(p);
  if (it == S().mappings.begin()) return CUDA_ERROR_INVALID_VALUE;
  --it;
  if (it->second.kind != Kind::kVmm || p >= it->first + it->second.size) return CUDA_ERROR_INVALID_VALUE;
  *flags = it->second.prot == (PROT_READ | PROT_WRITE) ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
           : it->second.prot == PROT_READ              ? CU_MEM_ACCESS_FLAGS_PROT_READ
                                                        : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  return CUDA_SUCCESS;
}

// --- cuMemAlloc and legacy IPC --------------------------------------------------

CUresult MapMemfd(int fd, uint64_t size, Kind kind, CUdeviceptr* p) {
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  std::lock_guard<std::mutex> lock(S().mu);
  *p = reinterpret_cast<uintptr_t>(m);
  S().mappings[*p] = Mapping{size, fd, PROT_READ | PROT_WRITE, kind};
  return CUDA_SUCCESS;
}
CUresult Unmap(CUdeviceptr p, Kind kind) {
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().mappings.find(p);
  if (it == S().mappings.end() || it->second.kind != kind) return CUDA_ERROR_INVALID_VALUE;
  FaultInFlightReads(p, it->second.size);
  munmap(reinterpret_cast<void*>(p), it->second.size);
  if (it->second.fd >= 0) close(it->second.fd);
  S().mappings.erase(it);
  return CUDA_SUCCESS;
}
CUresult MemAlloc(CUdeviceptr* p, size_t size) {
  FAKE_NEEDS_CONTEXT();
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  int fd = NewMemfd(size);
  return fd < 0 ? CUDA_ERROR_OUT_OF_MEMORY : MapMemfd(fd, size, Kind::kAlloc, p);
}
CUresult MemFree(CUdeviceptr p) {
  FAKE_NEEDS_CONTEXT();
  return Unmap(p, Kind::kAlloc);
}
CUresult MemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  FAKE_NEEDS_CONTEXT();
  std::lock_guard<std::mutex> lock(S().mu);
  uintptr_t b = 0;
  Mapping* m = Find(p, 1, &b);
  if (m == nullptr) return CUDA_ERROR_NOT_FOUND;
  if (base != nullptr) *base = b;
  if (size != nullptr) *size = m->size;
  return CUDA_SUCCESS;
}
CUresult IpcGetMemHandle(CUipcMemHandle* h, CUdeviceptr p) {
  FAKE_NEEDS_CONTEXT();
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().mappings.find(p);
  if (it == S().mappings.end() || it->second.kind != Kind::kAlloc) return CUDA_ERROR_INVALID_VALUE;
  memset(h->reserved, 0, sizeof(h->reserved));
  snprintf(h->reserved, sizeof(h->reserved), "fakeipc %d %d", getpid(), it->second.fd);
  return CUDA_SUCCESS;
}
CUresult IpcOpenMemHandle(CUdeviceptr* p, CUipcMemHandle h, unsigned int flags) {
  FAKE_NEEDS_CONTEXT();
  int pid = 0, fd = 0;
  char text[CU_IPC_HANDLE_SIZE + 1] = {};
  memcpy(text, h.reserved, CU_IPC_HANDLE_SIZE);
  if (flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS || sscanf(text, "fakeipc %d %d", &pid, &fd) != 2) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT;  // as the real driver: not in the exporting process
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int opened = open(path.c_str(), O_RDWR | O_CLOEXEC);
  struct stat st;
  if (opened < 0 || fstat(opened, &st) != 0) return CUDA_ERROR_INVALID_HANDLE;
  return MapMemfd(opened, st.st_size, Kind::kIpc, p);
}
CUresult IpcCloseMemHandle(CUdeviceptr p) {
  FAKE_NEEDS_CONTEXT();
  return Unmap(p, Kind::kIpc);
}

// --- copies and memset -------------------------------------------------------------

// A device range the caller may read (want_write false) or write; a write to
// a read-only mapping "faults" (sticky error) instead of crashing.
CUresult Access(CUdeviceptr p, uint64_t n, bool want_write, bool* faulted) {
  std::lock_guard<std::mutex> lock(S().mu);
  Mapping* m = Find(p, n);
  if (m == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *faulted = false;
  if ((m->prot & PROT_READ) == 0 || (want_write && (m->prot & PROT_WRITE) == 0)) {
    S().sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
    *faulted = true;
  }
  return CUDA_SUCCESS;
}
CUresult MemsetD8(CUdeviceptr p, unsigned char v, size_t n) {
  FAKE_NEEDS_CONTEXT();
  bool faulted = false;
  if (CUresult r = Access(p, n, true, &faulted); r != CUDA_SUCCESS || faulted) return r;
  memset(reinterpret_cast<void*>(p), v, n);
  return CUDA_SUCCESS;
}
// Zeroing a whole fresh arena should not touch its pages: punch a hole.
CUresult MemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
  FAKE_NEEDS_CONTEXT();
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (v == 0) {
    std::lock_guard<std::mutex> lock(S().mu);
    uintptr_t base = 0;
    Mapping* m = Find(p, n, &base);
    if (m != nullptr && m->fd >= 0 && (m->prot & PROT_WRITE) && (p - base) % 4096 == 0 && n % 4096 == 0) {
      return fallocate(m->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, p - base, n) == 0 ? CUDA_SUCCESS
                                                                                           : CUDA_ERROR_UNKNOWN;
    }
  }
  return MemsetD8(p, v, n);
}
CUresult MemcpyHtoD(CUdeviceptr dst, const void* src, size_t n) {
  FAKE_NEEDS_CONTEXT();
  bool faulted = false;
  if (CUresult r = Access(dst, n, true, &faulted); r != CUDA_SUCCESS || faulted) return r;
  memcpy(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}
CUresult MemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
  return s == nullptr ? CUDA_ERROR_INVALID_HANDLE : MemcpyHtoD(dst, src, n);
}
CUresult MemcpyDtoH(void* dst, CUdeviceptr src, size_t n) {
  FAKE_NEEDS_CONTEXT();
  bool faulted = false;
  if (CUresult r = Access(src, n, false, &faulted); r != CUDA_SUCCESS || faulted) return r;
  memcpy(dst, reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult MemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  FAKE_NEEDS_CONTEXT();
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  bool faulted = false;
  if (CUresult r = Access(src, n, false, &faulted); r != CUDA_SUCCESS || faulted) return r;
  if (CUresult r = Access(dst, n, true, &faulted); r != CUDA_SUCCESS || faulted) return r;
  memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  std::lock_guard<std::mutex> lock(S().mu);
  S().in_flight.push_back({s, src, n});
  return CUDA_SUCCESS;
}
CUresult Memcpy2DAsync(const CUDA_MEMCPY2D* c, CUstream s) {
  FAKE_NEEDS_CONTEXT();
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (c->srcMemoryType != CU_MEMORYTYPE_HOST || c->dstMemoryType != CU_MEMORYTYPE_DEVICE || c->srcXInBytes != 0 ||
      c->srcY != 0 || c->dstXInBytes != 0 || c->dstY != 0 || c->WidthInBytes > c->srcPitch ||
      c->WidthInBytes > c->dstPitch || c->Height == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  bool faulted = false;
  uint64_t span = (c->Height - 1) * c->dstPitch + c->WidthInBytes;
  if (CUresult r = Access(c->dstDevice, span, true, &faulted); r != CUDA_SUCCESS || faulted) return r;
  for (size_t r = 0; r < c->Height; ++r) {
    memcpy(reinterpret_cast<char*>(c->dstDevice) + r * c->dstPitch, static_cast<const char*>(c->srcHost) + r * c->srcPitch,
           c->WidthInBytes);
  }
  return CUDA_SUCCESS;
}

// --- host memory -------------------------------------------------------------------

CUresult MemHostAlloc(void** p, size_t size, unsigned int) {
  FAKE_NEEDS_CONTEXT();
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(S().mu);
  S().host_allocs[m] = size;
  *p = m;
  return CUDA_SUCCESS;
}
CUresult MemFreeHost(void* p) {
  FAKE_NEEDS_CONTEXT();
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().host_allocs.find(p);
  if (it == S().host_allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  munmap(p, it->second);
  S().host_allocs.erase(it);
  return CUDA_SUCCESS;
}
// Whether every page of [p, p + n) is mapped writable in this process
// (/proc/self/maps).
bool HostWritable(uintptr_t p, uint64_t n) {
  FILE* maps = fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  uintptr_t covered = p;
  char line[512];
  while (covered < p + n && fgets(line, sizeof(line), maps) != nullptr) {
    unsigned long begin = 0, end = 0;
    char perms[5] = {};
    if (sscanf(line, "%lx-%lx %4s", &begin, &end, perms) != 3 || end <= covered || begin > covered) continue;
    if (perms[1] != 'w') break;
    covered = end;
  }
  fclose(maps);
  return covered >= p + n;
}
uint64_t HostRegisteredBytes() {
  uint64_t total = 0;
  for (const auto& [base, m] : S().mappings) total += m.kind == Kind::kHost ? m.size : 0;
  return total;
}
// Registered host memory is device-visible at the same address (as where
// every GPU has CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM).
CUresult MemHostRegister(void* p, size_t size, unsigned int flags) {
  FAKE_NEEDS_CONTEXT();
  constexpr unsigned kKnown = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |
                              CU_MEMHOSTREGISTER_READ_ONLY;
  uintptr_t at = reinterpret_cast<uintptr_t>(p);
  if ((flags & ~kKnown) != 0 || size == 0 || at % 4096 != 0 || size % 4096 != 0) return CUDA_ERROR_INVALID_VALUE;
  bool read_only = (flags & CU_MEMHOSTREGISTER_READ_ONLY) != 0;
  if (read_only && EnvU64("FAKE_CUDA_NO_READ_ONLY_HOST_REGISTER", 0) != 0) return CUDA_ERROR_NOT_SUPPORTED;
  if (!read_only && !HostWritable(at, size)) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> lock(S().mu);
  auto next = S().mappings.lower_bound(at);
  if ((next != S().mappings.end() && next->first < at + size) ||
      (next != S().mappings.begin() && std::prev(next)->first + std::prev(next)->second.size > at)) {
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  }
  if (HostRegisteredBytes() + size > EnvU64("FAKE_CUDA_HOST_REGISTER_LIMIT", UINT64_MAX)) return CUDA_ERROR_OUT_OF_MEMORY;
  S().mappings[at] = Mapping{size, -1, PROT_READ | (read_only ? 0 : PROT_WRITE), Kind::kHost, flags};
  return CUDA_SUCCESS;
}
CUresult MemHostUnregister(void* p) {
  FAKE_NEEDS_CONTEXT();
  std::lock_guard<std::mutex> lock(S().mu);
  auto it = S().mappings.find(reinterpret_cast<uintptr_t>(p));
  if (it == S().mappings.end() || it->second.kind != Kind::kHost) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  FaultInFlightReads(it->first, it->second.size);  // a queued copy still reading it faults, as on a GPU
  S().mappings.erase(it);
  return CUDA_SUCCESS;
}
CUresult MemHostGetDevicePointer(CUdeviceptr* d, void* p, unsigned int flags) {
  FAKE_NEEDS_CONTEXT();
  std::lock_guard<std::mutex> lock(S().mu);
  if (flags != 0 || Find(reinterpret_cast<uintptr_t>(p), 1) == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *d = reinterpret_cast<uintptr_t>(p);
  return CUDA_SUCCESS;
}

// --- the entry points ------------------------------------------------------------------

struct Entry {
  const char* name;
  void* fn;
};

// Each function is cast to the exact type weightd resolves it as.
#define FAKE_ENTRY(name, abi) {"cu" #name, reinterpret_cast<void*>(static_cast<PFN_cu##name##_v##abi>(&name))}
const Entry kEntries[] = {
    FAKE_ENTRY(GetErrorName, 6000), FAKE_ENTRY(GetErrorString, 6000), FAKE_ENTRY(Init, 2000),
    FAKE_ENTRY(DeviceGet, 2000), FAKE_ENTRY(DeviceGetCount, 2000), FAKE_ENTRY(DeviceGetName, 2000),
    FAKE_ENTRY(DeviceTotalMem, 3020), FAKE_ENTRY(DeviceGetUuid, 11040), FAKE_ENTRY(DeviceGetAttribute, 2000),
    FAKE_ENTRY(DevicePrimaryCtxRetain, 7000), FAKE_ENTRY(DevicePrimaryCtxRelease, 11000),
    FAKE_ENTRY(CtxPushCurrent, 4000), FAKE_ENTRY(CtxPopCurrent, 4000), FAKE_ENTRY(CtxSynchronize, 2000),
    FAKE_ENTRY(StreamCreate, 2000), FAKE_ENTRY(StreamDestroy, 4000), FAKE_ENTRY(StreamSynchronize, 2000),
    FAKE_ENTRY(EventCreate, 2000), FAKE_ENTRY(EventRecord, 2000), FAKE_ENTRY(EventSynchronize, 2000),
    FAKE_ENTRY(EventDestroy, 4000), FAKE_ENTRY(MemGetInfo, 3020), FAKE_ENTRY(MemGetAllocationGranularity, 10020),
    FAKE_ENTRY(MemCreate, 10020), FAKE_ENTRY(MemRelease, 10020), FAKE_ENTRY(MemExportToShareableHandle, 10020),
    FAKE_ENTRY(MemImportFromShareableHandle, 10020), FAKE_ENTRY(MemAddressReserve, 10020),
    FAKE_ENTRY(MemAddressFree, 10020), FAKE_ENTRY(MemMap, 10020), FAKE_ENTRY(MemUnmap, 10020),
    FAKE_ENTRY(MemSetAccess, 10020), FAKE_ENTRY(MemGetAccess, 10020), FAKE_ENTRY(MemAlloc, 3020), FAKE_ENTRY(MemGetAddressRange, 3020),
    FAKE_ENTRY(MemFree, 3020), FAKE_ENTRY(MemsetD8, 3020), FAKE_ENTRY(MemsetD8Async, 3020),
    FAKE_ENTRY(MemcpyHtoD, 3020), FAKE_ENTRY(MemcpyHtoDAsync, 3020), FAKE_ENTRY(MemcpyDtoH, 3020), FAKE_ENTRY(MemcpyDtoDAsync, 3020),
    FAKE_ENTRY(Memcpy2DAsync, 3020), FAKE_ENTRY(MemHostAlloc, 2020), FAKE_ENTRY(MemFreeHost, 2000),
    FAKE_ENTRY(MemHostRegister, 6050), FAKE_ENTRY(MemHostUnregister, 4000),
    FAKE_ENTRY(MemHostGetDevicePointer, 3020), FAKE_ENTRY(IpcGetMemHandle, 4010),
    FAKE_ENTRY(IpcOpenMemHandle, 11000), FAKE_ENTRY(IpcCloseMemHandle, 4010),
};
#undef FAKE_ENTRY

}  // namespace

extern "C" {

// For tests: copies up to `capacity` registered host ranges (base, bytes,
// cuMemHostRegister flags) in address order; returns how many there are.
__attribute__((visibility("default"))) int weightd_fake_cuda_host_registrations(uintptr_t* bases, uint64_t* sizes,
                                                                               unsigned* flags, int capacity) {
  std::lock_guard<std::mutex> lock(S().mu);
  int n = 0;
  for (const auto& [base, m] : S().mappings) {
    if (m.kind != Kind::kHost) continue;
    if (n < capacity) {
      bases[n] = base;
      sizes[n] = m.size;
      flags[n] = m.host_flags;
    }
    ++n;
  }
  return n;
}

__attribute__((visibility("default"))) CUresult cuDriverGetVersion(int* version) {
  *version = 12080;
  return CUDA_SUCCESS;
}

// Symbols at ABI 12000 only: that is what weightd asks for.
__attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version,
                                                                    cuuint64_t flags,
                                                                    CUdriverProcAddressQueryResult* status) {
  *pfn = nullptr;
  if (version > 12080) return CUDA_ERROR_INVALID_VALUE;
  for (const Entry& e : kEntries) {
    if (strcmp(e.name, symbol) == 0) {
      bool ok = version == 12000 && flags == CU_GET_PROC_ADDRESS_LEGACY_STREAM;
      if (ok) *pfn = e.fn;
      if (status != nullptr) *status = ok ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      return CUDA_SUCCESS;
    }
  }
  if (status != nullptr) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_SUCCESS;
}

}  // extern "C"
