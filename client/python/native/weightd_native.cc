// weightd._native: the small native part of the Python client.
//
// It maps a segment fd (read-only and shared, or copy-on-write) and exports
// byte ranges of the mapping as DLPack capsules. It deliberately holds no gRPC or protobuf code, so it can
// never load a second, clashing copy of them next to torch or grpcio (see
// docs/integration.md); the control RPCs go through grpcio in Python.
//
// Ownership: a Segment owns one mapping and unmaps it when Python frees it.
// Each exported DLManagedTensor holds a strong reference to an `owner` object
// (the Python lease, which holds the Segments), released by the DLPack
// deleter, so a framework tensor keeps its mapping and its lease alive.
// Thread-safety: called with the GIL held; the deleter takes the GIL itself
// and may run on any thread.
#include <Python.h>
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "client/dlpack_dtype.h"
#include "common/format/content_hash.h"
#include "common/format/packed_manifest.h"
#include "common/memory/device.h"
#include "common/memory/host_pinner.h"
#include "common/memory/host_registrar.h"
#include "common/memory/host_segment.h"

namespace py = pybind11;

namespace {

using weightd::DlpackDtype;
using weightd::FindDlpackDtype;

// The DLPack type of `dtype` (client/dlpack_dtype.h: the 8-bit floats as
// uint8 carriers that the Python side reinterprets with Tensor.view).
const DlpackDtype& LookupDtype(const std::string& dtype) {
  if (const DlpackDtype* d = FindDlpackDtype(dtype)) return *d;
  throw py::value_error("safetensors dtype " + dtype +
                        " has no DLPack equivalent (weightd exports F64, F32, F16, BF16, C64, I8-I64, U8-U64, BOOL, "
                        "and the 8-bit floats as uint8); use Tensor.raw() for its bytes");
}

// Raises RuntimeError(message) with attribute `code`: the absl (= gRPC)
// status code number, which the Python side turns into a WeightdError.
[[noreturn]] void ThrowStatus(const std::string& what, const absl::Status& status) {
  py::object error = py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(what + std::string(status.message()));
  error.attr("code") = static_cast<int>(status.code());
  PyErr_SetObject(PyExc_RuntimeError, error.ptr());
  throw py::error_already_set();
}

// A DLManagedTensor and the arrays its DLTensor points into, freed together.
struct ExportedTensor {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  PyObject* owner = nullptr;  // strong reference
};

bool InterpreterAlive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

void DeleteExport(DLManagedTensor* managed) {
  auto* e = static_cast<ExportedTensor*>(managed->manager_ctx);
  // During interpreter shutdown the owner is left to the OS: taking the GIL
  // then may hang, and the process is exiting anyway.
  if (InterpreterAlive()) {
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_XDECREF(e->owner);
    PyGILState_Release(gil);
  }
  delete e;
}

// Frees the tensor when no consumer took the capsule (a consumer renames it
// to "used_dltensor" and becomes responsible for calling the deleter).
void DestroyCapsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

// A "dltensor" capsule viewing `nbytes` at `data` on `device` as `dtype`
// with `shape` (C-contiguous); `owner` stays referenced until the consumer
// drops the tensor.
py::capsule MakeCapsule(void* data, DLDevice device, uint64_t nbytes, const std::string& dtype,
                        const std::vector<int64_t>& shape, py::object owner) {
  const DlpackDtype& info = LookupDtype(dtype);
  uint64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0) throw py::value_error("negative dimension in shape");
    if (d != 0 && elements > UINT64_MAX / static_cast<uint64_t>(d)) throw py::value_error("shape overflows");
    elements *= static_cast<uint64_t>(d);
  }
  if (elements > UINT64_MAX / (info.bits / 8) || elements * (info.bits / 8) != nbytes) {
    throw py::value_error("tensor of " + std::to_string(nbytes) + " bytes does not hold its shape as " + dtype);
  }
  auto* e = new ExportedTensor;
  e->shape = shape;
  e->strides.assign(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) e->strides[i - 1] = e->strides[i] * shape[i];
  e->owner = owner.release().ptr();
  DLTensor& t = e->managed.dl_tensor;
  t.data = data;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  t.dtype = {info.code, info.bits, 1};
  t.shape = e->shape.empty() ? nullptr : e->shape.data();
  t.strides = e->strides.empty() ? nullptr : e->strides.data();
  t.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = DeleteExport;
  PyObject* capsule = PyCapsule_New(&e->managed, "dltensor", DestroyCapsule);
  if (capsule == nullptr) {
    DeleteExport(&e->managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

class Segment {
 public:
  // Maps `size` bytes of `fd`: read-only and shared, or with
  // `copy_on_write` private and writable; with `prefault` every page is
  // mapped now (common/memory/host_segment.h, MapSegmentFd). The fd may be
  // closed afterwards; the mapping keeps the memory. Raises OSError (with
  // errno) on failure.
  Segment(int fd, uint64_t size, bool copy_on_write, bool prefault) : size_(size), writable_(copy_on_write) {
    if (size == 0) return;
    absl::StatusOr<char*> addr = weightd::MapSegmentFd(fd, size, copy_on_write, prefault);
    if (!addr.ok()) {
      int err = errno;
      errno = err;
      PyErr_SetFromErrnoWithFilename(PyExc_OSError, std::string(addr.status().message()).c_str());
      throw py::error_already_set();
    }
    base_ = *addr;
    mapped_ = true;
  }
  // Imports a device arena with the backend that exported it (common/memory/device.h:
  // CUDA VMM, legacy IPC, or emulated). `fd` is duplicated, not taken; -1 for
  // handle-exported arenas. Raises RuntimeError with `.code` (see ThrowStatus).
  // `copy_on_write` as for host segments where the backend allows it (the
  // emulated one); CUDA backends refuse it.
  static std::unique_ptr<Segment> ImportDevice(const std::string& backend, const std::string& gpu_uuid, uint64_t size,
                                               const py::bytes& handle, int fd, bool copy_on_write) {
    const std::string what = "importing " + backend + " arena on " + gpu_uuid + ": ";
    weightd::ArenaExport exported{backend, gpu_uuid, size, std::string(handle), weightd::ScopedFd(fd >= 0 ? dup(fd) : -1),
                                  copy_on_write};
    absl::StatusOr<std::unique_ptr<weightd::ImportedArena>> arena = weightd::ImportArena(std::move(exported));
    if (!arena.ok()) ThrowStatus(what, arena.status());
    auto segment = std::unique_ptr<Segment>(new Segment());
    segment->size_ = size;
    segment->base_ = static_cast<char*>(const_cast<void*>((*arena)->device_pointer()));
    // Emulated device memory is host memory; real device memory is kDLCUDA.
    absl::StatusOr<weightd::SegmentBackend> kind = weightd::ParseSegmentBackend(backend);
    bool emulated = kind.ok() && *kind == weightd::SegmentBackend::kEmulated;
    segment->device_ = emulated ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, (*arena)->device_ordinal()};
    segment->writable_ = !(*arena)->read_only();
    segment->arena_ = std::move(*arena);
    return segment;
  }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() { Close(); }
  // Unmaps now rather than when Python frees the object (a device import
  // first waits for this process's queued GPU work): the lease calls it on
  // every segment before it ends, since for cuda-legacy-ipc the daemon may
  // free the memory once the lease is gone. Idempotent; later use raises.
  void Close() {
    if (mapped_) munmap(base_, size_);
    mapped_ = false;
    arena_.reset();
    base_ = nullptr;
    closed_ = true;
  }
  bool closed() const { return closed_; }

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(base_); }
  uint64_t size() const { return size_; }
  py::tuple device() const { return py::make_tuple(static_cast<int>(device_.device_type), device_.device_id); }
  bool read_only() const { return !writable_; }
  // Copies bytes to host memory: memcpy for host mappings, the backend's
  // device-to-host copy for device arenas.
  py::bytes CopyToHost(uint64_t offset, uint64_t n) const {
    CheckOpen();
    if (offset > size_ || n > size_ - offset) throw py::value_error("byte range lies outside the segment");
    std::string out(n, '\0');
    if (arena_ == nullptr) {
      if (n > 0) std::memcpy(out.data(), base_ + offset, n);
    } else {
      absl::Status copied = arena_->CopyToHost(offset, out.data(), n);
      if (!copied.ok()) throw std::runtime_error(std::string(copied.message()));
    }
    return py::bytes(out);
  }

  // A "dltensor" capsule viewing [offset, offset + nbytes) as `dtype` with
  // `shape` (C-contiguous). `owner` stays referenced until the consumer
  // drops the tensor; it must keep this Segment alive.
  py::capsule Export(uint64_t offset, uint64_t nbytes, const std::string& dtype, const std::vector<int64_t>& shape,
                     py::object owner) const {
    CheckOpen();
    LookupDtype(dtype);  // a dtype error before a range error
    if (offset > size_ || nbytes > size_ - offset) {
      throw py::value_error("byte range [" + std::to_string(offset) + ", +" + std::to_string(nbytes) +
                            ") lies outside the segment of " + std::to_string(size_) + " bytes");
    }
    // A zero-byte tensor of an empty segment still needs a non-null pointer.
    static char empty_target = 0;
    return MakeCapsule(base_ != nullptr ? base_ + offset : &empty_target, device_, nbytes, dtype, shape,
                       std::move(owner));
  }

 private:
  Segment() = default;
  void CheckOpen() const {
    if (closed_) throw py::value_error("the segment is closed: its lease has ended");
  }

  char* base_ = nullptr;
  uint64_t size_ = 0;
  bool mapped_ = false;  // base_ is our mmap
  bool writable_ = false;  // a copy-on-write mapping (or a device import the driver left writable)
  bool closed_ = false;
  DLDevice device_{kDLCPU, 0};
  std::unique_ptr<weightd::ImportedArena> arena_;  // device arenas
};

