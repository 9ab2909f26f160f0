// HostPinner: pins a model's host tensors for GPU reads off the attach path.
// A client that attaches with pin patterns (AttachOptions::pin in C++,
// attach(pin=...) in Python) starts one per attached model: its thread makes
// the HostRegistrar (loading the CUDA driver there, not in the attach), then
// registers the chunks of the PinPlan (pin_plan.h) in order, one call each,
// publishing progress after each. The attach returns at once; readers poll
// progress() or block in Wait().
//
// States: kRegistering -> kReady (every chunk registered), or -> kFailed (a
// registration or the registrar failed: what was registered is unregistered
// again, and error() names the chunk's segment, byte range and first tensor
// with the driver's error), or -> kStopped (Stop() before the end).
// Device pointers are handed out only in kReady, so a failure never pulls
// memory from under a kernel given one.
//
// Ownership and threads: the pinner borrows the host mappings (they must
// stay mapped until Stop() returns). progress(), Wait() and DevicePointer()
// may be called from any thread. Stop() (and the destructor) from one
// thread: it waits for the step in flight (one chunk's registration, or the
// driver load before the first), then unregisters everything registered, in
// reverse order, on the calling thread.
#ifndef WEIGHTD_COMMON_MEMORY_HOST_PINNER_H_
#define WEIGHTD_COMMON_MEMORY_HOST_PINNER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/memory/host_registrar.h"
#include "common/memory/pin_plan.h"

namespace weightd {

enum class PinState { kRegistering, kReady, kFailed, kStopped };
// "REGISTERING", "READY", "FAILED", "STOPPED".
const char* PinStateName(PinState state);

struct PinProgress {
  PinState state = PinState::kRegistering;
  uint64_t bytes_done = 0;     // registered so far (kFailed, kStopped: when it ended; all unregistered since)
  uint64_t bytes_total = 0;    // of the plan
  uint32_t chunks_done = 0;
  uint32_t chunks_total = 0;
  uint32_t tensors = 0;        // tensors pinned (nonzero bytes), once ready
  bool read_only = false;      // registered read-only for the device (false until one chunk is)
  int device_ordinal = -1;     // of the registering context, once the registrar exists
  double register_seconds = 0; // time spent inside Register calls
  double seconds = 0;          // since Start, until ready/failed/stopped
  absl::Status error;          // kFailed: why; kStopped: CANCELLED
};

// What to pin: the host mappings of a model's segments and the tensors in them.
struct PinInput {
  std::vector<const char*> segment_bases;  // this process's mapping of each segment (nullptr: not a host mapping)
  std::vector<uint64_t> segment_sizes;
  std::vector<PinTensor> tensors;
  uint64_t chunk_bytes = kDefaultPinChunkBytes;
};

class HostPinner {
 public:
  using RegistrarFactory = std::function<absl::StatusOr<std::unique_ptr<HostRegistrar>>()>;

  // Plans `input` and starts the thread. INVALID_ARGUMENT (from
  // PlanPinChunks, or a tensor in a segment with no host mapping) before any
  // thread starts. `make_registrar` runs on the thread.
  static absl::StatusOr<std::unique_ptr<HostPinner>> Start(PinInput input, RegistrarFactory make_registrar);
  ~HostPinner();  // Stop()
  HostPinner(const HostPinner&) = delete;
  HostPinner& operator=(const HostPinner&) = delete;

  PinProgress progress() const;
  // Blocks until the state leaves kRegistering or `timeout` passes: OK when
  // ready; the failure; CANCELLED after Stop(); DEADLINE_EXCEEDED (with the
  // progress so far) on timeout.
  absl::Status Wait(absl::Duration timeout) const;
  // The device address of tensor `i` of the input when ready; else 0 (and
  // always 0 for zero-byte tensors).
  uint64_t DevicePointer(size_t i) const;
  // Asks the thread to stop before its next registration; returns at once.
  // Any thread.
  void RequestStop();
  // Ends pinning: RequestStop(), wait for the step in flight, then unregister
  // every registered chunk. Idempotent.
  void Stop();

  const PinPlan& plan() const { return plan_; }

 private:
  HostPinner(PinInput input, PinPlan plan);
  void Run(RegistrarFactory make_registrar);
  // Registers chunk `c`; its device address.
  absl::StatusOr<uint64_t> RegisterChunk(size_t c, bool read_only);
  void UnregisterAll();
  void Finish(PinState state, absl::Status error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const char* ChunkBase(size_t c) const;

  const PinInput input_;
  const PinPlan plan_;
  const absl::Time start_;
  // Written by the thread; read by Stop() only after the join.
  std::unique_ptr<HostRegistrar> registrar_;
  size_t registered_ = 0;  // chunks [0, registered_) are registered
  std::thread thread_;
  bool stopped_ = false;  // Stop() ran (caller thread only)

  mutable absl::Mutex mu_;
  PinProgress progress_ ABSL_GUARDED_BY(mu_);
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<uint64_t> device_bases_ ABSL_GUARDED_BY(mu_);  // per chunk; 0: not registered
};

}  // namespace weightd

#endif  // WEIGHTD_COMMON_MEMORY_HOST_PINNER_H_
