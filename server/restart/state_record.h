// The state record of a generation in the fd store (server/restart/fd_store.h):
// everything a restarted daemon needs to serve a READY generation again
// without reading its checkpoint: the model name, generation, version label,
// load request (plan), each rank's manifest with content hashes, the
// fingerprint, each checkpoint file's stamp, and which stored fd holds each
// segment.
//
// Encoding (little-endian):
//   bytes 0..7    magic "WDSTATE1"
//   bytes 8..15   body length in bytes (at most kMaxStateRecordBytes)
//   bytes 16..23  XXH3-64 of the body
//   bytes 24..    body: one JSON object (docs/operations.md, "What the
//                 record holds")
//   then, when the daemon has a record key (server/restart/record_key.h), 32 bytes:
//                 HMAC-SHA256 under that key of everything before it
// The daemon writes it into a memfd that it seals (F_SEAL_WRITE and the
// rest) before handing it to the store, so no process can change it later;
// the checksum catches a record that is corrupt anyway, and the HMAC tells a
// record of this daemon's (or its predecessor's) from one written by
// whoever handed the fds over.
//
// Pure functions; thread-safe.
#ifndef WEIGHTD_SERVER_RESTART_STATE_RECORD_H_
#define WEIGHTD_SERVER_RESTART_STATE_RECORD_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/memory/segment_backend.h"
#include "server/model/layout.h"
#include "server/model/model.h"
#include "server/restart/record_key.h"

namespace weightd {

inline constexpr uint64_t kMaxStateRecordBytes = 256ull << 20;
inline constexpr size_t kStateRecordHeaderBytes = 24;

// One fd a record needs from the store: a host segment or a device arena.
struct StoredSegment {
  std::string fd_name;  // its FDNAME in the store
  SegmentBackend backend = SegmentBackend::kMemfd;
  uint64_t size = 0;           // bytes
  uint64_t inode = 0;          // st_ino of the memfd when it was stored; 0: not checked (cuda-vmm)
  bool huge_pages = false;     // MFD_HUGETLB (host segments)
  std::string gpu_uuid;        // arenas
};

// A runtime layout of the generation (server/model/layout.h) as a record
// holds it: the layout without its segment objects (host_segments and
// arenas empty, SegmentRecord::fd -1), and which of the record's
// layout_host_segments / layout_arenas hold them, in Layout::host_segments
// and ::arenas order.
struct StoredLayout {
  std::shared_ptr<Layout> layout;
  std::vector<size_t> host;    // indexes into StateRecord::layout_host_segments
  std::vector<size_t> arenas;  // indexes into StateRecord::layout_arenas
};

// A decoded record: the generation without its segment objects
// (host_segments and arenas empty, SegmentRecord::fd -1), and the fds that
// hold them, in ModelGeneration::host_segments and ::arenas order.
struct StateRecord {
  std::unique_ptr<ModelGeneration> model;
  // It carries an HMAC that verifies under the key it was decoded with.
  bool authenticated = false;
  std::vector<StoredSegment> host_segments;
  std::vector<StoredSegment> arenas;
  // The generation's runtime layouts and the fds that hold them.
  std::vector<StoredLayout> layouts;
  std::vector<StoredSegment> layout_host_segments;
  std::vector<StoredSegment> layout_arenas;
  // Layouts that failed a check, each "layout 'KEY': why": dropped alone,
  // their generation still decodes (their fds go unused).
  std::vector<std::string> dropped_layouts;
  // When the record was written (ns since the Unix epoch): of two records of
  // one generation (a crash between storing a rewritten record and dropping
  // the one before), the later wins.
  uint64_t written_ns = 0;
};

// The layouts a record stores, and the fds of their segments: `layouts`
// (each sealed and published), with `host` and `arenas` parallel to the
// concatenation of every layout's host_segments, and of its arenas, in
// `layouts` order.
struct LayoutsToStore {
  std::vector<std::shared_ptr<const Layout>> layouts;
  std::vector<StoredSegment> host;
  std::vector<StoredSegment> arenas;
};

// The record of `model` (READY), whose host segments and arenas are stored
// under the fds described by `host_segments` and `arenas` (parallel to the
// model's), with an HMAC under `key` unless it is null. INVALID_ARGUMENT
// when the vectors do not match the model or the record would exceed
// kMaxStateRecordBytes.
absl::StatusOr<std::string> EncodeStateRecord(const ModelGeneration& model,
                                              const std::vector<StoredSegment>& host_segments,
                                              const std::vector<StoredSegment>& arenas,
                                              const RecordKey* key = nullptr, const LayoutsToStore& layouts = {});

// Checks and decodes a record: magic, length, checksum, every field's type,
// a valid model name, every index in range, every tensor inside its
// segment with nbytes matching its dtype and shape, and the fingerprint
// recomputed from the tensors' hashes; for each layout, its key, identity
// and rank checked as a live publish checks them, every tensor's nbytes
// matching its dtype, shape and strides (LayoutTensorBytes) and inside its
// segment, and its fingerprint recomputed. DATA_LOSS for a damaged record
// (magic, length, checksum), INVALID_ARGUMENT naming the field otherwise.
// StateRecord::authenticated when `key` is not null and the record's HMAC
// verifies under it; a record without one, or with one that does not
// verify, decodes as unauthenticated (not an error).
absl::StatusOr<StateRecord> DecodeStateRecord(absl::string_view bytes, const RecordKey* key = nullptr);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_RESTART_STATE_RECORD_H_
