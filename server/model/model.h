// A model generation: one load of a model name, with its segments and the
// manifest of each tensor-parallel rank. Immutable once READY. Its segments
// are reference-counted (shared_ptr): a later generation of the name may
// hold the same sealed segments (a partial reload or a writer's update
// shares what did not change), and a segment's memory lives exactly as long
// as the last generation holding it, itself held by the registry or a lease.
// The registry also keeps records of loads in flight (LOADING) and failed
// (FAILED) as ModelGenerations without segments and with generation 0.
#ifndef WEIGHTD_SERVER_MODEL_MODEL_H_
#define WEIGHTD_SERVER_MODEL_MODEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

#include "common/memory/device.h"
#include "common/format/dtype.h"
#include "common/io/env.h"
#include "common/memory/host_segment.h"
#include "common/memory/segment_backend.h"

namespace weightd {

enum class ModelState { kLoading, kReady, kFailed, kDraining };
// "LOADING", "READY", "FAILED", "DRAINING": the API's spelling
// (weightd.v1.ModelState), used in metrics labels and logs.
std::string ModelStateName(ModelState state);
enum class Placement { kHost, kDevice };

// A {pattern, dim} tensor-parallel rule: tensors whose name contains
// `pattern` are split evenly along `dim`.
struct TpRule {
  std::string pattern;
  uint32_t dim = 0;
};

// "PATTERN:DIM" (weightctl's --tp-rule, a preload plan's tp_rules): the
// pattern is everything before the last ':', non-empty; DIM a decimal
// number. nullopt otherwise.
std::optional<TpRule> ParseTpRule(const std::string& text);

// A load refused for its request (a model name, a path over its bounds, an
// empty TP pattern), before any checkpoint was read: INVALID_ARGUMENT with
// this payload, which weightd_checkpoint_errors_total counts as
// "invalid_request" rather than as a broken checkpoint.
inline constexpr char kInvalidLoadRequestPayload[] = "type.weightd.dev/invalid-load-request";

// A writer's version label: at most this many bytes of printable ASCII
// (0x20-0x7e), so it is safe in logs and metric labels. CommitUpdate refuses
// any other, and restore drops a record that carries one.
inline constexpr size_t kMaxVersionLabelBytes = 128;
absl::Status ValidateVersionLabel(const std::string& label);

// Model names: 1..128 characters of [A-Za-z0-9._-] (safe in paths, logs and
// metric labels). INVALID_ARGUMENT naming the rule otherwise.
inline constexpr size_t kMaxModelNameBytes = 128;
absl::Status ValidateModelName(const std::string& name);

// Bounds on the pattern lists of a load request (host-resident, include,
// exclude, TP rules): at most this many patterns, each at most this many
// bytes. CheckLoadPatterns enforces them.
inline constexpr size_t kMaxLoadPatterns = 1024;
inline constexpr size_t kMaxPatternBytes = 1024;

// What a client asked to load (LoadModelRequest in domain types).
struct LoadRequest {
  std::string name;
  std::string checkpoint_path;
  std::vector<std::string> host_resident_patterns = {};
  // A subset load (a draft model that reads part of a checkpoint): a tensor
  // is loaded when its name contains one of `include_patterns` (empty: every
  // tensor) and none of `exclude_patterns`. The generation's manifest,
  // fingerprint, checkpoint_bytes and memory cover exactly those tensors.
  // Part of the plan. Substrings, as host-resident patterns; never empty.
  std::vector<std::string> include_patterns = {};
  std::vector<std::string> exclude_patterns = {};
  // One copy of every host segment per NUMA node, each copy's pages bound
  // to its node while it is filled (ModelGeneration::numa_copies); a client
  // attaches the copy of the node it runs on. Part of the plan. On a
  // one-node machine: one copy, bound to that node.
  bool numa_copies = false;
  uint32_t tp_size = 1;
  std::vector<TpRule> tp_rules = {};
  std::vector<std::string> devices = {};
  // Peers (HOST:PORT) to seed from before storage (server/peer/peer_join.h);
  // not part of the plan.
  std::vector<std::string> peers = {};
  // Same placement and TP plan (patterns, tp_size, rules, devices), whatever
  // the checkpoint path: a generation loaded with the same plan may share the
  // segments of unchanged files (see LoadGeneration).
  bool SamePlan(const LoadRequest& other) const;
  // Whether tensor `name` is in the subset (include/exclude above).
  bool Selects(const std::string& name) const;
};

// INVALID_ARGUMENT with kInvalidLoadRequestPayload for a pattern list over
// its bounds (kMaxLoadPatterns, kMaxPatternBytes) or an empty include or
// exclude pattern (which would select or drop every tensor), naming the
// option: "--include pattern 2 is empty".
absl::Status CheckLoadPatterns(const LoadRequest& request);

struct TensorRecord {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;       // this rank's shape
  Placement placement = Placement::kHost;
  uint32_t segment = 0;              // index into RankManifest::segments
  uint64_t offset = 0;               // bytes within the segment
  uint64_t nbytes = 0;
  std::vector<uint64_t> full_shape;  // the checkpoint's shape
  int32_t split_dim = -1;            // -1: not split
  uint64_t split_start = 0;
  uint64_t content_hash = 0;         // of the full checkpoint tensor (see loader.h)
};

// One segment of a generation as the daemon serves it (the client library's
// counterpart is weightd::SegmentInfo in client/include/weightd/client.h).
struct SegmentRecord {
  Placement placement = Placement::kHost;
  uint64_t size = 0;
  SegmentBackend backend = SegmentBackend::kMemfd;
  std::string gpu_uuid;  // device segments
  int fd = -1;           // shareable fd (owned by the segment object), or -1
  std::string handle;    // handle bytes for backends that export without an fd
  // Whether the fd channel sends this segment's fd (else clients import it
  // from `handle`); SegmentDescriptor.export_kind says the same on the wire.
  bool exports_fd() const { return fd >= 0; }
  // Index into ModelGeneration::host_segments (host) or ::arenas (device).
  uint32_t owner = 0;
};

struct RankManifest {
  std::vector<uint32_t> segments;  // ids into ModelGeneration::segments, in fd order
  std::vector<TensorRecord> tensors;
};

// What a generation read of one checkpoint file: its name in the
// checkpoint, its identity at open time and the hash of its header. Two
// equal stamps are taken as the same bytes (see FileIdentity).
struct FileStamp {
  std::string name;
  FileIdentity identity;
  uint64_t header_hash = 0;
  bool operator==(const FileStamp&) const = default;
};

// The segments of a generation that hold one checkpoint file's tensors,
// which a later generation may share when the file is unchanged.
struct GenerationFile {
  FileStamp stamp;
  std::vector<uint32_t> host_segments;        // ids into ModelGeneration::segments
  std::vector<std::vector<uint32_t>> arenas;  // [rank] ids into ModelGeneration::segments
};

// Runs a function once, when destroyed (ModelGeneration::on_freed).
class FreedHook {
 public:
  FreedHook() = default;
  FreedHook(const FreedHook&) = delete;
  FreedHook& operator=(const FreedHook&) = delete;
  ~FreedHook() {
    if (fn_) fn_();
  }
  void Set(std::function<void()> fn) { fn_ = std::move(fn); }

