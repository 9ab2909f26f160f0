// The pinning steps of Client::Attach (AttachOptions::pin, docs/api.md
// "Pinned host tables"): the checks before the Attach RPC, the choice of
// tensors once the manifest is known, and the start of the HostPinner
// (common/memory/host_pinner.h) once the segments are mapped.
#ifndef WEIGHTD_CLIENT_PIN_H_
#define WEIGHTD_CLIENT_PIN_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/memory/host_pinner.h"
#include "weightd/client.h"

namespace weightd {

// What can be refused before a lease is taken: INVALID_ARGUMENT for pin
// patterns with copy_on_write, or a chunk size outside [4 KiB, 64 GiB].
absl::Status CheckPinOptions(const AttachOptions& options);

// The manifest indices of the host tensors `pin` selects, in manifest order
// (empty when pin has no patterns). INVALID_ARGUMENT naming a pattern that
// matches no host tensor.
absl::StatusOr<std::vector<size_t>> SelectPinnedTensors(const Manifest& manifest, const PinOptions& pin);

// Starts pinning tensors `selected` of `manifest`, whose segments are mapped
// at `bases` (host segments; device bases are ignored), with the CUDA
// registrar of this process's device `ordinal`.
absl::StatusOr<std::unique_ptr<HostPinner>> StartPinning(const Manifest& manifest, const std::vector<size_t>& selected,
                                                         const std::vector<const char*>& bases, uint64_t chunk_bytes,
                                                         int ordinal);

PinStatus ToPinStatus(const PinProgress& progress);

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_PIN_H_
