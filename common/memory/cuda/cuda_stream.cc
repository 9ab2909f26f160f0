// The stream of one daemon-side arena: asynchronous host-to-device copies
// (1D, 2D, or row by row past the 2D engine's pitch limit) and fences as
// recycled events.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/memory/cuda/cuda_internal.h"
#include "common/base/status.h"

namespace weightd {

absl::StatusOr<std::unique_ptr<CopyStream>> CopyStream::Create(const CudaContext& context) {
  const CudaFunctions& cu = context.cu();
  int max_pitch = 0;
  WEIGHTD_RETURN_IF_ERROR(
      WEIGHTD_CU(cu, DeviceGetAttribute, &max_pitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, context.device()));
  std::unique_ptr<CopyStream> s(new CopyStream(cu, static_cast<uint64_t>(max_pitch)));
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, StreamCreate, &s->stream_, CU_STREAM_NON_BLOCKING));
  return s;
}

CopyStream::~CopyStream() {
  if (stream_ == nullptr) return;
  cu_.StreamSynchronize(stream_);
  for (CUevent e : events_) cu_.EventDestroy(e);
  cu_.StreamDestroy(stream_);
}

absl::Status CopyStream::Zero(CUdeviceptr dst, uint64_t n) { return WEIGHTD_CU(cu_, MemsetD8Async, dst, 0, n, stream_); }

absl::Status CopyStream::Copy(CUdeviceptr dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch, uint64_t width,
                              uint64_t rows) {
  if (rows == 0 || width == 0) return absl::OkStatus();
  if (rows == 1 || (dst_pitch == width && src_pitch == width)) {
    return WEIGHTD_CU(cu_, MemcpyHtoDAsync, dst, src, width * rows, stream_);
  }
  if (dst_pitch <= max_pitch_ && src_pitch <= max_pitch_) {
    CUDA_MEMCPY2D copy = {};
    copy.srcMemoryType = CU_MEMORYTYPE_HOST;
    copy.srcHost = src;
    copy.srcPitch = src_pitch;
    copy.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    copy.dstDevice = dst;
    copy.dstPitch = dst_pitch;
    copy.WidthInBytes = width;
    copy.Height = rows;
    return WEIGHTD_CU(cu_, Memcpy2DAsync, &copy, stream_);
  }
  for (uint64_t r = 0; r < rows; ++r) {
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu_, MemcpyHtoDAsync, dst + r * dst_pitch,
                                       static_cast<const char*>(src) + r * src_pitch, width, stream_));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CopyStream::RecordFence() {
  absl::MutexLock lock(&mu_);
  CUevent event = nullptr;
  if (free_.empty()) {
    // BLOCKING_SYNC: a loader thread waiting for its staging buffer sleeps
    // instead of spinning a core (cuEventCreate: without it "the CPU thread
    // will busy-wait"), which the inference processes beside weightd feel.
    WEIGHTD_RETURN_IF_ERROR(
        WEIGHTD_CU(cu_, EventCreate, &event, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC));
    events_.push_back(event);
  } else {
    event = free_.back();
    free_.pop_back();
  }
  absl::Status recorded = WEIGHTD_CU(cu_, EventRecord, event, stream_);
  if (!recorded.ok()) {
    free_.push_back(event);
    return recorded;
  }
  pending_[++last_] = event;
  return last_;
}

// Waits without holding the lock, so another thread can record the next
// fence meanwhile. If another waiter retires this fence's event and it is
// recorded again, this wait covers later copies too: longer, never shorter.
absl::Status CopyStream::WaitFence(uint64_t fence) {
  CUevent event = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (fence <= completed_) return absl::OkStatus();
    if (fence > last_) {
      return absl::InvalidArgumentError(absl::StrCat("fence ", fence, " was never recorded (the last is ", last_, ")"));
    }
    event = pending_.at(fence);
  }
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu_, EventSynchronize, event));
  absl::MutexLock lock(&mu_);
  while (!pending_.empty() && pending_.begin()->first <= fence) {
    free_.push_back(pending_.begin()->second);
    pending_.erase(pending_.begin());
  }
  completed_ = std::max(completed_, fence);
  return absl::OkStatus();
}

absl::Status CopyStream::Synchronize() { return WEIGHTD_CU(cu_, StreamSynchronize, stream_); }

}  // namespace weightd
