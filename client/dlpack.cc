// MappedModel::ToDLPack: a framework-owned view of a mapped tensor that keeps
// the mapping (and so the lease) alive until the framework drops it.
#include <dlpack/dlpack.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "client/dlpack_dtype.h"
#include "weightd/client.h"

namespace weightd {
namespace {

absl::StatusOr<DLDataType> ToDLDataType(const std::string& dtype) {
  if (const DlpackDtype* d = FindDlpackDtype(dtype)) return DLDataType{d->code, d->bits, 1};
  return absl::UnimplementedError(absl::StrCat("dtype ", dtype, " has no DLPack 0.6 type code; read it as raw bytes"));
}

// Owns what a DLManagedTensor points at.
struct Holder {
  std::shared_ptr<const void> keep_alive;
  std::vector<int64_t> shape, strides;
  DLManagedTensor tensor;
};

}  // namespace

namespace {

// A DLPack tensor of `view`'s shape and dtype at `data` on `device`, keeping `state` alive.
absl::StatusOr<DLManagedTensor*> MakeDLPack(const TensorView& view, void* data, DLDevice device,
                                            std::shared_ptr<const void> state) {
  absl::StatusOr<DLDataType> dtype = ToDLDataType(view.info->dtype);
  if (!dtype.ok()) return absl::Status(dtype.status().code(), absl::StrCat("tensor '", view.info->name, "': ", dtype.status().message()));
  auto holder = std::make_unique<Holder>();
  holder->keep_alive = std::move(state);
  for (uint64_t d : view.info->shape) holder->shape.push_back(static_cast<int64_t>(d));
  holder->strides.assign(holder->shape.size(), 1);
  for (int i = static_cast<int>(holder->shape.size()) - 2; i >= 0; --i) {
    holder->strides[i] = holder->strides[i + 1] * holder->shape[i + 1];
  }
  DLTensor& t = holder->tensor.dl_tensor;
  t.data = data;
  t.device = device;
  t.ndim = static_cast<int32_t>(holder->shape.size());
  t.dtype = *dtype;
  t.shape = holder->shape.data();
  t.strides = holder->strides.data();
  t.byte_offset = 0;
  holder->tensor.manager_ctx = holder.get();
  holder->tensor.deleter = [](DLManagedTensor* self) { delete static_cast<Holder*>(self->manager_ctx); };
  return &holder.release()->tensor;
}

}  // namespace

absl::StatusOr<DLManagedTensor*> MappedModel::ToDLPack(const TensorView& view) const {
  bool cuda = view.location == Location::kDevice && view.info && manifest().segments[view.info->segment].backend != "emulated";
  DLDevice device = cuda ? DLDevice{kDLCUDA, view.device_ordinal} : DLDevice{kDLCPU, 0};
  return MakeDLPack(view, const_cast<void*>(view.data), device, std::static_pointer_cast<const void>(state_));
}

absl::StatusOr<DLManagedTensor*> MappedModel::ToPinnedDLPack(const TensorView& view) const {
  uint64_t device_ptr = this->device_ptr(view);
  if (device_ptr == 0) {
    PinStatus pin = pin_status();
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor '", view.info->name, "' has no device pointer: ",
        pin.state != "READY" && pin.state != "NOT_PINNED" ? absl::StrCat("pinning is ", pin.state)
        : view.nbytes == 0                                 ? std::string("it has no bytes")
                                                           : std::string("it is not pinned (AttachOptions::pin)")));
  }
  return MakeDLPack(view, reinterpret_cast<void*>(static_cast<uintptr_t>(device_ptr)),
                    DLDevice{kDLCUDA, pin_status().device_ordinal}, std::static_pointer_cast<const void>(state_));
}

}  // namespace weightd