 private:
  std::function<void()> fn_;
};

class LayoutSet;  // server/model/layout.h
// An empty LayoutSet (ModelGeneration::layouts).
std::shared_ptr<LayoutSet> MakeLayoutSet();

// One NUMA node's copy of a generation's host segments (LoadRequest::numa_copies).
struct NumaCopy {
  int32_t node = 0;
  std::vector<int> cpus;  // the node's CPUs when the copy was made (ChooseNumaCopy)
  // Ids into ModelGeneration::segments, parallel to the host prefix of every
  // rank's RankManifest::segments (copy 0 is that prefix itself): the same
  // sizes and bytes, on this node's pages.
  std::vector<uint32_t> host_segments;
};

class ModelGeneration {
 public:
  // Runs when the generation is destroyed, after its segments were released:
  // declared first, it is destroyed last. Set by the registry when it
  // publishes the generation (the FREED event, server/model/model_events.h); unset
  // for LOADING and FAILED records. The last reference may go on any
  // thread, with or without the registry's lock held: the function must not
  // call into the registry.
  FreedHook on_freed;

  LoadRequest request;             // checkpoint_path resolved with realpath
  uint64_t generation = 0;
  std::vector<GenerationFile> files;  // parallel to the catalog's files
  std::vector<std::string> warnings;  // the catalog's advisory findings
  // Sealed memory, possibly shared with other generations of the name.
  std::vector<std::shared_ptr<const HostSegment>> host_segments;
  std::vector<std::shared_ptr<DeviceArena>> arenas;  // declared after host_segments: freed first
  // Every segment clients see: host segments first, then each rank's arenas.
  std::vector<SegmentRecord> segments;
  std::vector<RankManifest> ranks;  // tp_size entries
  // Empty: one copy of the host segments, wherever the kernel put its pages.
  // Else one entry per NUMA node, by node id; the extra copies' segments are
  // in `segments` and `host_segments` but in no rank's manifest.
  std::vector<NumaCopy> numa_copies;
  // The segment ids a client of `rank` maps, in fd order: the rank's own,
  // with the host ones of NUMA copy `copy` (an index into numa_copies; -1:
  // the rank's own).
  std::vector<uint32_t> SegmentsOf(uint32_t rank, int copy) const;
  std::string fingerprint;          // 32 hex digits
  std::string version_label;        // set by a writer's commit (e.g. "step-1200"); empty for loads from disk
  // Where its bytes came from: "storage", "writer" (a commit),
  // "peer HOST:PORT" (seeded from that peer; see server/peer/peer_join.h), or
  // "fd store" (restored by a restarted daemon, server/restart/restore.h).
  std::string source;
  // Whether every segment of a file with a stamp (GenerationFile) holds that
  // file's bytes as this daemon read them: a load from storage, a writer's
  // update of one (rewritten files lose their stamp), or a restore of an
  // authenticated record of one. Not a peer's bytes, nor an unauthenticated
  // record's. Only such generations share their segments with other names
  // (server/load/shared_segments.h).
  bool from_files = false;
  double load_seconds = 0;
  uint64_t checkpoint_bytes = 0;  // tensor bytes of the checkpoint
  uint64_t host_bytes = 0;     // bytes of its host segments, shared ones included
  // Of those, the bytes mlock()ed: 0 at publication, set by the registry's
  // pinning thread when it has locked them (read from any thread).
  std::atomic<uint64_t> locked_bytes{0};
  uint64_t huge_page_bytes = 0;  // of host_bytes, those on 2 MiB pages (hugetlb or THP)
  std::string host_pages;        // a load's sentence on its pages: which, why, a fall-back (logged)
  // Where its bytes came from: tensor bytes read from storage, and bytes of
  // segments (host and device) shared with the generation before it.
  uint64_t bytes_read = 0;
  uint64_t bytes_reused = 0;
  uint64_t tensor_count = 0;

