#include "server/restart/restore.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/parallel.h"
#include "common/base/status.h"
#include "common/format/content_hash.h"
#include "server/restart/state_record.h"

namespace weightd {
namespace {

// A check that failed: the reason label and what was wrong.
struct Refusal {
  std::string reason;
  std::string message;
};

absl::StatusOr<std::string> ReadRecord(int fd) {
  if (!SealedAgainstWrites(fd)) return absl::FailedPreconditionError("the record is not a memfd sealed against writes");
  struct stat st {};
  if (fstat(fd, &st) != 0) return ErrnoToStatus("fstat record", errno);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > kMaxStateRecordBytes + kStateRecordHeaderBytes) {
    return absl::FailedPreconditionError(absl::StrCat("the record is ", size, " bytes, over the bound"));
  }
  std::string bytes(size, '\0');
  size_t done = 0;
  while (done < size) {
    ssize_t got = pread(fd, bytes.data() + done, size - done, static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return ErrnoToStatus("read record", got < 0 ? errno : EIO);
    done += static_cast<size_t>(got);
  }
  return bytes;
}

// N of a rewritten record's name "wd-rec-G.N" (fd_store.h); 0 for "wd-rec-G".
uint64_t RewriteOf(const std::string& record_name) {
  size_t dot = record_name.rfind('.');
  uint64_t n = 0;
  if (dot == std::string::npos || !absl::SimpleAtoi(record_name.substr(dot + 1), &n)) return 0;
  return n;
}

class Restorer {
 public:
  Restorer(std::vector<NamedFd> fds, const RestoreOptions& options) : options_(options) {
    for (NamedFd& f : fds) {
      if (absl::StartsWith(f.name, "wd-rec-")) {
        records_.push_back(std::move(f));
      } else {
        segments_[f.name] = std::move(f.fd);  // a repeated name keeps the last fd
      }
    }
    if (options_.device_backend != nullptr) {
      if (absl::StatusOr<std::vector<DeviceInfo>> devices = options_.device_backend->Devices(); devices.ok()) {
        devices_ = *devices;
      }
    }
  }

  RestoreResult Run() {
    std::vector<StateRecord> decoded;
    std::vector<NamedFd> record_fds;
    for (NamedFd& f : records_) {
      absl::StatusOr<std::string> bytes = ReadRecord(f.fd.get());
      absl::StatusOr<StateRecord> record = bytes.ok() ? DecodeStateRecord(*bytes, options_.key) : bytes.status();
      if (!record.ok()) {
        result_.dropped.push_back({f.name, "", "corrupt", std::string(record.status().message())});
        continue;
      }
      decoded.push_back(std::move(*record));
      record_fds.push_back(std::move(f));
    }
    // One record per name: the newest generation wins.
    std::vector<size_t> order(decoded.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    // Of two records of one generation (a rewrite for its layouts that a
    // crash cut short), the later rewrite ("wd-rec-G.N": the higher N; the
    // keeper numbers rewrites upward across restarts), then the later
    // written.
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return std::tuple(decoded[a].model->generation, RewriteOf(record_fds[a].name), decoded[a].written_ns) >
             std::tuple(decoded[b].model->generation, RewriteOf(record_fds[b].name), decoded[b].written_ns);
    });
    std::set<std::string> names;
    std::vector<size_t> chosen;
    for (size_t i : order) {
      const std::string& name = decoded[i].model->request.name;
      if (!names.insert(name).second) {
        result_.dropped.push_back({record_fds[i].name, name, "duplicate",
                                   absl::StrCat("generation ", decoded[i].model->generation, " is older than another record of it")});
        continue;
      }
      chosen.push_back(i);
    }
    std::reverse(chosen.begin(), chosen.end());  // oldest first
    std::set<std::string> used;
    for (size_t i : chosen) {
      auto start = std::chrono::steady_clock::now();
      RestoredModel restored;
      restored.record_name = record_fds[i].name;
      std::optional<Refusal> refusal = Adopt(decoded[i], restored);
      if (refusal) {
        result_.dropped.push_back({record_fds[i].name, decoded[i].model->request.name, refusal->reason, refusal->message});
        continue;
      }
      restored.record_fd = std::move(record_fds[i].fd);
      restored.model = std::move(decoded[i].model);
      AdoptLayouts(decoded[i], restored);
      for (const auto& n : restored.host_segment_names) used.insert(n);
      for (const auto& n : restored.arena_names) used.insert(n);
      for (const auto& l : restored.layouts) used.insert(l.segment_names.begin(), l.segment_names.end());
      restored.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      result_.models.push_back(std::move(restored));
    }
    for (const DroppedRecord& d : result_.dropped) result_.unused.push_back(d.fd_name);
    for (const auto& [name, fd] : segments_) {
      if (!used.count(name)) result_.unused.push_back(name);
    }
    return std::move(result_);
  }

