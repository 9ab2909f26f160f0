// Runtime layouts (docs/api.md "Runtime layouts"): the tensors an engine
// actually runs on for one rank of one generation (fused, re-quantized,
// repacked, sharded: any names, dtypes, shapes and strides), written once by
// the engine process that computed them (server/layout/layout_publish.h) and
// attached zero-copy by every later one.
//
// A Layout is immutable once published. It belongs to one generation: the
// generation's LayoutSet holds it, so it lives exactly as long as the
// generation (current or draining) unless DropLayout removes it first; a
// lease on a layout holds both the layout and its generation.
//
// Thread-safety: a Layout is immutable after publication (but for its
// lease count, an atomic); LayoutSet may be used from any thread (its own
// lock, taken after the registry's, calling nothing outside itself).
#ifndef WEIGHTD_SERVER_MODEL_LAYOUT_H_
#define WEIGHTD_SERVER_MODEL_LAYOUT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/memory/device.h"
#include "common/memory/host_segment.h"
#include "server/model/model.h"

namespace weightd {

// The strings that decide a layout (engine, engine version, layout ABI,
// quantization, parallel sizes, device arch, ...), as the engine fills them.
using LayoutIdentity = std::map<std::string, std::string>;

// A tensor of a layout. `record.segment` indexes Layout::segments;
// `record.content_hash` is the xxh3-64 of its bytes (the span its strides
// reach); full_shape is empty and split_dim -1 (layouts are per rank).
struct LayoutTensor {
  TensorRecord record;
  std::vector<uint64_t> strides;  // in elements; empty: contiguous
};

struct Layout {
  std::string model;
  uint64_t generation = 0;
  std::string key;
  uint32_t rank = 0;
  LayoutIdentity identity;
  // Sealed memfds and daemon-owned arenas (the writer never maps these arenas).
  std::vector<std::shared_ptr<const HostSegment>> host_segments;
  std::vector<std::shared_ptr<DeviceArena>> arenas;
  // What clients map, in fd order: host segments, then arenas; `owner`
  // indexes host_segments or arenas.
  std::vector<SegmentRecord> segments;
  std::vector<LayoutTensor> tensors;  // in the writer's order
  std::string fingerprint;            // 32 hex digits (LayoutFingerprint)
  uint64_t host_bytes = 0;            // bytes of host_segments
  uint64_t device_bytes = 0;          // bytes of arenas
  std::string gpu_uuid;               // of the arenas; empty without device tensors
  double publish_seconds = 0;         // sealing, hashing and device copies
  double published_at = 0;            // seconds since the Unix epoch
  mutable std::atomic<int> leases{0};
};

// 32 hex digits of XXH3-128 over every tensor's name, dtype, shape, strides
// and content hash, in name order: equal for equal layouts.
std::string LayoutFingerprint(const std::vector<LayoutTensor>& tensors);

// The published layouts of one generation, at most one per (key, rank).
class LayoutSet {
 public:
  // Adds `layout`; false (and nothing changes) when its (key, rank) has one.
  bool Add(std::shared_ptr<const Layout> layout) ABSL_LOCKS_EXCLUDED(mu_);
  std::shared_ptr<const Layout> Find(const std::string& key, uint32_t rank) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every layout, by key then rank.
  std::vector<std::shared_ptr<const Layout>> List() const ABSL_LOCKS_EXCLUDED(mu_);
  // The keys published for `rank`, sorted.
  std::vector<std::string> KeysOf(uint32_t rank) const ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the layouts of `key` (of `rank` only, when given); returns them.
  std::vector<std::shared_ptr<const Layout>> Remove(const std::string& key, std::optional<uint32_t> rank)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every layout; returns them.
  std::vector<std::shared_ptr<const Layout>> Clear() ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of every layout's host segments and arenas.
  uint64_t HostBytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Device bytes by GPU UUID.
  std::map<std::string, uint64_t> DeviceBytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, uint32_t>, std::shared_ptr<const Layout>> layouts_ ABSL_GUARDED_BY(mu_);
};

// "" when `asked` is empty (no check asked for) or equals `published`;
// else one clause per field that differs, in key order:
// "quantization is 'int8' here but 'fp8' in the published layout",
// "engine_version is missing here ('0.33.0' in the published layout)",
// "arch is 'sm90' here but missing from the published layout".
// Values are quoted with QuoteName (cut when long).
std::string IdentityDifference(const LayoutIdentity& published, const LayoutIdentity& asked);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MODEL_LAYOUT_H_
