#include "server/load/shared_segments.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace weightd {

std::string SegmentKey(const FileStamp& stamp, const std::string& gpu_uuid, int numa_node,
                       std::vector<SegmentContent> tensors) {
  std::sort(tensors.begin(), tensors.end(),
            [](const SegmentContent& a, const SegmentContent& b) { return a.offset < b.offset; });
  const FileIdentity& id = stamp.identity;
  // Names may hold any byte but NUL-free JSON strings are not promised: each
  // field is length-prefixed, so no two different contents give one key.
  std::string key = absl::StrCat(id.dev, ":", id.ino, ":", id.size, ":", id.mtime_ns, ":", id.ctime_ns, ":",
                                 stamp.header_hash, ":", gpu_uuid.size(), ":", gpu_uuid, ":numa", numa_node);
  for (const SegmentContent& t : tensors) {
    absl::StrAppend(&key, "|", t.name.size(), ":", t.name, ":", t.offset, ":", t.nbytes, ":", t.split_dim, ":",
                    t.split_start);
  }
  return key;
}

void SharedSegments::Add(const ModelGeneration& gen) {
  if (!gen.from_files) return;
  const int host_node = gen.numa_copies.empty() ? -1 : gen.numa_copies[0].node;
  // Segment id -> the tensors a rank's manifest places in it.
  std::vector<std::vector<const TensorRecord*>> held(gen.segments.size());
  for (const RankManifest& rank : gen.ranks) {
    for (const TensorRecord& t : rank.tensors) {
      if (t.segment >= rank.segments.size()) continue;
      uint32_t id = rank.segments[t.segment];
      // Host segments appear in every rank's manifest: take rank 0's.
      if (t.placement == Placement::kHost && &rank != &gen.ranks[0]) continue;
      if (id < held.size()) held[id].push_back(&t);
    }
  }
  auto key_of = [&](const GenerationFile& file, uint32_t id, auto& hashes) {
    std::vector<SegmentContent> contents;
    for (const TensorRecord* t : held[id]) {
      contents.push_back({t->name, t->offset, t->nbytes, t->split_dim, t->split_start});
      hashes.emplace(t->name, t->content_hash);
    }
    bool device = gen.segments[id].placement == Placement::kDevice;
    return SegmentKey(file.stamp, device ? gen.segments[id].gpu_uuid : "", device ? -1 : host_node,
                      std::move(contents));
  };
  for (const GenerationFile& file : gen.files) {
    if (file.stamp.identity == FileIdentity{}) continue;  // a writer's bytes, or no file
    for (uint32_t id : file.host_segments) {
      if (id >= gen.segments.size() || held[id].empty()) continue;
      Host entry;
      entry.segment = gen.host_segments.at(gen.segments[id].owner);
      std::string key = key_of(file, id, entry.hashes);
      host_.try_emplace(std::move(key), std::move(entry));
    }
    for (const std::vector<uint32_t>& rank : file.arenas) {
      for (uint32_t id : rank) {
        if (id >= gen.segments.size() || held[id].empty()) continue;
        Arena entry;
        entry.arena = gen.arenas.at(gen.segments[id].owner);
        std::string key = key_of(file, id, entry.hashes);
        arenas_.try_emplace(std::move(key), std::move(entry));
      }
    }
  }
}

SharedSegments::HostHit SharedSegments::FindHost(const std::string& key) const {
  auto it = host_.find(key);
  if (it == host_.end()) return {};
  return {it->second.segment.lock(), &it->second.hashes};
}

SharedSegments::ArenaHit SharedSegments::FindArena(const std::string& key) const {
  auto it = arenas_.find(key);
  if (it == arenas_.end()) return {};
  return {it->second.arena.lock(), &it->second.hashes};
}

}  // namespace weightd