// A rank's packed tensor table (AttachResponse.packed_tensors,
// common/format/packed_manifest.h), decoded here so that attaching 100,000
// tensors costs no per-tensor Python code: index() builds the name -> index
// dict in one native loop; info(i) decodes one record when it is asked for.
// Holds a reference to the bytes object it reads. Immutable.
class PackedTable {
 public:
  // Raises RuntimeError with `.code` 15 (DATA_LOSS) naming the broken rule.
  explicit PackedTable(py::bytes data) : data_(std::move(data)) {
    char* buffer = nullptr;
    Py_ssize_t length = 0;
    if (PyBytes_AsStringAndSize(data_.ptr(), &buffer, &length) != 0) throw py::error_already_set();
    absl::StatusOr<weightd::PackedManifest> table = weightd::PackedManifest::Parse(absl::string_view(buffer, length));
    if (!table.ok()) ThrowStatus("", table.status());
    table_.emplace(std::move(*table));
  }

  uint32_t size() const { return table_->size(); }

  // {name: index}; a repeated name maps to its last index (as a dict
  // comprehension over the entries would). DATA_LOSS for a name that is not UTF-8.
  py::dict Index() const {
    // Sized once (CPython's _PyDict_NewPresized): growing 17 times was a third of the time.
    py::dict out = py::reinterpret_steal<py::dict>(_PyDict_NewPresized(table_->size()));
    if (!out) throw py::error_already_set();
    for (uint32_t i = 0; i < table_->size(); ++i) {
      absl::string_view name = table_->Tensor(i).name;
      py::object key = DecodeName(name, i);
      py::object value = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLong(i));
      if (!value || PyDict_SetItem(out.ptr(), key.ptr(), value.ptr()) != 0) throw py::error_already_set();
    }
    return out;
  }

  // The fields of TensorInfo, in its order: (name, dtype, shape, placement,
  // segment, offset, nbytes, full_shape, split_dim, split_start, content_hash).
  py::tuple Info(uint32_t i) const {
    if (i >= table_->size()) throw py::index_error("tensor index out of range");
    weightd::PackedTensor t = table_->Tensor(i);
    py::tuple shape(t.ndim), full(t.full_ndim);
    for (uint32_t k = 0; k < t.ndim; ++k) shape[k] = py::int_(t.Dim(k));
    for (uint32_t k = 0; k < t.full_ndim; ++k) full[k] = py::int_(t.FullDim(k));
    return py::make_tuple(DecodeName(t.name, i), py::str(t.dtype.data(), t.dtype.size()), shape,
                          t.placement == weightd::kPackedPlacementDevice ? "device" : "host", t.segment, t.offset,
                          t.nbytes, full, t.split_dim, t.split_start, weightd::ContentHashHex(t.content_hash));
  }

  // (indices, counts): the host tensors whose name contains any of
  // `patterns`, in table order, and per pattern (host tensors, device
  // tensors) it matches. Patterns are UTF-8 substrings, like names.
  py::tuple Select(const std::vector<std::string>& patterns) const {
    std::vector<uint32_t> selected;
    std::vector<std::pair<uint64_t, uint64_t>> counts(patterns.size());
    for (uint32_t i = 0; i < table_->size(); ++i) {
      weightd::PackedTensor t = table_->Tensor(i);
      bool host = t.placement != weightd::kPackedPlacementDevice, any = false;
      for (size_t p = 0; p < patterns.size(); ++p) {
        if (t.name.find(patterns[p]) == absl::string_view::npos) continue;
        any = true;
        ++(host ? counts[p].first : counts[p].second);
      }
      if (any && host) selected.push_back(i);
    }
    return py::make_tuple(selected, counts);
  }

  // The index of the first tensor that does not lie inside its segment
  // (`segment_sizes` in bytes, by segment index), or -1.
  int64_t FirstOutside(const std::vector<uint64_t>& segment_sizes) const {
    for (uint32_t i = 0; i < table_->size(); ++i) {
      weightd::PackedTensor t = table_->Tensor(i);
      if (t.segment >= segment_sizes.size() || t.offset > segment_sizes[t.segment] ||
          t.nbytes > segment_sizes[t.segment] - t.offset) {
        return i;
      }
    }
    return -1;
  }

 private:
  static py::object DecodeName(absl::string_view name, uint32_t i) {
    PyObject* s = PyUnicode_DecodeUTF8(name.data(), static_cast<Py_ssize_t>(name.size()), "strict");
    if (s == nullptr) {
      PyErr_Clear();
      ThrowStatus("", absl::DataLossError("packed manifest: tensor record " + std::to_string(i) +
                                          ": name is not UTF-8"));
    }
    return py::reinterpret_steal<py::object>(s);
  }

  py::bytes data_;
  std::optional<weightd::PackedManifest> table_;
};