 private:
  // Checks every segment of `record` and adopts them into its model.
  std::optional<Refusal> Adopt(StateRecord& record, RestoredModel& out) {
    ModelGeneration& m = *record.model;
    m.source = "fd store";  // DESIGN.md "source": a restarted daemon's generation
    if (options_.model_roots == nullptr || !options_.model_roots->Contains(m.request.checkpoint_path)) {
      return Refusal{"outside_model_roots", absl::StrCat(m.request.checkpoint_path, " is under no --model-root (",
                                                         options_.model_roots ? options_.model_roots->Describe() : "", ")")};
    }
    for (const StoredSegment& s : record.host_segments) {
      std::shared_ptr<const HostSegment> adopted;
      if (std::optional<Refusal> refusal = AdoptHost(s, &adopted)) return refusal;
      m.huge_page_bytes += adopted->huge_bytes();  // hugetlb ones; THP is not known after a restart
      m.host_segments.push_back(std::move(adopted));
      out.host_segment_names.push_back(s.fd_name);
    }
    for (const StoredSegment& s : record.arenas) {
      std::shared_ptr<DeviceArena> adopted;
      if (std::optional<Refusal> refusal = AdoptArena(s, &adopted)) return refusal;
      m.arenas.push_back(std::move(adopted));
      out.arena_names.push_back(s.fd_name);
    }
    for (SegmentRecord& s : m.segments) {
      s.fd = s.placement == Placement::kHost ? m.host_segments[s.owner]->fd() : m.arenas[s.owner]->export_fd();
    }
    // An authenticated record was written by a daemon holding the key, and
    // each of its segments was checked above to be the very memfd it stored
    // (inode), sealed against writes: its bytes are the ones verified at
    // load. Any other record may name memfds of whoever passed the fds.
    out.authenticated = record.authenticated;
    if (record.authenticated) return std::nullopt;
    // Whoever wrote it, its bytes are checked against its own hashes only:
    // never shared as a file's with other names (server/load/shared_segments.h).
    m.from_files = false;
    return VerifyHostTensors(m);
  }

  // Host segment `s`, adopted once however many records name it (a segment
  // several generations share, server/load/shared_segments.h, was stored once).
  std::optional<Refusal> AdoptHost(const StoredSegment& s, std::shared_ptr<const HostSegment>* out) {
    std::shared_ptr<const HostSegment>& adopted = host_adopted_[s.fd_name];
    if (adopted == nullptr) {
      absl::StatusOr<ScopedFd> fd = Take(s);
      if (!fd.ok()) {
        host_adopted_.erase(s.fd_name);
        return Refused(fd.status());
      }
      absl::StatusOr<std::unique_ptr<HostSegment>> segment = HostSegment::Adopt(std::move(*fd), s.size, s.huge_pages);
      if (!segment.ok()) {
        host_adopted_.erase(s.fd_name);
        return Refusal{"segment_mismatch", absl::StrCat(s.fd_name, ": ", segment.status().message())};
      }
      adopted = std::move(*segment);
    } else if (adopted->size() != s.size) {
      return Refusal{"segment_mismatch", absl::StrCat(s.fd_name, ": another record gives it ", adopted->size(),
                                                      " bytes, this one ", s.size)};
    }
    *out = adopted;
    return std::nullopt;
  }

