// The weightd C++ client library: talk to the daemon, attach a model and map
// its tensors zero-copy. No gRPC or protobuf type appears in this header.
//
// Typical use:
//   auto client = weightd::Client::Connect("unix:///run/weightd/weightd.sock");
//   absl::StatusOr<weightd::MappedModel> model = (*client)->Attach("llama", /*rank=*/0);
//   const weightd::TensorView* w = model->Find("model.embed_tokens.weight");
//   // w->data is valid, read-only, for as long as `model` lives.
//
// Errors are absl::Status with the daemon's gRPC code and message
// (UNAVAILABLE when the daemon cannot be reached).
// Across a daemon restart (or an in-place upgrade), mappings stay valid,
// leases of the old daemon are gone, and a Client reconnects on its next
// call once the daemon is back (a call while it is down: UNAVAILABLE).
//
// Thread-safety: a Client may be used from many threads at once; a
// MappedModel is immutable and may be read from any thread.
#ifndef WEIGHTD_CLIENT_INCLUDE_WEIGHTD_CLIENT_H_
#define WEIGHTD_CLIENT_INCLUDE_WEIGHTD_CLIENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

struct DLManagedTensor;  // <dlpack/dlpack.h>

namespace weightd {

enum class Location { kHost, kDevice };

// One tensor of a rank's manifest. Shapes are in elements, sizes in bytes.
struct TensorInfo {
  std::string name;
  std::string dtype;               // safetensors spelling: "BF16", "F8_E4M3", ...
  std::vector<uint64_t> shape;     // this rank's shape
  Location location = Location::kHost;
  uint32_t segment = 0;            // index into the manifest's segments
  uint64_t offset = 0;             // bytes into the segment
  uint64_t nbytes = 0;
  std::vector<uint64_t> full_shape;  // the checkpoint tensor's shape
  int split_dim = -1;                // -1: not split
  uint64_t split_start = 0;          // first index along split_dim
  std::string content_hash;          // 16 hex digits, of the full checkpoint tensor
                                     // (of this tensor's bytes, for a layout tensor)
  // Layout tensors only: strides in elements, as torch.Tensor.stride()
  // gives them; empty: contiguous (row-major). nbytes then covers the
  // elements the strides reach: (1 + sum((shape[i] - 1) * strides[i])) elements.
  std::vector<uint64_t> strides = {};
};

// One segment of a rank's manifest (the daemon's counterpart is
// SegmentRecord in server/model/model.h).
struct SegmentInfo {
  Location location = Location::kHost;
  uint64_t size = 0;
  std::string backend;   // "memfd", "emulated", "cuda-vmm", "cuda-legacy-ipc"
  std::string gpu_uuid;
  std::string handle;    // cuda-legacy-ipc: cudaIpcMemHandle_t bytes
  // Whether its fd arrives on the fd socket (SegmentDescriptor.export_kind
  // EXPORT_FD); false: imported from `handle`.
  bool fd_attached = true;
};

struct Manifest {
  std::string model;
  uint64_t generation = 0;
  uint32_t rank = 0;
  std::string fingerprint;
  std::string version_label;  // a writer's tag of the generation (e.g. "step-1200"); "" for loads from disk
  // Attach only: the NUMA node whose copy of the host segments is mapped, for
  // a model loaded with LoadOptions::numa_copies; -1 otherwise.
  int numa_node = -1;
  std::vector<SegmentInfo> segments;
  std::vector<TensorInfo> tensors;
  // Attach of a runtime layout (AttachOptions::layout): its key and the
  // identity it was published with; "" and empty otherwise. `fingerprint`
  // is then the layout's.
  std::string layout = {};
  std::map<std::string, std::string> identity = {};
};

// A tensor as mapped in this process.
struct TensorView {
  const TensorInfo* info = nullptr;  // owned by the MappedModel
  // Host address or device pointer: read-only, or private and writable when
  // attached with AttachOptions::copy_on_write (const_cast to write).
  const void* data = nullptr;
  uint64_t nbytes = 0;
  Location location = Location::kHost;
  std::string gpu_uuid;  // device tensors
  int device_ordinal = -1;  // this process's CUDA ordinal for gpu_uuid
};

// One published runtime layout of a generation (docs/api.md "Runtime
// layouts"; LayoutInfo in the proto).
struct LayoutSummary {
  std::string key;   // the engine's name for it, e.g. "vllm/fp8-marlin/tp2"
  uint32_t rank = 0;
  std::map<std::string, std::string> identity;
  uint64_t generation = 0;  // the model generation it belongs to
  uint32_t tensor_count = 0;
  uint64_t host_bytes = 0;
  std::map<std::string, uint64_t> device_bytes;  // by GPU UUID
  uint32_t leases = 0;                           // active leases on this layout
  std::string fingerprint;                       // 32 hex digits
  double publish_seconds = 0;                    // sealing, hashing and device copies at commit
  double published_at = 0;                       // seconds since the Unix epoch
};

struct ModelSummary {
  std::string name;
  uint64_t generation = 0;
  std::string state;  // LOADING, READY, FAILED, DRAINING
  std::string checkpoint_path;
  uint64_t checkpoint_bytes = 0;  // tensor bytes read from the checkpoint
  uint64_t host_bytes = 0;
  uint64_t locked_bytes = 0;     // of host_bytes, mlock()ed (0 until the daemon has pinned them)
  uint64_t huge_page_bytes = 0;  // of host_bytes, on 2 MiB pages
  std::map<std::string, uint64_t> device_bytes;  // by GPU UUID
  uint32_t leases = 0;
  std::string fingerprint;
  uint32_t tensor_count = 0;
  uint32_t tp_size = 1;
  double load_seconds = 0;
  std::vector<std::string> warnings;  // advisory catalog findings
  uint64_t bytes_done = 0;   // LOADING: tensor bytes read so far; FAILED: those the load reached
  uint64_t bytes_total = 0;  // LOADING, FAILED: tensor bytes of the checkpoint
  std::string error;         // FAILED: "CODE: message" of the failed load
  // Where this generation's bytes came from: tensor bytes read from storage
  // (or written by a writer), and segment bytes shared with the generation before.
  uint64_t bytes_read = 0;
  uint64_t bytes_shared = 0;
  std::string version_label;  // a writer's tag of the generation (e.g. "step-1200"); "" for loads from disk
  std::string source;         // where its bytes came from: "storage", "writer", or "peer HOST:PORT"
  std::vector<int> numa_nodes;  // nodes holding a copy of the host segments (numa_copies); empty: one copy
  std::vector<LayoutSummary> layouts = {};  // the runtime layouts published on this generation
};

// What UpgradeDaemon started.
struct UpgradeInfo {
  std::string binary;           // the path the daemon re-executes
  std::string daemon_instance;  // the instance that is stopping
  uint32_t models = 0;          // READY models it hands over
};

struct LoadOptions {
  std::vector<std::string> host_resident_patterns;
  // A subset load: only tensors whose name contains one of
  // `include_patterns` (empty: every tensor) and none of `exclude_patterns`
  // (substrings, never empty; at most 1024 of at most 1024 bytes each, like
  // every pattern list). The manifest and fingerprint cover just those.
  std::vector<std::string> include_patterns;
  std::vector<std::string> exclude_patterns;
  uint32_t tp_size = 1;
  std::vector<std::pair<std::string, uint32_t>> tp_rules;  // {pattern, dim}
  std::vector<std::string> devices;                        // GPU UUIDs or ordinals, one per rank
  // Other nodes' weightd peer addresses (HOST:PORT), asked in order to seed
  // the model from their memory before storage is read (docs/operations.md
  // "Peer seeding"); at most 64.
  std::vector<std::string> peers;
  // One copy of the host segments per NUMA node, each bound to its node
  // (docs/devices.md "NUMA copies"); attaches map their node's copy.
  bool numa_copies = false;
};

// Pinned host tables (docs/api.md, "Pinned host tables"): host tensors a GPU
// client's kernels read in place. Attach registers their pages with CUDA
// (cuMemHostRegister: device-mapped, portable to every context, and
// read-only where the GPU supports it) on a background thread, in chunks;
// the attach itself does not wait. MappedModel::pin_status() reports
// progress, WaitPinned() readiness, device_ptr() each tensor's device address.
struct PinOptions {
  // Host tensors whose name contains one of these substrings are pinned;
  // "" matches every name, so {""} (AllHostTensors()) pins every host
  // tensor. Empty: nothing is pinned (the default). Device-placed tensors
  // are never pinned. A pattern that matches no host tensor makes Attach
  // fail with INVALID_ARGUMENT naming it.
  std::vector<std::string> patterns;
  // The most bytes one cuMemHostRegister call covers (rounded down to 4 KiB
  // pages; 4 KiB to 64 GiB, else INVALID_ARGUMENT): a detach waits for at
  // most one call in flight. A tensor larger than this is one registration.
  uint64_t chunk_bytes = uint64_t{1} << 30;
  // This process's CUDA ordinal whose primary context registers (it decides
  // whether READ_ONLY is supported; the device pointers work on every GPU);
  // -1: the GPU of the model's first CUDA arena, else 0.
  int device_ordinal = -1;