  std::atomic<ModelState> state{ModelState::kLoading};
  std::atomic<int> leases{0};

  // A LOADING record's progress: tensor bytes read so far, and in all (the
  // catalog's; 0 until it is built). A FAILED record keeps those it reached.
  std::atomic<uint64_t> bytes_done{0};
  std::atomic<uint64_t> bytes_total{0};
  // A FAILED record's reason, "CODE: message"; set before it is shared.
  std::string error;

  // The runtime layouts published on this generation (server/model/layout.h):
  // they live with it, and are freed with it unless dropped first.
  // Declared last: destroyed first. Never null.
  const std::shared_ptr<LayoutSet> layouts = MakeLayoutSet();
};

// Which NUMA copy an attach maps (an index into `copies`, -1 when there are
// none): the one on `node` when a node is named (FAILED_PRECONDITION naming
// the nodes that have copies when none is there); else the copy whose node
// holds most of `cpus` (the client's CPU affinity; NumaCopy::cpus, recorded
// at load, so an attach reads no sysfs), ties to the lower node id; else
// copy 0 (a client whose CPUs are on no copy's node).
absl::StatusOr<int> ChooseNumaCopy(const std::vector<NumaCopy>& copies, std::optional<int> node,
                                   const std::vector<int>& cpus);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MODEL_MODEL_H_
