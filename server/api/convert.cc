#include "server/api/convert.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status.h"
#include "common/format/content_hash.h"

namespace weightd {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering. The message is capped:
  // a longer one would exceed the client's metadata limit and arrive as
  // RESOURCE_EXHAUSTED "received initial metadata size exceeds limit".
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), CapMessage(status.message()));
}

LoadRequest FromProto(const v1::LoadModelRequest& r) {
  LoadRequest out;
  out.name = r.name();
  out.checkpoint_path = r.checkpoint_path();
  out.host_resident_patterns.assign(r.host_resident_patterns().begin(), r.host_resident_patterns().end());
  out.include_patterns.assign(r.include_patterns().begin(), r.include_patterns().end());
  out.exclude_patterns.assign(r.exclude_patterns().begin(), r.exclude_patterns().end());
  out.numa_copies = r.numa_copies();
  out.tp_size = r.tp_size() == 0 ? 1 : r.tp_size();
  for (const v1::TpRule& rule : r.tp_rules()) out.tp_rules.push_back({rule.pattern(), rule.dim()});
  out.devices.assign(r.devices().begin(), r.devices().end());
  out.peers.assign(r.peers().begin(), r.peers().end());
  return out;
}

v1::ModelState StateToProto(ModelState s) {
  switch (s) {
    case ModelState::kLoading: return v1::LOADING;
    case ModelState::kReady: return v1::READY;
    case ModelState::kFailed: return v1::FAILED;
    case ModelState::kDraining: return v1::DRAINING;
  }
  return v1::MODEL_STATE_UNSPECIFIED;
}

void ToProto(const ModelGeneration& m, v1::ModelInfo* out) {
  out->set_name(m.request.name);
  out->set_generation(m.generation);
  out->set_state(StateToProto(m.state.load()));
  out->set_checkpoint_path(m.request.checkpoint_path);
  out->set_host_bytes(m.host_bytes);
  out->set_locked_bytes(m.locked_bytes.load());
  out->set_huge_page_bytes(m.huge_page_bytes);
  out->set_checkpoint_bytes(m.checkpoint_bytes);
  out->set_bytes_read(m.bytes_read);
  out->set_bytes_shared(m.bytes_reused);
  for (const NumaCopy& copy : m.numa_copies) out->add_numa_nodes(copy.node);
  for (const std::string& w : m.warnings) out->add_warnings(w);
  for (const SegmentRecord& s : m.segments) {
    if (s.placement != Placement::kDevice) continue;
    v1::DeviceBytes* d = nullptr;
    for (auto& existing : *out->mutable_device_bytes()) {
      if (existing.gpu_uuid() == s.gpu_uuid) d = &existing;
    }
    if (d == nullptr) {
      d = out->add_device_bytes();
      d->set_gpu_uuid(s.gpu_uuid);
    }
    d->set_bytes(d->bytes() + s.size);
  }
  out->set_leases(static_cast<uint32_t>(m.leases.load()));
  out->set_fingerprint(m.fingerprint);
  out->set_tensor_count(static_cast<uint32_t>(m.tensor_count));
  out->set_tp_size(m.request.tp_size);
  out->set_load_seconds(m.load_seconds);
  out->set_error(m.error);
  out->set_bytes_done(m.bytes_done.load());
  out->set_bytes_total(m.bytes_total.load());
  out->set_version_label(m.version_label);
  out->set_source(m.source);
  for (const auto& layout : m.layouts->List()) ToProto(*layout, out->add_layouts());
}

void ToProto(const Layout& l, v1::LayoutInfo* out) {
  out->set_key(l.key);
  out->set_rank(l.rank);
  out->mutable_identity()->insert(l.identity.begin(), l.identity.end());
  out->set_generation(l.generation);
  out->set_tensor_count(static_cast<uint32_t>(l.tensors.size()));
  out->set_host_bytes(l.host_bytes);
  if (l.device_bytes > 0) {
    v1::DeviceBytes* d = out->add_device_bytes();
    d->set_gpu_uuid(l.gpu_uuid);
    d->set_bytes(l.device_bytes);
  }
  out->set_leases(static_cast<uint32_t>(l.leases.load()));
  out->set_fingerprint(l.fingerprint);
  out->set_publish_seconds(l.publish_seconds);
  out->set_published_at(l.published_at);
}

void ToProto(const LayoutTensor& t, v1::TensorEntry* out) {
  ToProto(t.record, out);
  for (uint64_t s : t.strides) out->add_strides(s);
}