  static PinOptions AllHostTensors() { return PinOptions{{""}}; }
};

// Where pinning stands (MappedModel::pin_status()).
struct PinStatus {
  // "NOT_PINNED" (attached without PinOptions::patterns), "REGISTERING",
  // "READY", "FAILED" (see error; nothing stays registered) or "STOPPED".
  std::string state = "NOT_PINNED";
  uint64_t bytes_done = 0, bytes_total = 0;   // page bytes registered / to register
  uint32_t chunks_done = 0, chunks_total = 0;  // cuMemHostRegister calls
  uint32_t tensors = 0;                        // tensors pinned, once READY
  bool read_only = false;  // registered with CU_MEMHOSTREGISTER_READ_ONLY
  int device_ordinal = -1;  // of the registering context, once the driver is loaded
  double register_seconds = 0;  // inside cuMemHostRegister
  double seconds = 0;           // since Attach started it, until READY/FAILED/STOPPED
  absl::Status error;           // FAILED: the driver's error, naming segment, bytes and tensor
};

struct AttachOptions {
  // Map segments privately (MAP_PRIVATE of the sealed memfd, PROT_READ |
  // PROT_WRITE): reads share the daemon's pages; a write copies only the page
  // it touches (4 KiB; 2 MiB on huge-page segments) into this process and is
  // seen by no other process; the daemon's copy never changes. For engines
  // that post-process weights in place. Cost: every written page is private
  // memory of this process (Private_Dirty in /proc/PID/smaps). Host segments
  // and emulated arenas only: a CUDA arena makes Attach fail with
  // FAILED_PRECONDITION (copy those tensors instead).
  bool copy_on_write = false;
  // Populate this process's page tables for every host segment during
  // Attach (madvise MADV_POPULATE_READ, or a read of each page on kernels
  // before 5.14; common/memory/host_segment.h PrefaultMapping), so the
  // first pass over the weights takes no page fault. Attach then costs about
  // what those faults would (measured in docs/performance.md, "Attach");
  // reading only, so a copy-on-write mapping still shares every page.
  // Device arenas are not affected. Errors: RESOURCE_EXHAUSTED when the
  // kernel cannot map the pages.
  bool prefault = false;
  // Ask for the packed tensor table (AttachRequest.manifest_encoding
  // PACKED_TABLE_V1, docs/api.md): one byte string per rank, decoded without
  // a message per tensor. false asks for one TensorEntry per tensor, as
  // clients before it did; for comparisons only, the result is the same.
  // A daemon that predates the table answers with TensorEntry messages
  // either way.
  bool packed_manifest = true;
  // For a model loaded with LoadOptions::numa_copies: map the copy on this
  // NUMA node (FAILED_PRECONDITION when it has none there). Unset: the copy
  // on the node of this process's CPUs (Attach sends its
  // sched_getaffinity(2) set; the daemon maps CPUs to nodes). Pin the
  // process (taskset, numactl, a cpuset) before attaching.
  std::optional<int> numa_node = std::nullopt;
  // Pin host tensors for GPU reads (see PinOptions). Cannot be combined with
  // copy_on_write (INVALID_ARGUMENT): a page written after registration
  // would be copied for this process while the GPU kept reading the shared
  // one. Without a CUDA driver or GPU the attach still succeeds and
  // pin_status() turns FAILED with UNAVAILABLE ("libcuda.so.1 not found",
  // "no CUDA device").
  PinOptions pin = {};
  // A runtime layout of the current generation instead of its checkpoint
  // tensors (docs/api.md "Runtime layouts"): the mapped model's tensors are
  // the layout's (names, dtypes, shapes and strides as its writer declared
  // them; TensorInfo::strides). Empty: the checkpoint tensors. Errors:
  // NOT_FOUND naming the keys published for this generation and rank;
  // FAILED_PRECONDITION naming every field that differs when `identity` is
  // not empty and not equal to the published identity; INVALID_ARGUMENT for
  // a malformed key or identity. The lease holds the generation too.
  std::string layout = {};
  // The identity the layout must have been published with; empty: any.
  std::map<std::string, std::string> identity = {};
};

struct LoadProgressInfo {
  std::string phase;  // CATALOG, PLAN, ALLOCATE, READ, SEAL, DONE
  uint64_t bytes_done = 0, bytes_total = 0;
  uint32_t files_done = 0, files_total = 0;
  double seconds = 0;
};

struct LoadResult {
  ModelSummary model;
  bool reused = false;  // an identical READY generation was reused
  uint64_t bytes_read = 0;    // tensor bytes this load read from storage (0 when reused)
  uint64_t bytes_reused = 0;  // tensor bytes of unchanged files shared with the generation before
};

// A leased, mapped model. Owns its mappings and its lease (the fd-socket
// connection): destroying it unmaps everything and ends the lease. Move-only.
class MappedModel {
 public:
  MappedModel(MappedModel&&) noexcept;
  MappedModel& operator=(MappedModel&&) noexcept;
  ~MappedModel();