// Pins host tensors for GPU reads: a HostPinner (common/memory/host_pinner.h)
// with the CUDA registrar, which loads libcuda.so.1 on its own thread. The
// Python lease holds it and closes it before unmapping the segments.
class Pinner {
 public:
  // `bases`: each segment's host mapping address (0 for device segments);
  // `tensors`: (name, segment, offset, nbytes). Raises RuntimeError with
  // `.code` 3 (INVALID_ARGUMENT) for a bad chunk size or tensor.
  Pinner(const std::vector<uintptr_t>& bases, const std::vector<uint64_t>& sizes,
         const std::vector<std::tuple<std::string, uint32_t, uint64_t, uint64_t>>& tensors, uint64_t chunk_bytes,
         int device_ordinal) {
    weightd::PinInput input;
    for (uintptr_t b : bases) input.segment_bases.push_back(reinterpret_cast<const char*>(b));
    input.segment_sizes = sizes;
    for (const auto& [name, segment, offset, nbytes] : tensors) input.tensors.push_back({name, segment, offset, nbytes});
    input.chunk_bytes = chunk_bytes;
    absl::StatusOr<std::unique_ptr<weightd::HostPinner>> started = weightd::HostPinner::Start(
        std::move(input), [device_ordinal] { return weightd::MakeCudaHostRegistrar(device_ordinal); });
    if (!started.ok()) ThrowStatus("", started.status());
    pinner_ = std::move(*started);
  }

