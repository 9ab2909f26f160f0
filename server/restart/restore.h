// Restore at start: turns the fds a restarted daemon received from the fd
// store (server/restart/fd_store.h) back into READY generations, without reading a
// checkpoint byte.
//
// Each state record is checked before anything of it is served:
//   - the record memfd is sealed against writes, at most
//     kMaxStateRecordBytes, and decodes (magic, checksum, every field and
//     index, the fingerprint recomputed from its tensors' hashes:
//     DecodeStateRecord);
//   - its checkpoint path lies under a configured model root (a daemon
//     restarted with fewer roots drops the models outside them);
//   - every segment fd it names is present, is the very memfd that was
//     stored (st_ino), is exactly the recorded size and page size, and
//     carries F_SEAL_WRITE|SHRINK|GROW|SEAL, so its bytes are the bytes
//     that were verified when it was sealed;
//   - every device arena's GPU is one this daemon's backend has, and the
//     backend can adopt it.
//   - its runtime layouts (server/model/layout.h) pass the same checks, each
//     on its own: a layout that fails is dropped, not its generation;
//   - every host tensor's bytes, hashed again from its segment (in
//     parallel), equal the content hash the record gives: a record is
//     checksummed, not authenticated, so whoever can hand the daemon fds at
//     start could otherwise name a sealed memfd of their own under the
//     genuine hashes and fingerprint. (Device arenas are not hashed here:
//     the backend adopts them by handle, and a device arena's fd names
//     memory on a GPU only the driver can read back.)
// A record that fails any check is dropped with its reason; the others are
// restored. Fields a live request would have checked are checked again: the
// model name, a version label of printable ASCII, a checkpoint path that is
// absolute and resolved (no '.', '..' or empty parts).
//
// Thread-safety: a plain function; call it once, at start.
#ifndef WEIGHTD_SERVER_RESTART_RESTORE_H_
#define WEIGHTD_SERVER_RESTART_RESTORE_H_

#include <memory>
#include <string>
#include <vector>

#include "common/io/model_roots.h"
#include "common/memory/device.h"
#include "server/restart/fd_store.h"
#include "server/restart/record_key.h"
#include "server/model/layout.h"
#include "server/model/model.h"

namespace weightd {

// Why a record was dropped: a metric label (weightd_fd_store_records_dropped_total{reason}).
inline constexpr const char* kRestoreDropReasons[] = {
    "corrupt",             // the record does not decode (checksum, fields, fingerprint) or is not sealed
    "missing_fd",          // a segment it names was not passed
    "segment_mismatch",    // a segment fd is another file, size, page size, or unsealed
    "outside_model_roots", // its checkpoint path is under no configured --model-root
    "device_unavailable",  // a GPU it needs is absent, or the backend cannot adopt its arenas
    "duplicate",           // an older record of a model name restored from a newer one
    "content_mismatch",    // a host tensor's bytes do not hash to the content hash its record gives
};

struct RestoredModel {
  std::unique_ptr<ModelGeneration> model;  // READY-to-publish, generation as recorded
  std::string record_name;
  ScopedFd record_fd;
  std::vector<std::string> host_segment_names;  // parallel to model->host_segments
  std::vector<std::string> arena_names;         // parallel to model->arenas
  // The runtime layouts restored into model->layouts, each with the store
  // names of its host segments then its arenas. A layout whose check failed
  // is dropped alone (logged) and its segments are unused.
  struct RestoredLayout {
    std::shared_ptr<const Layout> layout;
    std::vector<std::string> segment_names;
  };
  std::vector<RestoredLayout> layouts;
  double seconds = 0;                           // to check and adopt it
  bool authenticated = false;                   // its record's HMAC verified: its host bytes were not hashed again
};

struct DroppedRecord {
  std::string fd_name;
  std::string model;   // empty when the record did not decode
  std::string reason;  // one of kRestoreDropReasons
  std::string message;
};

struct RestoreResult {
  std::vector<RestoredModel> models;  // by generation, oldest first
  std::vector<DroppedRecord> dropped;
  // Names of passed fds that no restored record needs (dropped records'
  // segments, unknown names): the caller tells the store to drop them.
  std::vector<std::string> unused;
};

struct RestoreOptions {
  const ModelRoots* model_roots = nullptr;  // required
  DeviceBackend* device_backend = nullptr;  // null: records with arenas are dropped
  // The daemon's record key (null: none). A record whose HMAC verifies under
  // it is restored without hashing its host tensors again; any other is
  // hashed in full.
  const RecordKey* key = nullptr;
};

// Consumes `fds` (closing what is not adopted).
RestoreResult RestoreFromFdStore(std::vector<NamedFd> fds, const RestoreOptions& options);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_RESTART_RESTORE_H_
