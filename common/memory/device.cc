#include "common/memory/device.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status.h"

namespace weightd {

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceBackend::Adopt(const DeviceInfo& device, ScopedFd, uint64_t) {
  return absl::UnimplementedError(
      absl::StrCat("the ", name(), " device backend cannot adopt an arena of an earlier process (", device.uuid, ")"));
}

std::string DeviceList(const std::vector<DeviceInfo>& devices, bool with_names) {
  return absl::StrJoin(devices, ", ", [&](std::string* out, const DeviceInfo& d) {
    absl::StrAppend(out, d.ordinal, "=", d.uuid, with_names ? absl::StrCat(" (", d.name, ")") : "");
  });
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeDeviceBackend(const std::string& name, std::string* chosen) {
  auto say = [&](std::string line) {
    if (chosen != nullptr) *chosen = std::move(line);
  };
  if (name == "none") {
    say("device backend: none (every tensor on the host)");
    return std::unique_ptr<DeviceBackend>();
  }
  if (name == "emulated") {
    say("device backend: emulated (memfd-backed devices GPU-emulated-0..7; for tests, no GPU is used)");
    return MakeEmulatedBackend();
  }
  if (name == "cuda" || name == "cuda-legacy-ipc") {
    absl::StatusOr<std::unique_ptr<DeviceBackend>> cuda = MakeCudaBackend(name == "cuda-legacy-ipc");
    if (!cuda.ok()) return cuda.status();
    absl::StatusOr<std::vector<DeviceInfo>> devices = (*cuda)->Devices();
    if (!devices.ok()) return devices.status();
    say(absl::StrCat("device backend: ", name, " with ", devices->size(), " GPU(s): ", DeviceList(*devices)));
    return cuda;
  }
  if (name != "auto") return absl::InvalidArgumentError(absl::StrCat("unknown device backend '", name, "'"));
  absl::StatusOr<std::unique_ptr<DeviceBackend>> cuda = MakeCudaBackend(false);
  if (cuda.ok()) {
    absl::StatusOr<std::vector<DeviceInfo>> devices = (*cuda)->Devices();
    if (devices.ok() && !devices->empty()) {
      say(absl::StrCat("device backend auto: found ", devices->size(), " GPU(s) (", DeviceList(*devices),
                       "); using cuda (VMM)"));
      return cuda;
    }
    say(absl::StrCat("device backend auto: CUDA driver loaded but no GPU (",
                     devices.ok() ? "0 devices" : std::string(devices.status().message()), "); host only"));
    return std::unique_ptr<DeviceBackend>();
  }
  say(absl::StrCat("device backend auto: no GPU (", cuda.status().message(), "); host only"));
  return std::unique_ptr<DeviceBackend>();
}

absl::StatusOr<DeviceBackend*> ClientBackendFor(const std::string& backend_name) {
  static absl::Mutex mu(absl::kConstInit);
  static std::unique_ptr<DeviceBackend> emulated ABSL_GUARDED_BY(mu), cuda ABSL_GUARDED_BY(mu),
      legacy ABSL_GUARDED_BY(mu);
  absl::MutexLock lock(&mu);
  absl::StatusOr<SegmentBackend> kind = ParseSegmentBackend(backend_name);
  if (kind.ok() && *kind == SegmentBackend::kEmulated) {
    if (!emulated) emulated = MakeEmulatedBackend();
    return emulated.get();
  }
  if (kind.ok() && (*kind == SegmentBackend::kCudaVmm || *kind == SegmentBackend::kCudaLegacyIpc)) {
    bool is_legacy = *kind == SegmentBackend::kCudaLegacyIpc;
    std::unique_ptr<DeviceBackend>& slot = is_legacy ? legacy : cuda;
    if (!slot) {
      absl::StatusOr<std::unique_ptr<DeviceBackend>> made = MakeCudaBackend(is_legacy);
      if (!made.ok()) return made.status();
      slot = std::move(*made);
    }
    return slot.get();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown segment backend '", backend_name, "'"));
}

absl::Status CheckCopyOnWrite(SegmentBackend backend, const ArenaExport& exported) {
  if (!exported.copy_on_write || backend == SegmentBackend::kEmulated) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "a ", SegmentBackendName(backend), " arena on ", exported.gpu_uuid,
      " cannot be mapped copy-on-write (GPU memory has no private pages): attach without it and copy the "
      "device tensors you change"));
}

absl::StatusOr<std::unique_ptr<ImportedArena>> ImportArena(ArenaExport exported) {
  absl::StatusOr<SegmentBackend> kind = ParseSegmentBackend(exported.backend);
  if (kind.ok()) WEIGHTD_RETURN_IF_ERROR(CheckCopyOnWrite(*kind, exported));
  WEIGHTD_ASSIGN_OR_RETURN(DeviceBackend * backend, ClientBackendFor(exported.backend));
  return backend->Import(std::move(exported));
}

}  // namespace weightd