  const Manifest& manifest() const;
  const std::vector<TensorView>& tensors() const;  // in manifest (checkpoint) order
  // nullptr when the rank holds no tensor called `name`. O(1); the first
  // call builds the name index (about 0.1 us per tensor, docs/performance.md).
  const TensorView* Find(absl::string_view name) const;
  const std::string& fingerprint() const { return manifest().fingerprint; }
  double attach_seconds() const;  // Attach RPC to all views ready
  // Copies `n` bytes at byte `offset` of `view` into host memory `dst`
  // (a memcpy for host tensors, a device-to-host copy for device tensors).
  absl::Status CopyToHost(const TensorView& view, uint64_t offset, void* dst, uint64_t n) const;
  // Whether device mappings are read-only (false when the driver refused
  // read-only access and the mapping fell back to read-write, or for a
  // copy-on-write attach of emulated arenas).
  bool device_read_only() const;
  // Whether this model was attached with AttachOptions::copy_on_write.
  bool copy_on_write() const;

  // Pinning (AttachOptions::pin), from any thread.
  PinStatus pin_status() const;
  // Blocks until every pinned tensor is registered (OK), pinning failed (its
  // error: UNAVAILABLE without a driver or GPU, RESOURCE_EXHAUSTED when the
  // pages cannot be locked, ...), or `timeout` passed (DEADLINE_EXCEEDED
  // with the bytes done). FAILED_PRECONDITION when attached without pin.
  absl::Status WaitPinned(absl::Duration timeout) const;
  // The device address of a pinned host tensor, valid on every GPU of this
  // process for as long as this model or a DLPack tensor of it lives (they
  // unregister the pages when the last of them goes: destroying a
  // MappedModel mid-registration stops after the call in flight and
  // unregisters). 0 until pin_status() is READY, and for tensors not pinned.
  uint64_t device_ptr(const TensorView& view) const;

