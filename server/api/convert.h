// Conversions between the gRPC messages (weightd.v1) and the core's domain
// types, and the one place absl::Status becomes grpc::Status.
#ifndef WEIGHTD_SERVER_API_CONVERT_H_
#define WEIGHTD_SERVER_API_CONVERT_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/layout/layout_publish.h"
#include "server/load/loader.h"
#include "server/model/layout.h"
#include "server/model/model.h"
#include "server/model/model_events.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

// The API enum of a model state; its name (v1::ModelState_Name) is the one
// spelling of states in messages, metrics labels and clients.
v1::ModelState StateToProto(ModelState s);

// Same code; the message capped at kMaxStatusMessageBytes (common/base/status.h) with a
// visible marker, so that it always reaches the client. Payloads stay behind.
grpc::Status ToGrpcStatus(const absl::Status& status);
LoadRequest FromProto(const v1::LoadModelRequest& request);
void ToProto(const ModelGeneration& model, v1::ModelInfo* out);
void ToProto(const TensorRecord& tensor, v1::TensorEntry* out);
void ToProto(const SegmentRecord& segment, uint32_t id, v1::SegmentDescriptor* out);
void ToProto(const LoadProgress& progress, v1::LoadModelProgress* out);
void ToProto(const ModelEvent& event, v1::ModelEvent* out);
// A runtime layout's summary, and its tensors as manifest entries.
void ToProto(const Layout& layout, v1::LayoutInfo* out);
void ToProto(const LayoutTensor& tensor, v1::TensorEntry* out);
// A BeginLayout request; INVALID_ARGUMENT naming the tensor for an unknown
// dtype or placement, or more tensors, dims or identity fields than the
// bounds allow (server/layout/layout_publish.h), before anything is copied.
absl::StatusOr<LayoutRequest> FromProto(const v1::BeginLayoutRequest& request);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_API_CONVERT_H_