  // Device arena `s`, adopted once as host segments are.
  std::optional<Refusal> AdoptArena(const StoredSegment& s, std::shared_ptr<DeviceArena>* out) {
    if (options_.device_backend == nullptr || options_.device_backend->segment_backend() != s.backend) {
      return Refusal{"device_unavailable", absl::StrCat(s.fd_name, ": a ", SegmentBackendName(s.backend),
                                                        " arena, and this daemon's device backend is ",
                                                        options_.device_backend ? options_.device_backend->name() : "none")};
    }
    auto device = std::find_if(devices_.begin(), devices_.end(), [&](const DeviceInfo& d) { return d.uuid == s.gpu_uuid; });
    if (device == devices_.end()) {
      return Refusal{"device_unavailable", absl::StrCat(s.fd_name, ": GPU ", s.gpu_uuid, " is not present")};
    }
    if (auto it = arena_adopted_.find(s.fd_name); it != arena_adopted_.end()) {
      if (it->second->size() != s.size || it->second->device().uuid != s.gpu_uuid) {
        return Refusal{"segment_mismatch", absl::StrCat(s.fd_name, ": another record gives it another size or GPU")};
      }
      *out = it->second;
      return std::nullopt;
    }
    absl::StatusOr<ScopedFd> fd = Take(s);
    if (!fd.ok()) return Refused(fd.status());
    absl::StatusOr<std::unique_ptr<DeviceArena>> arena = options_.device_backend->Adopt(*device, std::move(*fd), s.size);
    if (!arena.ok()) {
      bool cannot = arena.status().code() == absl::StatusCode::kUnimplemented;
      return Refusal{cannot ? "device_unavailable" : "segment_mismatch", absl::StrCat(s.fd_name, ": ", arena.status().message())};
    }
    std::shared_ptr<DeviceArena> adopted = std::move(*arena);
    arena_adopted_[s.fd_name] = adopted;
    *out = std::move(adopted);
    return std::nullopt;
  }

  // The record's runtime layouts, into its model's LayoutSet: each checked
  // as the generation's segments are (and its host tensors hashed again
  // unless the record is authenticated). A layout that fails a check is
  // dropped alone, with one log line; its model is still restored.
  void AdoptLayouts(StateRecord& record, RestoredModel& out) {
    ModelGeneration& m = *out.model;
    for (const std::string& why : record.dropped_layouts) {
      LogWarning(absl::StrCat("restore: ", why, " (of model ", QuoteName(m.request.name), ") dropped: corrupt"));
    }
    for (StoredLayout& stored : record.layouts) {
      Layout& l = *stored.layout;
      std::optional<Refusal> refusal;
      std::vector<std::string> names;
      for (size_t at : stored.host) {
        std::shared_ptr<const HostSegment> adopted;
        if ((refusal = AdoptHost(record.layout_host_segments[at], &adopted))) break;
        l.host_segments.push_back(std::move(adopted));
        names.push_back(record.layout_host_segments[at].fd_name);
      }
      for (size_t i = 0; !refusal && i < stored.arenas.size(); ++i) {
        std::shared_ptr<DeviceArena> adopted;
        if ((refusal = AdoptArena(record.layout_arenas[stored.arenas[i]], &adopted))) break;
        l.arenas.push_back(std::move(adopted));
        names.push_back(record.layout_arenas[stored.arenas[i]].fd_name);
      }
      if (!refusal) {
        for (SegmentRecord& s : l.segments) {
          s.fd = s.placement == Placement::kHost ? l.host_segments[s.owner]->fd() : l.arenas[s.owner]->export_fd();
          s.handle = s.placement == Placement::kHost ? "" : l.arenas[s.owner]->export_handle();
        }
        if (!record.authenticated) refusal = VerifyLayoutTensors(l);
      }
      if (refusal || !m.layouts->Add(stored.layout)) {
        LogWarning(absl::StrCat("restore: layout ", QuoteName(l.key), " of rank ", l.rank, " of model ",
                                QuoteName(m.request.name), " dropped (",
                                refusal ? absl::StrCat(refusal->reason, ": ", refusal->message) : "a duplicate", ")"));
        continue;
      }
      out.layouts.push_back({stored.layout, std::move(names)});
    }
  }

  static std::optional<Refusal> VerifyLayoutTensors(const Layout& l) {
    for (const LayoutTensor& t : l.tensors) {
      const SegmentRecord& seg = l.segments[t.record.segment];
      if (seg.placement != Placement::kHost) continue;
      uint64_t hash = TensorContentHash(l.host_segments[seg.owner]->data() + t.record.offset, t.record.nbytes);
      if (hash != t.record.content_hash) {
        return Refusal{"content_mismatch", absl::StrCat("layout tensor ", QuoteName(t.record.name), ": its bytes hash to ",
                                                        ContentHashHex(hash), ", the record says ",
                                                        ContentHashHex(t.record.content_hash))};
      }
    }
    return std::nullopt;
  }