  // The tensor as a DLPack tensor (DLPack 0.6, <dlpack/dlpack.h>): kDLCUDA
  // with this process's device ordinal, or kDLCPU for host and emulated
  // tensors; byte_offset 0, compact row-major strides. The caller owns the
  // result and must call its deleter (frameworks do); until then it keeps
  // this model's mappings and lease alive, even after the MappedModel is
  // destroyed. UNIMPLEMENTED for dtypes DLPack 0.6 cannot describe
  // (F8_*, F4, F6_*), naming the dtype.
  absl::StatusOr<DLManagedTensor*> ToDLPack(const TensorView& view) const;
  // A pinned host tensor as a kDLCUDA DLPack tensor on the registering
  // device (PinStatus::device_ordinal) at device_ptr(view): a GPU view of
  // the host pages, read over the bus. Ownership as ToDLPack.
  // FAILED_PRECONDITION naming the tensor when it is not pinned or pinning
  // is not READY.
  absl::StatusOr<DLManagedTensor*> ToPinnedDLPack(const TensorView& view) const;

  struct State;  // implementation detail

 private:
  friend class Client;
  explicit MappedModel(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;  // shared with live DLPack tensors
};

// One event of a watched model name (docs/api.md "WatchModel").
struct WatchEvent {
  // "CURRENT", "PUBLISHED", "DRAINING", "FREED", "UNLOADED", or for a
  // runtime layout "LAYOUT_PUBLISHED", "LAYOUT_DROPPED", "LAYOUT_DRAINING"
  std::string kind;
  std::string model;
  uint64_t generation = 0;
  std::string version_label;
  std::string fingerprint;
  double time = 0;  // when it happened, seconds since the Unix epoch
  std::string layout = {};  // LAYOUT_* events: the layout key ("" otherwise)
  uint32_t rank = 0;   // LAYOUT_* events: its rank
};

// A WatchModel stream: a blocking iterator over one name's events. Next()
// from one thread at a time; Cancel() from any thread. Destroying it
// cancels the stream. Move-only.
class ModelWatch {
 public:
  ModelWatch(ModelWatch&&) noexcept;
  ModelWatch& operator=(ModelWatch&&) noexcept;
  ~ModelWatch();

