// The writer path of a model (issue "Generations from a writer"): staging
// writable copies of the segments that hold the tensors a writer will
// write, and turning them, verified, into the next generation.
//
// Staging (StageUpdate): for every segment of the base generation holding a
// named tensor, a new memfd of the same size is created, filled with the
// segment's current bytes (so a tensor not written keeps its value), and
// its size is sealed (F_SEAL_SHRINK | F_SEAL_GROW) before its fd goes to the
// writer: the writer may write bytes, never resize the memory the daemon
// reads. Every other segment is shared with the base by reference.
//
// Committing (SealAndVerify): each staged memfd is sealed against writes
// (F_SEAL_WRITE, which the kernel refuses with EBUSY while any process still
// maps it writable: fcntl(2), memfd_create(2)), then every tensor of every
// staged segment is hashed from the sealed bytes. Only then are the hashes
// compared: a tensor the writer did not name whose bytes changed, or a named
// tensor whose hash differs from the one expected, refuses the commit,
// naming the tensor. Sealing first means no byte can change between the
// check and the serving.
//
// Device-placed tensors are staged in host memory instead, whole (the
// checkpoint tensor, not per-rank shards), in one more staged memfd that
// is filled with their current bytes gathered from every rank. At commit it
// is sealed and hashed like the others; then, for each changed device
// tensor, the arenas that hold it (and only those) are copied into fresh
// arenas and its rank slices written there by the daemon. Why not hand the
// writer the arenas themselves: a CUDA VMM or IPC mapping in another
// process cannot be revoked or write-protected afterwards (there is no
// F_SEAL_WRITE for device memory), so a writer that kept its mapping could
// change served bytes after verification. Staging in a sealed memfd keeps
// "a node never serves a byte it did not verify" for device memory too, at
// the price of one host-to-device copy by the daemon.
//
// Thread-safety: a StagedUpdate is changed by one thread at a time (the
// registry's UpdateTable lets one commit run, and ends no update under it);
// the fd socket may read its segments' fds meanwhile.
#ifndef WEIGHTD_SERVER_UPDATE_UPDATE_H_
#define WEIGHTD_SERVER_UPDATE_UPDATE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/memory_admission.h"
#include "server/model/model.h"

namespace weightd {

// Bounds of a BeginUpdate/CommitUpdate request: kMaxVersionLabelBytes and
// ValidateVersionLabel (server/model/model.h), which restore applies too.

// One staged segment: a writable copy of base segment `base_id`, or the
// host staging of device tensors (base_id == kDeviceStaging).
inline constexpr uint32_t kDeviceStaging = 0xffffffffu;
struct StagedSegment {
  uint32_t base_id = 0;  // id into the base generation's segments
  std::shared_ptr<HostSegment> memory;
};

// A tensor the writer may write, in staged-segment coordinates.
struct StagedTensor {
  TensorRecord record;  // `segment` indexes StagedUpdate::segments
  uint32_t rank = 0;    // host tensors: 0
};

struct StagedUpdate {
  std::shared_ptr<ModelGeneration> base;
  DeviceBackend* backend = nullptr;  // for device tensors; not owned
  std::vector<std::string> tensors;  // named by the writer (all of the base's when none were)
  std::vector<StagedSegment> segments;
  std::vector<StagedTensor> writable;  // one per named tensor
  uint64_t bytes_staged = 0;  // bytes copied into staged segments
  uint64_t bytes_shared = 0;  // bytes of base segments shared unchanged
};

// Stages an update of `tensors` (empty: every tensor) of `base` (READY).
// INVALID_ARGUMENT for an unknown, repeated or empty tensor name or more
// names than the model has tensors; FAILED_PRECONDITION naming a
// device-placed tensor when `backend` is null; RESOURCE_EXHAUSTED when
// `admission` (may be null) cannot promise the staged bytes or memfds
// cannot be made. Everything staged is freed on error. `backend` (the
// daemon's, not owned) must outlive the update.
absl::StatusOr<std::unique_ptr<StagedUpdate>> StageUpdate(std::shared_ptr<ModelGeneration> base,
                                                          const std::vector<std::string>& tensors,
                                                          HostMemoryAdmission* admission,
                                                          DeviceBackend* backend = nullptr);

struct CommitOptions {
  std::map<std::string, std::string> expected_hashes;  // tensor name -> 16 hex digits
  std::string version_label = {};
  bool mlock = true;  // lock the sealed staged segments when RLIMIT_MEMLOCK allows
};

struct CommitOutcome {
  std::unique_ptr<ModelGeneration> generation;  // generation 0, not yet published
  uint32_t tensors_changed = 0;
};

// Why an update ended without a commit (a metric label and a log word).
inline constexpr const char* kUpdateAbortReasons[] = {"aborted_by_writer", "writer_disconnected", "claim_timeout",
                                                      "verification_failed", "unloaded", "superseded"};

// Checks `options` before touching anything: INVALID_ARGUMENT for a label
// over kMaxVersionLabelBytes or with bytes outside printable ASCII, an
// expected hash that is not 16 hex digits or names a tensor not in the
// update. Refusals here leave the update open.
absl::Status CheckCommitOptions(const StagedUpdate& update, const CommitOptions& options);

// One try at committing: the next generation, or why not and whether the
// staged segments were sealed by then (a sealed update can no longer be
// written, so it can only be aborted).
struct CommitAttempt {
  absl::StatusOr<CommitOutcome> outcome = absl::UnknownError("not attempted");
  bool sealed = false;
};

// Seals, hashes and verifies the staged segments and builds the next
// generation, in these phases:
//   1. CheckCommitOptions;
//   2. seal every staged memfd against writes (F_SEAL_WRITE, EBUSY while a
//      process still maps it writable: FAILED_PRECONDITION "... still
//      mapped writable ...", nothing sealed is undone; a retry seals the rest);
//   3. every byte no tensor covers must equal the base's;
//   4. hash every tensor of a staged segment from the sealed bytes;
//      a changed tensor not named in the update is FAILED_PRECONDITION;
//   5. expected hashes must match (FAILED_PRECONDITION naming the tensor);
//   6. build the generation: the base's layout, manifests and shared
//      segments with the sealed staged ones in place of theirs, arenas of
//      changed device tensors copied and rewritten, the new content hashes,
//      file stamps of rewritten files cleared, fingerprint, byte counts and
//      `options.version_label`.
CommitAttempt SealAndVerify(StagedUpdate& update, const CommitOptions& options);

// What becomes of an update after a commit attempt, decided in one place:
//   kPublish  the attempt succeeded and its base is still the served generation
//             (whatever abort was asked for while it ran);
//   kRetry    the writer can fix it and commit again (a bad label or expected
//             hash, or a segment still mapped writable: INVALID_ARGUMENT or
//             FAILED_PRECONDITION before anything was sealed) and the base is
//             still served: the update stays open;
//   kAbort    anything else; `abort_reason` (kUpdateAbortReasons) is the
//             one `abort_requested` names when an abort was asked for while
//             the commit ran (an unload, AbortUpdate, the writer's fd-socket
//             connection closing), else "verification_failed" once sealed,
//             "superseded" when another generation was published meanwhile,
//             else "aborted_by_writer".
struct CommitDecision {
  enum class Fate { kPublish, kRetry, kAbort };
  Fate fate = Fate::kAbort;
  std::string abort_reason = {};
};
CommitDecision DecideCommit(const CommitAttempt& attempt, bool base_still_served,
                            const std::optional<std::string>& abort_requested = std::nullopt);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_UPDATE_UPDATE_H_