absl::StatusOr<LayoutRequest> FromProto(const v1::BeginLayoutRequest& r) {
  if (static_cast<size_t>(r.tensors_size()) > kMaxLayoutTensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("a layout holds at most ", kMaxLayoutTensors, " tensors; this one declares ", r.tensors_size()));
  }
  if (static_cast<size_t>(r.identity_size()) > kMaxIdentityEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat("the layout identity has ", r.identity_size(), " fields; at most ", kMaxIdentityEntries));
  }
  LayoutRequest out;
  out.model = r.name();
  out.key = r.key();
  out.identity.insert(r.identity().begin(), r.identity().end());
  out.rank = r.rank();
  out.gpu_uuid = r.gpu_uuid();
  out.generation = r.generation();
  out.wait_seconds = r.wait_seconds();
  out.tensors.reserve(r.tensors_size());
  for (const v1::LayoutTensorSpec& t : r.tensors()) {
    LayoutTensorSpec spec;
    spec.name = t.name();
    std::optional<DType> dtype = ParseDType(t.dtype());
    if (!dtype.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("layout tensor ", QuoteName(t.name()), " has dtype ",
                                                     QuoteName(t.dtype()), ", which is no safetensors dtype"));
    }
    spec.dtype = *dtype;
    if (static_cast<size_t>(t.shape_size()) > kMaxLayoutDims || static_cast<size_t>(t.strides_size()) > kMaxLayoutDims) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout tensor ", QuoteName(t.name()), " has more than ", kMaxLayoutDims, " dims"));
    }
    spec.shape.assign(t.shape().begin(), t.shape().end());
    spec.strides.assign(t.strides().begin(), t.strides().end());
    if (t.placement() == v1::HOST) {
      spec.placement = Placement::kHost;
    } else if (t.placement() == v1::DEVICE) {
      spec.placement = Placement::kDevice;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("layout tensor ", QuoteName(t.name()), " needs a placement (HOST or DEVICE)"));
    }
    out.tensors.push_back(std::move(spec));
  }
  return out;
}

void ToProto(const TensorRecord& t, v1::TensorEntry* out) {
  out->set_name(t.name);
  out->set_dtype(std::string(DTypeName(t.dtype)));
  for (uint64_t d : t.shape) out->add_shape(d);
  out->set_placement(t.placement == Placement::kHost ? v1::HOST : v1::DEVICE);
  out->set_segment(t.segment);
  out->set_offset(t.offset);
  out->set_nbytes(t.nbytes);
  for (uint64_t d : t.full_shape) out->add_full_shape(d);
  out->set_split_dim(t.split_dim);
  out->set_split_start(t.split_start);
  out->set_content_hash(ContentHashHex(t.content_hash));
}

void ToProto(const SegmentRecord& s, uint32_t id, v1::SegmentDescriptor* out) {
  out->set_id(id);
  out->set_placement(s.placement == Placement::kHost ? v1::HOST : v1::DEVICE);
  out->set_size(s.size);
  out->set_gpu_uuid(s.gpu_uuid);
  out->set_backend(std::string(SegmentBackendName(s.backend)));
  out->set_ipc_handle(s.handle);
  out->set_export_kind(s.exports_fd() ? v1::SegmentDescriptor::EXPORT_FD : v1::SegmentDescriptor::EXPORT_IPC_HANDLE);
}

void ToProto(const LoadProgress& p, v1::LoadModelProgress* out) {
  out->set_phase(static_cast<v1::LoadModelProgress::Phase>(static_cast<int>(p.phase) + 1));
  out->set_bytes_done(p.bytes_done);
  out->set_bytes_total(p.bytes_total);
  out->set_bytes_reused(p.bytes_reused);
  out->set_files_done(p.files_done);
  out->set_files_total(p.files_total);
  out->set_seconds(p.seconds);
}

void ToProto(const ModelEvent& e, v1::ModelEvent* out) {
  out->set_model(e.name);
  switch (e.kind) {
    case ModelEvent::Kind::kCurrent: out->set_kind(v1::ModelEvent::CURRENT); break;
    case ModelEvent::Kind::kPublished: out->set_kind(v1::ModelEvent::PUBLISHED); break;
    case ModelEvent::Kind::kDraining: out->set_kind(v1::ModelEvent::DRAINING); break;
    case ModelEvent::Kind::kFreed: out->set_kind(v1::ModelEvent::FREED); break;
    case ModelEvent::Kind::kUnloaded: out->set_kind(v1::ModelEvent::UNLOADED); break;
    case ModelEvent::Kind::kLayoutPublished: out->set_kind(v1::ModelEvent::LAYOUT_PUBLISHED); break;
    case ModelEvent::Kind::kLayoutDropped: out->set_kind(v1::ModelEvent::LAYOUT_DROPPED); break;
    case ModelEvent::Kind::kLayoutDraining: out->set_kind(v1::ModelEvent::LAYOUT_DRAINING); break;
  }
  out->set_generation(e.generation);
  out->set_version_label(e.version_label);
  out->set_fingerprint(e.fingerprint);
  out->set_time(e.unix_seconds);
  out->set_layout(e.layout);
  out->set_rank(e.rank);
}

}  // namespace weightd