  // Blocks until the next event. Once the stream ended, its reason on every
  // call (never OK): CANCELLED after Cancel(), UNAVAILABLE when the daemon
  // went away or is stopping, RESOURCE_EXHAUSTED when the daemon dropped a
  // watcher that fell behind, or the daemon's refusal of the watch
  // (INVALID_ARGUMENT for a bad name, RESOURCE_EXHAUSTED beyond
  // --max-watchers). Watch again to resume: the first event is then CURRENT.
  absl::StatusOr<WatchEvent> Next();
  // Ends the stream; a Next() blocked in another thread returns CANCELLED.
  void Cancel();

  struct State;  // implementation detail

 private:
  friend class Client;
  explicit ModelWatch(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// TLS for a TCP target (the daemon's --grpc-address with --grpc-tls-*).
// Paths of PEM files; all empty: no TLS.
struct ConnectOptions {
  std::string tls_ca_file;    // CA(s) that signed the daemon's certificate; required for TLS
  std::string tls_cert_file;  // this client's certificate (chain), for mutual TLS; with tls_key_file
  std::string tls_key_file;
};

// A tensor a writer may write: `data` points at its bytes in a writable,
// shared mapping of a staged segment (host memory), valid until the
// Updater (or LayoutWriter) commits, aborts or is destroyed.
struct WritableTensor {
  TensorInfo info;  // info.segment indexes the update's (layout's) staged segments
  uint32_t rank = 0;
  char* data = nullptr;
};

// What a commit published (CommitUpdateResponse).
struct CommitInfo {
  ModelSummary model;  // the new generation
  uint32_t tensors_changed = 0;
  uint64_t bytes_written = 0;  // bytes of the staged segments
  uint64_t bytes_shared = 0;   // bytes shared with the generation before
  double seconds = 0;          // seal, hash, verify and publish, on the daemon
};

class Client;

// One writer's update of a model (Client::BeginUpdate; docs/api.md,
// "Publishing a generation from a writer"). Holds writable mappings of the
// staged segments and the fd-socket connection that is the update's lease:
// destroying an Updater that has not committed unmaps and closes it, and
// the daemon aborts the update. Move-only; not thread-safe: write tensors
// from several threads if you like, but Commit/Abort from one, after those
// writes. Must not outlive the Client that made it.
class Updater {
 public:
  Updater(Updater&&) noexcept;
  Updater& operator=(Updater&&) noexcept;
  ~Updater();

  const std::vector<WritableTensor>& tensors() const;
  // nullptr when the update holds no tensor `name` (rank 0 for host tensors).
  WritableTensor* Find(absl::string_view name, uint32_t rank = 0);
  uint64_t base_generation() const;
  uint64_t bytes_staged() const;  // bytes the daemon copied into staged segments
  uint64_t bytes_shared() const;  // bytes shared unchanged

  // Unmaps every staged segment (the daemon can seal only memory no process
  // maps writable), then asks the daemon to seal, verify and publish.
  // `expected_hashes`: tensor name -> content hash (16 hex digits,
  // TensorInfo::content_hash) that the written bytes must have. After any
  // result the tensors' `data` is no longer valid. Errors: the daemon's
  // (FAILED_PRECONDITION naming a tensor whose hash differs, which aborts).
  absl::StatusOr<CommitInfo> Commit(const std::map<std::string, std::string>& expected_hashes = {},
                                    const std::string& version_label = "");
  // Unmaps and ends the update; the served generation is untouched.
  absl::Status Abort();

  struct State;

 private:
  friend class Client;
  explicit Updater(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// One tensor a layout writer declares (LayoutTensorSpec in the proto).
struct LayoutTensorRequest {
  std::string name;             // 1..1024 bytes, unique in the layout
  std::string dtype;            // safetensors spelling: "BF16", "I8", "F32", ...
  std::vector<uint64_t> shape;  // in elements; at most 16 dims
  // In elements, one per dim (as torch.Tensor.stride()); empty: contiguous.
  // The tensor's bytes are the span the strides reach.
  std::vector<uint64_t> strides;
  Location location = Location::kHost;  // kDevice: on LayoutOptions::gpu_uuid
};

// What to publish (Client::BeginLayout; BeginLayoutRequest in the proto).
struct LayoutOptions {
  std::string model;  // a READY model
  // The engine's name for the layout: 1..256 bytes of [A-Za-z0-9._:/+=-].
  std::string key;
  // The strings that decide the layout (engine and version, layout ABI,
  // quantization, parallel sizes, device arch): at most 64 entries, keys
  // 1..128 bytes of [A-Za-z0-9._-], values at most 1024 printable ASCII bytes.
  std::map<std::string, std::string> identity;
  uint32_t rank = 0;  // a TP rank of the model
  std::vector<LayoutTensorRequest> tensors;  // 1..1,048,576, at most 1 TiB in all
  // The GPU of the device tensors; empty: the rank's GPU in the model's plan.
  std::string gpu_uuid;
  uint64_t generation = 0;  // 0: the current one; else it must be the current one
  // > 0: when another writer is publishing the same (model, generation,
  // key, rank), wait up to this many seconds (at most 3600) for it: a
  // commit answers with a writer that is published_by_other(), an abort
  // with a writer grant. 0: ALREADY_EXISTS at once.
  double wait_seconds = 0;
};

// What CommitLayout published.
struct LayoutCommitInfo {
  LayoutSummary layout;
  double seconds = 0;  // sealing, hashing, device copies and publishing, on the daemon
};

// One writer's publish of a runtime layout (Client::BeginLayout; docs/api.md
// "Runtime layouts"). Holds writable shared mappings of the staged memfds
// the daemon made (host memory, also for device tensors: the daemon copies
// those to its own arena on the GPU at commit) and the fd-socket connection
// that is the publish's lease: destroying a LayoutWriter that has not
// committed unmaps and closes it, and the daemon aborts the publish
// (nothing is published, the staged memory is freed). Every tensor starts
// zero-filled; write only its `nbytes` bytes (the daemon refuses a commit
// when a byte outside every tensor is not zero). Move-only; not
// thread-safe: write tensors from several threads if you like, but
// Commit/Abort from one, after those writes. Must not outlive the Client
// that made it.
class LayoutWriter {
 public:
  LayoutWriter(LayoutWriter&&) noexcept;
  LayoutWriter& operator=(LayoutWriter&&) noexcept;
  ~LayoutWriter();

  // Another writer committed the layout while this one waited
  // (LayoutOptions::wait_seconds): there is nothing to write, tensors() is
  // empty, Commit() is FAILED_PRECONDITION; attach the layout instead.
  bool published_by_other() const;
  // The staged tensors in request order: info.name/dtype/shape/strides as
  // declared, info.location the declared placement, `data` a writable
  // pointer to info.nbytes bytes (host memory even for device tensors),
  // valid until Commit or Abort; nullptr after them.
  const std::vector<WritableTensor>& tensors() const;
  // nullptr when the layout holds no tensor `name`.
  WritableTensor* Find(absl::string_view name);
  const std::string& model() const;
  uint64_t generation() const;  // the generation the layout belongs to
  uint32_t rank() const;
  uint64_t bytes_staged() const;  // bytes of the staged memfds
  // The staged memfds (this writer owns them), in segment order, for a
  // writer that fills them with pwrite(2) or splice(2) rather than through
  // `data`; empty once committed or aborted. A writable mapping of one of them
  // that is still alive at Commit makes it fail (FAILED_PRECONDITION
  // "still mapped writable"). Empty when published_by_other().
  std::vector<int> staged_fds() const;

  // Unmaps this writer's writable mappings (the daemon can seal only memory
  // no process maps writable), then asks the daemon to seal, verify, hash
  // and publish; after a success closes the staged fds. `expected_hashes`:
  // tensor name -> xxh3-64 content hash (16 hex digits) its bytes must have.
  // Errors: the daemon's. FAILED_PRECONDITION "still mapped writable" when
  // another mapping of a staged memfd is writable, or INVALID_ARGUMENT for a
  // malformed expected hash: the publish stays open, the tensors are
  // mapped again (new `data` pointers; nullptr for those of a staged memfd
  // the daemon sealed before the refusal), and Commit may be called again.
  // Others (a hash that differs: FAILED_PRECONDITION; a byte outside every
  // tensor) end the publish.
  absl::StatusOr<LayoutCommitInfo> Commit(const std::map<std::string, std::string>& expected_hashes = {});
  // Unmaps and ends the publish; nothing is published. OK when it ended already.
  absl::Status Abort();

  struct State;

 private:
  friend class Client;
  explicit LayoutWriter(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class Client {
 public:
  // `target`: "unix:///run/weightd/weightd.sock", a socket path (absolute,
  // or any value without ':', such as "d1/wd.sock", taken relative to the
  // working directory at this call), or "HOST:PORT". Does not block; the first call reports an unreachable daemon
  // (or a refused TLS handshake) as UNAVAILABLE. INVALID_ARGUMENT/NOT_FOUND
  // for bad `options` (a certificate without its key, an unreadable file).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         const ConnectOptions& options = {});
  ~Client();

  // Loads (or reuses) a model; `progress` is called for each progress message.
  absl::StatusOr<LoadResult> Load(const std::string& name, const std::string& checkpoint_path,
                                  const LoadOptions& options,
                                  const std::function<void(const LoadProgressInfo&)>& progress = nullptr);
  // Loads the next generation of READY model `name` with its plan, from
  // `checkpoint_path` (empty: the path it was loaded from), reading only the
  // files that changed (ReloadModel in proto/weightd/v1/weightd.proto).
  absl::StatusOr<LoadResult> Reload(const std::string& name, const std::string& checkpoint_path,
                                    const std::function<void(const LoadProgressInfo&)>& progress = nullptr);
  absl::StatusOr<std::vector<ModelSummary>> List();
  // Opens an update of `tensors` (empty: all) of READY model `name`: the
  // daemon stages writable copies of the segments holding them (initialised
  // with the current bytes), this claims and maps them read-write.
  // ALREADY_EXISTS while another writer has an update of `name` open.
  // Device-placed tensors are written whole into host staging memory; the
  // daemon uploads each rank's part after verifying them.
  absl::StatusOr<Updater> BeginUpdate(const std::string& name, const std::vector<std::string>& tensors = {});
  // Opens the publish of a runtime layout (see LayoutOptions, LayoutWriter):
  // the daemon stages zero-filled memfds for the tensors, this claims them
  // on the fd socket and maps them read-write. Errors: INVALID_ARGUMENT
  // naming the field for a malformed request (key, identity, names, dtype,
  // dims, strides, sizes); NOT_FOUND for an unknown model or rank;
  // ALREADY_EXISTS while another writer publishes the same layout or when
  // it is published (without wait_seconds); DEADLINE_EXCEEDED when the
  // other writer neither commits nor aborts within wait_seconds;
  // FAILED_PRECONDITION for device tensors without a GPU, or a generation
  // that is not the current one; RESOURCE_EXHAUSTED when memory is short.
  absl::StatusOr<LayoutWriter> BeginLayout(const LayoutOptions& options);
  // Removes published layout `key` of model `name` (of `rank`, or of every
  // rank): no new attaches; leases on it keep its memory until they end.
  // Returns how many layouts were removed. NOT_FOUND naming the layouts the
  // generation has when none matched.
  absl::StatusOr<uint32_t> DropLayout(const std::string& name, const std::string& key,
                                      std::optional<uint32_t> rank = std::nullopt);
  absl::StatusOr<Manifest> GetManifest(const std::string& name, uint32_t rank);
  // Takes a lease, receives the segment fds and maps them lazily (pages fault
  // in on first use) or prefaulted: read-only, or copy-on-write (see
  // AttachOptions). DATA_LOSS when the daemon's packed tensor table is
  // malformed (naming the field), INTERNAL when a tensor lies outside its
  // segment.
  absl::StatusOr<MappedModel> Attach(const std::string& name, uint32_t rank, const AttachOptions& options = {});
  // Returns the model as it was when unloaded; `freed` is false while
  // leases keep it DRAINING. `force` ends the leases at once, except claimed
  // leases on cuda-legacy-ipc arenas (docs/api.md).
  absl::StatusOr<std::pair<ModelSummary, bool>> Unload(const std::string& name, bool force);
  // Watches `name`'s events, loaded or not: CURRENT first when it has a
  // READY generation, then every PUBLISHED, DRAINING, FREED and UNLOADED in
  // order. Returns once the daemon subscribed, so no event that happens
  // after the return is missed. INVALID_ARGUMENT for a bad name,
  // RESOURCE_EXHAUSTED beyond the daemon's --max-watchers, UNAVAILABLE when
  // the daemon cannot be reached or is stopping. The stream may outlive
  // this Client.
  absl::StatusOr<ModelWatch> Watch(const std::string& name);
  // The standard gRPC health check (grpc.health.v1) of `service`: "" for the
  // daemon as a whole, or a model name (SERVING once READY). Returns
  // "SERVING", "NOT_SERVING" or "SERVICE_UNKNOWN" (a name never loaded);
  // UNAVAILABLE when the daemon cannot be reached.
  absl::StatusOr<std::string> Health(const std::string& service);
  // Asks the daemon to upgrade in place (UpgradeDaemon in the proto): it
  // re-executes its binary and serves every READY model again without
  // reading a checkpoint. Returns before the daemon stops; it is back when
  // DaemonInstance() answers with another value. FAILED_PRECONDITION when
  // the binary cannot be executed, PERMISSION_DENIED over TCP.
  absl::StatusOr<UpgradeInfo> UpgradeDaemon();
  // The daemon's instance: random per daemon process image, so it changes
  // when the daemon restarts or upgrades (its leases are then gone).
  absl::StatusOr<std::string> DaemonInstance();
  // DaemonInstance(), when this image is the fallback of an in-place
  // upgrade whose new binary could not be executed, why (else ""), and
  // List()'s models: all from one ListModels call, so the models are the
  // ones that instance serves.
  struct DaemonState {
    std::string instance;
    std::string last_upgrade_error;
    std::vector<ModelSummary> models;
  };
  absl::StatusOr<DaemonState> Daemon();

  struct Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_INCLUDE_WEIGHTD_CLIENT_H_
