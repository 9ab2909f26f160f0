// Segments already served on this node, keyed by what they hold, so that a
// load shares them instead of reading the same bytes again (issue "Engram
// host tables": one copy across names and plans).
//
// A segment that a load from storage filled holds the tensors of one
// checkpoint file at fixed offsets. Its key is what decides those bytes:
// the file's identity (device, inode, size, mtime, ctime: common/io/env.h
// FileIdentity) and header hash, the GPU (arenas), and each tensor it holds
// with its offset in the segment, its byte count and, on a device, the
// slice (split dim and start) of the checkpoint tensor. Two segments with
// equal keys hold equal bytes, whichever model name, TP plan or subset
// loaded them: a second name over the same files, a draft model loading a
// subset, and the same checkpoint under another TP plan share every host
// segment whose tensors they lay out alike (which the plan does whenever
// the file's host-resident tensors are the same, server/load/plan.h), and
// every arena whose slices are the same. The file's name in the checkpoint
// is not part of the key: two folders linking one file share it.
//
// Only generations whose bytes are the files' as this daemon read them are
// indexed (ModelGeneration::from_files: not a peer's bytes, not an
// unauthenticated restored record's), and of them only files with a stamp
// (a writer's commit clears the stamp of a file whose segment it rewrote).
// A host segment of a load with NUMA copies is keyed with its node too, so
// a NUMA load shares only a first copy bound to its first node, and other
// loads share only unbound segments. A segment is shared with the page kind
// it was made with (huge or 4 KiB pages), whatever the later load would
// have chosen.
//
// Thread-safety: built and read by one thread (a load). It holds no
// segment alive (weak references): a find returns a strong one.
#ifndef WEIGHTD_SERVER_LOAD_SHARED_SEGMENTS_H_
#define WEIGHTD_SERVER_LOAD_SHARED_SEGMENTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/memory/device.h"
#include "common/memory/host_segment.h"
#include "server/model/model.h"

namespace weightd {

// One tensor (or one rank's slice of it) as a segment holds it.
struct SegmentContent {
  std::string name;
  uint64_t offset = 0;  // bytes into the segment
  uint64_t nbytes = 0;
  int32_t split_dim = -1;  // device slices: TensorRecord::split_dim, split_start
  uint64_t split_start = 0;
};

// The key of a segment holding `tensors` (any order) of the file `stamp`,
// on GPU `gpu_uuid` ("" for a host segment), bound to NUMA node
// `numa_node` (-1: not bound).
std::string SegmentKey(const FileStamp& stamp, const std::string& gpu_uuid, int numa_node,
                       std::vector<SegmentContent> tensors);

class SharedSegments {
 public:
  using Hashes = absl::flat_hash_map<std::string, uint64_t>;
  // A served segment still alive, and the content hashes of the tensors it
  // holds (of each whole checkpoint tensor, TensorRecord::content_hash;
  // valid while this index lives). A null segment: not found.
  struct HostHit {
    std::shared_ptr<const HostSegment> segment;
    const Hashes* hashes = nullptr;
  };
  struct ArenaHit {
    std::shared_ptr<DeviceArena> arena;
    const Hashes* hashes = nullptr;
  };

  // Indexes every segment of `gen` that holds one checkpoint file's bytes
  // (see above), by weak reference.
  void Add(const ModelGeneration& gen);

  // The live segment with `key` (SegmentKey), or a null one.
  HostHit FindHost(const std::string& key) const;
  ArenaHit FindArena(const std::string& key) const;

  size_t host_count() const { return host_.size(); }
  size_t arena_count() const { return arenas_.size(); }

 private:
  struct Host {
    std::weak_ptr<const HostSegment> segment;
    Hashes hashes;
  };
  struct Arena {
    std::weak_ptr<DeviceArena> arena;
    Hashes hashes;
  };
  absl::flat_hash_map<std::string, Host> host_;
  absl::flat_hash_map<std::string, Arena> arenas_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LOAD_SHARED_SEGMENTS_H_
