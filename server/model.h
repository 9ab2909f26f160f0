// A model generation: one load of a model name, with its segments and the
// manifest of each tensor-parallel rank. Immutable once READY; its memory
// lives exactly as long as the last shared_ptr to it (registry entry or lease).
// The registry also keeps records of loads in flight (LOADING) and failed
// (FAILED) as ModelGenerations without segments and with generation 0.
#ifndef WEIGHTD_SERVER_MODEL_H_
#define WEIGHTD_SERVER_MODEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/memory/device.h"
#include "common/format/dtype.h"
#include "common/memory/host_segment.h"
#include "common/memory/segment_backend.h"

namespace weightd {

enum class ModelState { kLoading, kReady, kFailed, kDraining };
enum class Placement { kHost, kDevice };

// A {pattern, dim} tensor-parallel rule: tensors whose name contains
// `pattern` are split evenly along `dim`.
struct TpRule {
  std::string pattern;
  uint32_t dim = 0;
};

// What a client asked to load (LoadModelRequest in domain types).
struct LoadRequest {
  std::string name;
  std::string checkpoint_path;
  std::vector<std::string> host_resident_patterns;
  uint32_t tp_size = 1;
  std::vector<TpRule> tp_rules;
  std::vector<std::string> devices;
  bool SamePlan(const LoadRequest& other) const;
};

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
};

struct RankManifest {
  std::vector<uint32_t> segments;  // ids into ModelGeneration::segments, in fd order
  std::vector<TensorRecord> tensors;
};

struct FileStamp {
  std::string name;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileStamp&) const = default;
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

class ModelGeneration {
 public:
  // Runs when the generation is destroyed, after its segments were released:
  // declared first, it is destroyed last. Set by the registry when it
  // publishes the generation (the FREED event, server/model_events.h); unset
  // for LOADING and FAILED records. The last reference may go on any
  // thread, with or without the registry's lock held: the function must not
  // call into the registry.
  FreedHook on_freed;

  LoadRequest request;             // checkpoint_path resolved with realpath
  uint64_t generation = 0;
  std::vector<FileStamp> files;    // what was read, to detect a rewritten checkpoint
  std::vector<std::string> warnings;  // the catalog's advisory findings
  std::vector<std::unique_ptr<HostSegment>> host_segments;
  std::vector<std::unique_ptr<DeviceArena>> arenas;  // declared after host_segments: freed first
  std::vector<SegmentRecord> segments;
  std::vector<RankManifest> ranks;  // tp_size entries
  std::string fingerprint;          // 32 hex digits
  std::string version_label;        // a writer's tag (e.g. "step-1200"); empty for loads from disk
  double load_seconds = 0;
  uint64_t checkpoint_bytes = 0;  // tensor bytes of the checkpoint
  uint64_t host_bytes = 0;
  uint64_t locked_bytes = 0;
  uint64_t tensor_count = 0;

  // The RPC layer's wire encoding of each rank's segments and tensors,
  // built once on first Attach (server/service.cc) and reused by every lease.
  std::once_flag encode_once;
  std::vector<std::string> encoded_manifests;

  std::atomic<ModelState> state{ModelState::kLoading};
  std::atomic<int> leases{0};

  // A LOADING record's progress: tensor bytes read so far, and in all (the
  // catalog's; 0 until it is built). A FAILED record keeps those it reached.
  std::atomic<uint64_t> bytes_done{0};
  std::atomic<uint64_t> bytes_total{0};
  // A FAILED record's reason, "CODE: message"; set before it is shared.
  std::string error;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MODEL_H_