  // A record without a valid HMAC may have been written by whoever handed
  // the daemon fds at start (naming a sealed memfd of their own, with its
  // checksum recomputed). So every host tensor is hashed again from its
  // segment and must equal the content hash its record gives (which the
  // fingerprint covers); a tensor shared by several ranks is hashed once. In
  // parallel.
  static std::optional<Refusal> VerifyHostTensors(const ModelGeneration& m) {
    constexpr size_t kMaxHashThreads = 8;
    std::vector<const TensorRecord*> tensors;
    std::vector<const char*> data;
    std::set<std::pair<const char*, uint64_t>> seen;
    // Every copy of the host segments (NUMA copies too: an attach maps them).
    const int copies = std::max<int>(1, static_cast<int>(m.numa_copies.size()));
    for (uint32_t r = 0; r < m.ranks.size(); ++r) {
      const RankManifest& rank = m.ranks[r];
      for (int copy = 0; copy < copies; ++copy) {
        std::vector<uint32_t> ids = m.SegmentsOf(r, m.numa_copies.empty() ? -1 : copy);
        for (const TensorRecord& t : rank.tensors) {
          if (t.placement != Placement::kHost || t.segment >= ids.size()) continue;
          const SegmentRecord& seg = m.segments[ids[t.segment]];
          const char* at = m.host_segments[seg.owner]->data() + t.offset;
          if (!seen.insert({at, t.nbytes}).second) continue;
          tensors.push_back(&t);
          data.push_back(at);
        }
      }
    }
    absl::Status hashed = ParallelFor(
        tensors.size(),
        [&](size_t i) -> absl::Status {
          uint64_t hash = TensorContentHash(data[i], tensors[i]->nbytes);
          if (hash == tensors[i]->content_hash) return absl::OkStatus();
          return absl::DataLossError(absl::StrCat("tensor ", QuoteName(tensors[i]->name), ": its bytes hash to ",
                                                  ContentHashHex(hash), ", the record says ",
                                                  ContentHashHex(tensors[i]->content_hash),
                                                  " (not the bytes that were verified at load)"));
        },
        kMaxHashThreads);
    if (!hashed.ok()) return Refusal{"content_mismatch", std::string(hashed.message())};
    return std::nullopt;
  }

  // A copy of the stored fd `s` names, checked to be the file that was stored.
  absl::StatusOr<ScopedFd> Take(const StoredSegment& s) {
    auto it = segments_.find(s.fd_name);
    if (it == segments_.end()) return absl::NotFoundError(absl::StrCat(s.fd_name, " was not passed"));
    if (s.inode != 0) {
      struct stat st {};
      if (fstat(it->second.get(), &st) != 0 || static_cast<uint64_t>(st.st_ino) != s.inode) {
        return absl::FailedPreconditionError(absl::StrCat(s.fd_name, " is not the memfd that was stored (inode ",
                                                          st.st_ino, ", recorded ", s.inode, ")"));
      }
    }
    ScopedFd copy(fcntl(it->second.get(), F_DUPFD_CLOEXEC, 3));
    if (!copy.valid()) return ErrnoToStatus(absl::StrCat("dup ", s.fd_name), errno);
    return copy;
  }

  static Refusal Refused(const absl::Status& status) {
    return Refusal{status.code() == absl::StatusCode::kNotFound ? "missing_fd" : "segment_mismatch",
                   std::string(status.message())};
  }

  const RestoreOptions& options_;
  std::vector<NamedFd> records_;
  std::map<std::string, ScopedFd> segments_;  // closed when the restorer ends; adopted ones are copies
  // Segments adopted so far, by store name: one object per stored segment.
  std::map<std::string, std::shared_ptr<const HostSegment>> host_adopted_;
  std::map<std::string, std::shared_ptr<DeviceArena>> arena_adopted_;
  std::vector<DeviceInfo> devices_;
  RestoreResult result_;
};

}  // namespace

RestoreResult RestoreFromFdStore(std::vector<NamedFd> fds, const RestoreOptions& options) {
  return Restorer(std::move(fds), options).Run();
}

}  // namespace weightd