  // (state, bytes_done, bytes_total, chunks_done, chunks_total, tensors,
  //  read_only, device_ordinal, register_seconds, seconds, error_code, error_message)
  py::tuple Progress() const {
    if (!pinner_) throw py::value_error("the pinner is closed: its lease has ended");
    weightd::PinProgress p = pinner_->progress();
    return py::make_tuple(weightd::PinStateName(p.state), p.bytes_done, p.bytes_total, p.chunks_done, p.chunks_total,
                          p.tensors, p.read_only, p.device_ordinal, p.register_seconds, p.seconds,
                          static_cast<int>(p.error.code()), std::string(p.error.message()));
  }

  // Waits up to `timeout` seconds (without the GIL): returns when ready,
  // raises RuntimeError with `.code` otherwise (4: DEADLINE_EXCEEDED).
  void Wait(double timeout) const {
    if (!pinner_) throw py::value_error("the pinner is closed: its lease has ended");
    absl::Status s;
    {
      py::gil_scoped_release released;
      s = pinner_->Wait(absl::Seconds(timeout));
    }
    if (!s.ok()) ThrowStatus("", s);
  }

  uint64_t DevicePtr(size_t i) const { return pinner_ ? pinner_->DevicePointer(i) : 0; }

  // Stops and unregisters (without the GIL: waits for one registration in
  // flight). Idempotent.
  void Close() {
    py::gil_scoped_release released;
    pinner_.reset();
  }

