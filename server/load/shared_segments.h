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
// Not indexed: files whose stamp a writer's commit cleared (their segments
// hold the writer's bytes, server/update/update.h) and generations without
// files (a writer's layouts). A segment is shared with the page kind it was
// made with (huge or 4 KiB pages), whatever the later load would have chosen.
//
// Thread-safety: built and read by one thread (a load); the segments it
// holds stay alive while it does.
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
// on GPU `gpu_uuid` ("" for a host segment).
std::string SegmentKey(const FileStamp& stamp, const std::string& gpu_uuid, std::vector<SegmentContent> tensors);

class SharedSegments {
 public:
  // A served segment and the content hashes of the tensors it holds (of
  // each whole checkpoint tensor, TensorRecord::content_hash).
  struct Host {
    std::shared_ptr<const HostSegment> segment;
    absl::flat_hash_map<std::string, uint64_t> hashes;
  };
  struct Arena {
    std::shared_ptr<DeviceArena> arena;
    absl::flat_hash_map<std::string, uint64_t> hashes;
  };

  // Indexes every segment of `gen` that holds one checkpoint file's bytes
  // (GenerationFile with a stamp), holding a reference to each.
  void Add(const ModelGeneration& gen);

  // The segment with `key` (SegmentKey), or null.
  const Host* FindHost(const std::string& key) const;
  const Arena* FindArena(const std::string& key) const;

  size_t host_count() const { return host_.size(); }
  size_t arena_count() const { return arenas_.size(); }

 private:
  absl::flat_hash_map<std::string, Host> host_;
  absl::flat_hash_map<std::string, Arena> arenas_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LOAD_SHARED_SEGMENTS_H_
