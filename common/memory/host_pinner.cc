#include "common/memory/host_pinner.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace weightd {

const char* PinStateName(PinState state) {
  switch (state) {
    case PinState::kRegistering: return "REGISTERING";
    case PinState::kReady: return "READY";
    case PinState::kFailed: return "FAILED";
    case PinState::kStopped: return "STOPPED";
  }
  return "UNKNOWN";
}

namespace {

// Every pinned tensor's segment must be a page-aligned host mapping here.
absl::Status CheckMappings(const PinInput& input) {
  if (input.segment_bases.size() != input.segment_sizes.size()) {
    return absl::InvalidArgumentError("pinning: one base address per segment size is needed");
  }
  for (const PinTensor& t : input.tensors) {
    if (t.nbytes == 0 || t.segment >= input.segment_bases.size()) continue;  // PlanPinChunks names the latter
    uintptr_t base = reinterpret_cast<uintptr_t>(input.segment_bases[t.segment]);
    if (base == 0 || base % kPinPageBytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat("pinned tensor ", QuoteName(t.name), " is in segment ", t.segment,
                                                     ", which is not a page-aligned host mapping of this process"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostPinner>> HostPinner::Start(PinInput input, RegistrarFactory make_registrar) {
  WEIGHTD_RETURN_IF_ERROR(CheckMappings(input));
  WEIGHTD_ASSIGN_OR_RETURN(PinPlan plan, PlanPinChunks(input.tensors, input.segment_sizes, input.chunk_bytes));
  std::unique_ptr<HostPinner> pinner(new HostPinner(std::move(input), std::move(plan)));
  pinner->thread_ = std::thread(&HostPinner::Run, pinner.get(), std::move(make_registrar));
  return pinner;
}

HostPinner::HostPinner(PinInput input, PinPlan plan)
    : input_(std::move(input)), plan_(std::move(plan)), start_(absl::Now()) {
  progress_.bytes_total = plan_.bytes;
  progress_.chunks_total = static_cast<uint32_t>(plan_.chunks.size());
  device_bases_.assign(plan_.chunks.size(), 0);
}

HostPinner::~HostPinner() { Stop(); }

const char* HostPinner::ChunkBase(size_t c) const {
  const PinChunk& chunk = plan_.chunks[c];
  return input_.segment_bases[chunk.segment] + chunk.offset;
}

void HostPinner::Finish(PinState state, absl::Status error) {
  progress_.state = state;
  progress_.error = std::move(error);
  progress_.seconds = absl::ToDoubleSeconds(absl::Now() - start_);
}

absl::StatusOr<uint64_t> HostPinner::RegisterChunk(size_t c, bool read_only) {
  absl::StatusOr<uint64_t> device = registrar_->Register(ChunkBase(c), plan_.chunks[c].bytes, read_only);
  if (!device.ok()) return Annotate(device.status(), absl::StrCat("pinning ", DescribePinChunk(plan_, c, input_.tensors)));
  return device;
}

void HostPinner::Run(RegistrarFactory make_registrar) {
  absl::StatusOr<std::unique_ptr<HostRegistrar>> made = make_registrar();
  if (!made.ok()) {
    absl::MutexLock lock(&mu_);
    return Finish(PinState::kFailed, Annotate(made.status(), "pinning host tensors"));
  }
  registrar_ = std::move(*made);
  const bool read_only = registrar_->read_only_supported();
  {
    absl::MutexLock lock(&mu_);
    progress_.device_ordinal = registrar_->device_ordinal();
  }
  for (size_t c = 0; c < plan_.chunks.size(); ++c) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_requested_) return Finish(PinState::kStopped, absl::CancelledError("pinning stopped: detached"));
    }
    absl::Time begin = absl::Now();
    absl::StatusOr<uint64_t> device = RegisterChunk(c, read_only);
    double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
    if (!device.ok()) {
      UnregisterAll();  // no device pointer was handed out: nothing can still read these
      absl::MutexLock lock(&mu_);
      return Finish(PinState::kFailed, device.status());
    }
    ++registered_;
    absl::MutexLock lock(&mu_);
    device_bases_[c] = *device;
    progress_.bytes_done += plan_.chunks[c].bytes;
    progress_.chunks_done += 1;
    progress_.register_seconds += seconds;
    progress_.read_only = read_only;
  }
  absl::MutexLock lock(&mu_);
  if (stop_requested_) return Finish(PinState::kStopped, absl::CancelledError("pinning stopped: detached"));
  uint32_t tensors = 0;
  for (int64_t c : plan_.chunk_of) tensors += c >= 0 ? 1 : 0;
  progress_.tensors = tensors;
  Finish(PinState::kReady, absl::OkStatus());
}

void HostPinner::UnregisterAll() {
  for (size_t c = registered_; c-- > 0;) {
    absl::Status s = registrar_->Unregister(ChunkBase(c));
    if (!s.ok()) LogWarning(absl::StrCat("unpinning ", DescribePinChunk(plan_, c, input_.tensors), ": ", s.ToString()));
  }
  registered_ = 0;
  absl::MutexLock lock(&mu_);
  device_bases_.assign(device_bases_.size(), 0);
}

void HostPinner::RequestStop() {
  absl::MutexLock lock(&mu_);
  stop_requested_ = true;
}

void HostPinner::Stop() {
  if (stopped_) return;
  stopped_ = true;
  RequestStop();
  if (thread_.joinable()) thread_.join();
  {
    // Readers stop getting device pointers before any range is unregistered.
    absl::MutexLock lock(&mu_);
    if (progress_.state == PinState::kReady) Finish(PinState::kStopped, absl::CancelledError("pinning stopped: detached"));
  }
  if (registrar_ != nullptr) UnregisterAll();
  registrar_.reset();
}

PinProgress HostPinner::progress() const {
  absl::MutexLock lock(&mu_);
  PinProgress p = progress_;
  if (p.state == PinState::kRegistering) p.seconds = absl::ToDoubleSeconds(absl::Now() - start_);
  return p;
}

absl::Status HostPinner::Wait(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return progress_.state != PinState::kRegistering; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "pinning not ready after %s: %d of %d bytes registered (%d of %d chunks)", absl::FormatDuration(timeout),
        progress_.bytes_done, progress_.bytes_total, progress_.chunks_done, progress_.chunks_total));
  }
  return progress_.state == PinState::kReady ? absl::OkStatus() : progress_.error;
}

uint64_t HostPinner::DevicePointer(size_t i) const {
  if (i >= plan_.chunk_of.size() || plan_.chunk_of[i] < 0) return 0;
  const PinChunk& chunk = plan_.chunks[plan_.chunk_of[i]];
  absl::MutexLock lock(&mu_);
  if (progress_.state != PinState::kReady) return 0;
  return device_bases_[plan_.chunk_of[i]] + (input_.tensors[i].offset - chunk.offset);
}

}  // namespace weightd