 private:
  std::unique_ptr<weightd::HostPinner> pinner_;
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "weightd native helpers: segment mappings and DLPack export (no gRPC inside)";
  py::class_<Segment>(m, "Segment")
      .def(py::init<int, uint64_t, bool, bool>(), py::arg("fd"), py::arg("size"), py::arg("copy_on_write") = false,
           py::arg("prefault") = false,
           "Maps `size` bytes of segment `fd` read-only (PROT_READ, MAP_SHARED), or with `copy_on_write` "
           "private and writable (PROT_READ|PROT_WRITE, MAP_PRIVATE): writes copy the touched pages into this process. "
           "`prefault`: populate every page now (MADV_POPULATE_READ), so first use takes no page fault.")
      .def_property_readonly("address", &Segment::address, "base address of the mapping (0 for an empty segment)")
      .def_property_readonly("size", &Segment::size)
      .def_property_readonly("device", &Segment::device, "the DLPack (device_type, device_id) of the memory")
      .def_property_readonly("read_only", &Segment::read_only, "whether the mapping is read-only")
      .def("close", &Segment::Close, "Unmaps now (device imports wait for queued GPU work first); idempotent.")
      .def_property_readonly("closed", &Segment::closed)
      .def("copy_to_host", &Segment::CopyToHost, py::arg("offset"), py::arg("nbytes"), "bytes of the segment, copied")
      .def_static("import_device", &Segment::ImportDevice, py::arg("backend"), py::arg("gpu_uuid"), py::arg("size"),
                  py::arg("handle"), py::arg("fd"), py::arg("copy_on_write") = false,
                  "Imports an exported device arena (cuda-vmm, cuda-legacy-ipc, emulated); `fd` is duplicated. "
                  "`copy_on_write`: emulated arenas only; CUDA backends raise RuntimeError.")
      .def("export", &Segment::Export, py::arg("offset"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"),
           py::arg("owner"), "A DLPack capsule of a byte range; `owner` stays alive until the tensor is dropped.");
  py::class_<PackedTable>(m, "PackedTable")
      .def(py::init<py::bytes>(), py::arg("data"),
           "A validated packed tensor table (AttachResponse.packed_tensors); RuntimeError with .code 15 "
           "(DATA_LOSS) when malformed.")
      .def("__len__", &PackedTable::size)
      .def("index", &PackedTable::Index, "{tensor name: index}, built in one native loop")
      .def("info", &PackedTable::Info, py::arg("i"), "TensorInfo's fields of tensor i, as a tuple")
      .def("first_outside", &PackedTable::FirstOutside, py::arg("segment_sizes"),
           "Index of the first tensor outside its segment, or -1")
      .def("select", &PackedTable::Select, py::arg("patterns"),
           "([indices of host tensors whose name contains a pattern], [(host, device) matches per pattern])");
  py::class_<Pinner>(m, "Pinner")
      .def(py::init<const std::vector<uintptr_t>&, const std::vector<uint64_t>&,
                    const std::vector<std::tuple<std::string, uint32_t, uint64_t, uint64_t>>&, uint64_t, int>(),
           py::arg("bases"), py::arg("sizes"), py::arg("tensors"), py::arg("chunk_bytes"), py::arg("device_ordinal"),
           "Starts registering the pages of `tensors` ((name, segment, offset, nbytes)) of the host mappings at "
           "`bases` with CUDA on a background thread; returns at once.")
      .def("progress", &Pinner::Progress, "the progress as a tuple (weightd._model.PinProgress's fields)")
      .def("wait", &Pinner::Wait, py::arg("timeout"), "Waits until ready; RuntimeError with .code otherwise.")
      .def("device_ptr", &Pinner::DevicePtr, py::arg("i"), "device address of tensor i once ready, else 0")
      .def("close", &Pinner::Close, "Stops and unregisters everything registered; idempotent.");
  m.def(
      "export_pointer",
      [](uintptr_t address, uint64_t nbytes, const std::string& dtype, const std::vector<int64_t>& shape, int device_id,
         py::object owner) {
        if (address == 0) throw py::value_error("no device pointer to export");
        return MakeCapsule(reinterpret_cast<void*>(address), DLDevice{kDLCUDA, device_id}, nbytes, dtype, shape,
                           std::move(owner));
      },
      py::arg("address"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"), py::arg("device_id"), py::arg("owner"),
      "A kDLCUDA DLPack capsule at device `address` (a pinned host tensor's device pointer); `owner` stays alive "
      "until the tensor is dropped.");
  m.def(
      "dlpack_dtype",
      [](const std::string& dtype) {
        const DlpackDtype& d = LookupDtype(dtype);
        return py::make_tuple(d.code, d.bits, 1);
      },
      py::arg("dtype"), "The DLPack (code, bits, lanes) a safetensors dtype is exported as.");
  m.attr("DLPACK_VERSION") = DLPACK_VERSION;
}
