#include "server/restart/state_record.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/status.h"
#include "common/format/dtype.h"
#include "server/load/loader.h"
#include "server/layout/layout_publish.h"
#include "server/registry/registry.h"

namespace weightd {
namespace {

using json = nlohmann::json;

constexpr char kMagic[8] = {'W', 'D', 'S', 'T', 'A', 'T', 'E', '1'};
constexpr uint64_t kMaxTensors = 10'000'000;  // per rank; far above any checkpoint we know
constexpr uint64_t kMaxSegments = 1'000'000;

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetU64(absl::string_view in, size_t at) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<unsigned char>(in[at + i])} << (8 * i);
  return v;
}

json SegmentJson(const StoredSegment& s) {
  return {{"fd_name", s.fd_name},   {"backend", std::string(SegmentBackendName(s.backend))},
          {"size", s.size},         {"inode", s.inode},
          {"huge_pages", s.huge_pages}, {"gpu_uuid", s.gpu_uuid}};
}

json TensorJson(const TensorRecord& t) {
  return {{"name", t.name},
          {"dtype", std::string(DTypeName(t.dtype))},
          {"shape", t.shape},
          {"placement", t.placement == Placement::kHost ? "host" : "device"},
          {"segment", t.segment},
          {"offset", t.offset},
          {"nbytes", t.nbytes},
          {"full_shape", t.full_shape},
          {"split_dim", t.split_dim},
          {"split_start", t.split_start},
          {"content_hash", t.content_hash}};
}

json RequestJson(const LoadRequest& r) {
  json rules = json::array();
  for (const TpRule& rule : r.tp_rules) rules.push_back({{"pattern", rule.pattern}, {"dim", rule.dim}});
  return {{"name", r.name},       {"checkpoint_path", r.checkpoint_path}, {"host_resident_patterns", r.host_resident_patterns},
          {"tp_size", r.tp_size}, {"tp_rules", rules},                    {"devices", r.devices},
          {"include_patterns", r.include_patterns}, {"exclude_patterns", r.exclude_patterns},
          {"numa_copies", r.numa_copies}};
}

json FileJson(const GenerationFile& f) {
  const FileIdentity& id = f.stamp.identity;
  return {{"name", f.stamp.name}, {"dev", id.dev},         {"ino", id.ino},
          {"size", id.size},      {"mtime_ns", id.mtime_ns}, {"ctime_ns", id.ctime_ns},
          {"header_hash", f.stamp.header_hash}, {"host_segments", f.host_segments}, {"arenas", f.arenas}};
}

json ModelJson(const ModelGeneration& m) {
  json segments = json::array();
  for (const SegmentRecord& s : m.segments) {
    segments.push_back({{"placement", s.placement == Placement::kHost ? "host" : "device"},
                        {"size", s.size},
                        {"backend", std::string(SegmentBackendName(s.backend))},
                        {"gpu_uuid", s.gpu_uuid},
                        {"owner", s.owner}});
  }
  json ranks = json::array();
  for (const RankManifest& r : m.ranks) {
    json tensors = json::array();
    for (const TensorRecord& t : r.tensors) tensors.push_back(TensorJson(t));
    ranks.push_back({{"segments", r.segments}, {"tensors", std::move(tensors)}});
  }
  json files = json::array();
  for (const GenerationFile& f : m.files) files.push_back(FileJson(f));
  json numa = json::array();
  for (const NumaCopy& c : m.numa_copies) {
    numa.push_back({{"node", c.node}, {"cpus", c.cpus}, {"host_segments", c.host_segments}});
  }
  return {{"request", RequestJson(m.request)},
          {"numa_copies", std::move(numa)},
          {"from_files", m.from_files},
          {"generation", m.generation},
          {"version_label", m.version_label},
          {"fingerprint", m.fingerprint},
          {"warnings", m.warnings},
          {"files", std::move(files)},
          {"segments", std::move(segments)},
          {"ranks", std::move(ranks)},
          {"load_seconds", m.load_seconds},
          {"checkpoint_bytes", m.checkpoint_bytes},
          {"host_bytes", m.host_bytes},
          {"bytes_read", m.bytes_read},
          {"bytes_reused", m.bytes_reused},
          {"tensor_count", m.tensor_count}};
}

// One layout; `host_base` / `arena_base`: where its segments start in the
// record's layout_host_fds / layout_arena_fds.
json LayoutJson(const Layout& l, size_t host_base, size_t arena_base) {
  json segments = json::array();
  for (const SegmentRecord& s : l.segments) {
    bool host = s.placement == Placement::kHost;
    segments.push_back({{"placement", host ? "host" : "device"},
                        {"stored", (host ? host_base : arena_base) + s.owner},
                        {"size", s.size},
                        {"backend", std::string(SegmentBackendName(s.backend))},
                        {"gpu_uuid", s.gpu_uuid}});
  }
  json tensors = json::array();
  for (const LayoutTensor& t : l.tensors) {
    json tensor = TensorJson(t.record);
    tensor["strides"] = t.strides;
    tensors.push_back(std::move(tensor));
  }
  return {{"key", l.key},
          {"rank", l.rank},
          {"identity", l.identity},
          {"fingerprint", l.fingerprint},
          {"publish_seconds", l.publish_seconds},
          {"published_at", l.published_at},
          {"segments", std::move(segments)},
          {"tensors", std::move(tensors)}};
}

// ------------------------------------------------------------------ decode

// Reads `key` of `j` as T; INVALID_ARGUMENT naming `where`.`key` otherwise.
template <typename T>
absl::StatusOr<T> Field(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) return absl::InvalidArgumentError(absl::StrCat(where, ".", key, " is missing"));
  try {
    return it->get<T>();
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, " has the wrong type: ", e.what()));
  }
}

absl::StatusOr<const json*> ArrayField(const json& j, const char* key, const std::string& where, uint64_t max) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_array()) return absl::InvalidArgumentError(absl::StrCat(where, ".", key, " is not an array"));
  if (it->size() > max) return absl::InvalidArgumentError(absl::StrCat(where, ".", key, " has over ", max, " entries"));
  return &*it;
}

absl::StatusOr<Placement> ParsePlacement(const std::string& s, const std::string& where) {
  if (s == "host") return Placement::kHost;
  if (s == "device") return Placement::kDevice;
  return absl::InvalidArgumentError(absl::StrCat(where, ".placement '", s, "' is neither host nor device"));
}

absl::StatusOr<StoredSegment> DecodeSegment(const json& j, const std::string& where) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " is not an object"));
  StoredSegment s;
  WEIGHTD_ASSIGN_OR_RETURN(s.fd_name, Field<std::string>(j, "fd_name", where));
  WEIGHTD_ASSIGN_OR_RETURN(std::string backend, Field<std::string>(j, "backend", where));
  WEIGHTD_ASSIGN_OR_RETURN(s.backend, ParseSegmentBackend(backend));
  WEIGHTD_ASSIGN_OR_RETURN(s.size, Field<uint64_t>(j, "size", where));
  WEIGHTD_ASSIGN_OR_RETURN(s.inode, Field<uint64_t>(j, "inode", where));
  WEIGHTD_ASSIGN_OR_RETURN(s.huge_pages, Field<bool>(j, "huge_pages", where));
  WEIGHTD_ASSIGN_OR_RETURN(s.gpu_uuid, Field<std::string>(j, "gpu_uuid", where));
  if (s.fd_name.empty() || s.fd_name.size() > 255) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".fd_name must be 1..255 characters"));
  }
  return s;
}

// A live load stores the path realpath(3) gave: absolute, with no ".", ".."
// or empty component. A record's path must be one too, so that the model
// root check, which is lexical, cannot be passed by "ROOT/../../etc".
absl::Status CheckResolvedPath(const std::string& path) {
  bool resolved = !path.empty() && path[0] == '/' && path.size() <= 4096 && path.find('\0') == std::string::npos;
  for (size_t at = 1; resolved && at <= path.size(); ) {
    size_t end = path.find('/', at);
    if (end == std::string::npos) end = path.size();
    std::string_view part(path.data() + at, end - at);
    resolved = !(part.empty() && path.size() > 1) && part != "." && part != "..";
    at = end + 1;
  }
  if (resolved) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("request.checkpoint_path ", QuoteName(path),
                                                 " is not a resolved absolute path (no '.', '..' or empty parts)"));
}

absl::StatusOr<LoadRequest> DecodeRequest(const json& j) {
  const std::string where = "request";
  if (!j.is_object()) return absl::InvalidArgumentError("request is not an object");
  LoadRequest r;
  WEIGHTD_ASSIGN_OR_RETURN(r.name, Field<std::string>(j, "name", where));
  WEIGHTD_RETURN_IF_ERROR(ValidateModelName(r.name));
  WEIGHTD_ASSIGN_OR_RETURN(r.checkpoint_path, Field<std::string>(j, "checkpoint_path", where));
  WEIGHTD_RETURN_IF_ERROR(CheckResolvedPath(r.checkpoint_path));
  WEIGHTD_ASSIGN_OR_RETURN(r.host_resident_patterns, Field<std::vector<std::string>>(j, "host_resident_patterns", where));
  WEIGHTD_ASSIGN_OR_RETURN(r.tp_size, Field<uint32_t>(j, "tp_size", where));
  WEIGHTD_ASSIGN_OR_RETURN(r.devices, Field<std::vector<std::string>>(j, "devices", where));
  // Records written before subset loads have neither list: the whole checkpoint.
  for (auto [key, list] : {std::pair{"include_patterns", &r.include_patterns}, std::pair{"exclude_patterns", &r.exclude_patterns}}) {
    if (!j.contains(key)) continue;
    WEIGHTD_ASSIGN_OR_RETURN(*list, Field<std::vector<std::string>>(j, key, where));
  }
  WEIGHTD_RETURN_IF_ERROR(CheckLoadPatterns(r));
  if (j.contains("numa_copies")) {
    WEIGHTD_ASSIGN_OR_RETURN(r.numa_copies, Field<bool>(j, "numa_copies", where));
  }
  WEIGHTD_ASSIGN_OR_RETURN(const json* rules, ArrayField(j, "tp_rules", where, 1024));
  for (const json& rule : *rules) {
    TpRule t;
    WEIGHTD_ASSIGN_OR_RETURN(t.pattern, Field<std::string>(rule, "pattern", "request.tp_rules[]"));
    WEIGHTD_ASSIGN_OR_RETURN(t.dim, Field<uint32_t>(rule, "dim", "request.tp_rules[]"));
    r.tp_rules.push_back(std::move(t));
  }
  if (r.tp_size == 0 || r.tp_size > 1024) return absl::InvalidArgumentError("request.tp_size must be 1..1024");
  return r;
}

absl::StatusOr<TensorRecord> DecodeTensor(const json& j, const std::string& where) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " is not an object"));
  TensorRecord t;
  WEIGHTD_ASSIGN_OR_RETURN(t.name, Field<std::string>(j, "name", where));
  WEIGHTD_ASSIGN_OR_RETURN(std::string dtype, Field<std::string>(j, "dtype", where));
  std::optional<DType> parsed = ParseDType(dtype);
  if (!parsed) return absl::InvalidArgumentError(absl::StrCat(where, ".dtype '", dtype, "' is unknown"));
  t.dtype = *parsed;
  WEIGHTD_ASSIGN_OR_RETURN(t.shape, Field<std::vector<uint64_t>>(j, "shape", where));
  WEIGHTD_ASSIGN_OR_RETURN(std::string placement, Field<std::string>(j, "placement", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.placement, ParsePlacement(placement, where));
  WEIGHTD_ASSIGN_OR_RETURN(t.segment, Field<uint32_t>(j, "segment", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.offset, Field<uint64_t>(j, "offset", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.nbytes, Field<uint64_t>(j, "nbytes", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.full_shape, Field<std::vector<uint64_t>>(j, "full_shape", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.split_dim, Field<int32_t>(j, "split_dim", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.split_start, Field<uint64_t>(j, "split_start", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.content_hash, Field<uint64_t>(j, "content_hash", where));
  // nbytes = product(shape) * bits / 8, without overflow.
  // Checked before each multiplication: the product stays below 2^80.
  constexpr unsigned __int128 kLimit = static_cast<unsigned __int128>(1) << 80;
  unsigned __int128 bits = static_cast<unsigned __int128>(DTypeBits(t.dtype));
  for (uint64_t d : t.shape) {
    if (d != 0 && bits > kLimit / d) return absl::InvalidArgumentError(absl::StrCat(where, ".shape is too large"));
    bits *= d;
  }
  if (bits % 8 != 0 || bits / 8 != static_cast<unsigned __int128>(t.nbytes)) {
    return absl::InvalidArgumentError(absl::StrCat(where, " (", t.name, "): nbytes ", t.nbytes,
                                                   " does not match its dtype and shape"));
  }
  if (t.full_shape.size() != t.shape.size() || t.split_dim < -1 ||
      (t.split_dim >= 0 && (static_cast<size_t>(t.split_dim) >= t.shape.size() ||
                            t.split_start > t.full_shape[t.split_dim] ||
                            t.shape[t.split_dim] > t.full_shape[t.split_dim] - t.split_start))) {
    return absl::InvalidArgumentError(absl::StrCat(where, " (", t.name, "): split_dim, split_start and full_shape disagree with its shape"));
  }
  return t;
}

absl::Status DecodeFiles(const json& j, ModelGeneration& m) {
  WEIGHTD_ASSIGN_OR_RETURN(const json* files, ArrayField(j, "files", "record", kMaxSegments));
  for (const json& f : *files) {
    const std::string where = "files[]";
    GenerationFile g;
    WEIGHTD_ASSIGN_OR_RETURN(g.stamp.name, Field<std::string>(f, "name", where));
    WEIGHTD_ASSIGN_OR_RETURN(g.stamp.identity.dev, Field<uint64_t>(f, "dev", where));
    WEIGHTD_ASSIGN_OR_RETURN(g.stamp.identity.ino, Field<uint64_t>(f, "ino", where));
    WEIGHTD_ASSIGN_OR_RETURN(g.stamp.identity.size, Field<uint64_t>(f, "size", where));
    WEIGHTD_ASSIGN_OR_RETURN(g.stamp.identity.mtime_ns, Field<int64_t>(f, "mtime_ns", where));
    WEIGHTD_ASSIGN_OR_RETURN(g.stamp.identity.ctime_ns, Field<int64_t>(f, "ctime_ns", where));
    WEIGHTD_ASSIGN_OR_RETURN(g.stamp.header_hash, Field<uint64_t>(f, "header_hash", where));
    WEIGHTD_ASSIGN_OR_RETURN(g.host_segments, Field<std::vector<uint32_t>>(f, "host_segments", where));
    WEIGHTD_ASSIGN_OR_RETURN(g.arenas, Field<std::vector<std::vector<uint32_t>>>(f, "arenas", where));
    for (uint32_t id : g.host_segments) {
      if (id >= m.segments.size()) return absl::InvalidArgumentError(absl::StrCat("files[] '", g.stamp.name, "': segment ", id, " out of range"));
    }
    for (const auto& rank : g.arenas) {
      for (uint32_t id : rank) {
        if (id >= m.segments.size()) return absl::InvalidArgumentError(absl::StrCat("files[] '", g.stamp.name, "': arena ", id, " out of range"));
      }
    }
    m.files.push_back(std::move(g));
  }
  return absl::OkStatus();
}

absl::Status DecodeSegmentRecords(const json& j, size_t host_count, size_t arena_count, ModelGeneration& m) {
  WEIGHTD_ASSIGN_OR_RETURN(const json* segments, ArrayField(j, "segments", "record", kMaxSegments));
  for (const json& s : *segments) {
    const std::string where = absl::StrCat("segments[", m.segments.size(), "]");
    SegmentRecord r;
    WEIGHTD_ASSIGN_OR_RETURN(std::string placement, Field<std::string>(s, "placement", where));
    WEIGHTD_ASSIGN_OR_RETURN(r.placement, ParsePlacement(placement, where));
    WEIGHTD_ASSIGN_OR_RETURN(r.size, Field<uint64_t>(s, "size", where));
    WEIGHTD_ASSIGN_OR_RETURN(std::string backend, Field<std::string>(s, "backend", where));
    WEIGHTD_ASSIGN_OR_RETURN(r.backend, ParseSegmentBackend(backend));
    WEIGHTD_ASSIGN_OR_RETURN(r.gpu_uuid, Field<std::string>(s, "gpu_uuid", where));
    WEIGHTD_ASSIGN_OR_RETURN(r.owner, Field<uint32_t>(s, "owner", where));
    size_t owners = r.placement == Placement::kHost ? host_count : arena_count;
    if (r.owner >= owners) return absl::InvalidArgumentError(absl::StrCat(where, ".owner ", r.owner, " out of range"));
    m.segments.push_back(std::move(r));
  }
  return absl::OkStatus();
}

// Records before NUMA copies have none. Each copy must list host segments
// of the sizes of the ranks' host prefix (what an attach substitutes).
absl::Status DecodeNumaCopies(const json& j, ModelGeneration& m) {
  if (!j.contains("numa_copies")) return absl::OkStatus();
  WEIGHTD_ASSIGN_OR_RETURN(const json* copies, ArrayField(j, "numa_copies", "record", kMaxNumaNodes));
  for (const json& c : *copies) {
    const std::string where = absl::StrCat("numa_copies[", m.numa_copies.size(), "]");
    NumaCopy copy;
    WEIGHTD_ASSIGN_OR_RETURN(copy.node, Field<int32_t>(c, "node", where));
    WEIGHTD_ASSIGN_OR_RETURN(copy.host_segments, Field<std::vector<uint32_t>>(c, "host_segments", where));
    if (copy.node < 0 || copy.node >= kMaxNumaNodes) return absl::InvalidArgumentError(absl::StrCat(where, ".node out of range"));
    if (c.contains("cpus")) {
      WEIGHTD_ASSIGN_OR_RETURN(const json* cpus, ArrayField(c, "cpus", where, kMaxCpus));
      for (const json& cpu : *cpus) {
        if (!cpu.is_number_integer() || cpu.get<int64_t>() < 0 || cpu.get<int64_t>() >= kMaxCpus) {
          return absl::InvalidArgumentError(absl::StrCat(where, ".cpus holds a value that is no CPU number below ", kMaxCpus));
        }
        copy.cpus.push_back(cpu.get<int>());
      }
      std::sort(copy.cpus.begin(), copy.cpus.end());
    }
    if (!m.request.numa_copies) return absl::InvalidArgumentError(absl::StrCat(where, ": the request has no numa_copies"));
    const std::vector<uint32_t>& prefix = m.ranks[0].segments;
    if (copy.host_segments.size() > prefix.size()) return absl::InvalidArgumentError(absl::StrCat(where, " lists too many segments"));
    // An attach of any rank substitutes the copy for that rank's host
    // prefix: every rank must share rank 0's.
    for (const RankManifest& rank : m.ranks) {
      if (rank.segments.size() < copy.host_segments.size() ||
          !std::equal(prefix.begin(), prefix.begin() + copy.host_segments.size(), rank.segments.begin())) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": the ranks do not share their host segments"));
      }
    }
    for (size_t i = 0; i < copy.host_segments.size(); ++i) {
      uint32_t id = copy.host_segments[i];
      if (id >= m.segments.size() || m.segments[id].placement != Placement::kHost ||
          m.segments[prefix[i]].placement != Placement::kHost || m.segments[id].size != m.segments[prefix[i]].size) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": segment ", id, " is not a host segment the size of ", prefix[i]));
      }
    }
    m.numa_copies.push_back(std::move(copy));
  }
  return absl::OkStatus();
}

absl::Status DecodeRanks(const json& j, ModelGeneration& m) {
  WEIGHTD_ASSIGN_OR_RETURN(const json* ranks, ArrayField(j, "ranks", "record", 1024));
  if (ranks->size() != m.request.tp_size) {
    return absl::InvalidArgumentError(absl::StrCat("record has ", ranks->size(), " ranks for tp_size ", m.request.tp_size));
  }
  for (const json& r : *ranks) {
    const std::string where = absl::StrCat("ranks[", m.ranks.size(), "]");
    RankManifest rank;
    WEIGHTD_ASSIGN_OR_RETURN(rank.segments, Field<std::vector<uint32_t>>(r, "segments", where));
    for (uint32_t id : rank.segments) {
      if (id >= m.segments.size()) return absl::InvalidArgumentError(absl::StrCat(where, ": segment ", id, " out of range"));
    }
    WEIGHTD_ASSIGN_OR_RETURN(const json* tensors, ArrayField(r, "tensors", where, kMaxTensors));
    for (const json& t : *tensors) {
      WEIGHTD_ASSIGN_OR_RETURN(TensorRecord tensor, DecodeTensor(t, absl::StrCat(where, ".tensors[", rank.tensors.size(), "]")));
      if (tensor.segment >= rank.segments.size()) {
        return absl::InvalidArgumentError(absl::StrCat(where, " tensor '", tensor.name, "': segment out of range"));
      }
      const SegmentRecord& segment = m.segments[rank.segments[tensor.segment]];
      if (segment.placement != tensor.placement) {
        return absl::InvalidArgumentError(absl::StrCat(where, " tensor '", tensor.name, "': placement differs from its segment's"));
      }
      uint64_t size = segment.size;
      if (tensor.offset > size || tensor.nbytes > size - tensor.offset) {
        return absl::InvalidArgumentError(absl::StrCat(where, " tensor '", tensor.name, "' lies outside its ", size, "-byte segment"));
      }
      rank.tensors.push_back(std::move(tensor));
    }
    m.ranks.push_back(std::move(rank));
  }
  return absl::OkStatus();
}

absl::Status DecodeModel(const json& j, StateRecord& out) {
  ModelGeneration& m = *out.model;
  if (!j.contains("request")) return absl::InvalidArgumentError("record.request is missing");
  WEIGHTD_ASSIGN_OR_RETURN(m.request, DecodeRequest(j["request"]));
  WEIGHTD_ASSIGN_OR_RETURN(m.generation, Field<uint64_t>(j, "generation", "record"));
  if (m.generation == 0) return absl::InvalidArgumentError("record.generation must be at least 1");
  WEIGHTD_ASSIGN_OR_RETURN(m.version_label, Field<std::string>(j, "version_label", "record"));
  if (absl::Status label = ValidateVersionLabel(m.version_label); !label.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("record.version_label: ", label.message()));
  }
  WEIGHTD_ASSIGN_OR_RETURN(m.fingerprint, Field<std::string>(j, "fingerprint", "record"));
  WEIGHTD_ASSIGN_OR_RETURN(m.warnings, Field<std::vector<std::string>>(j, "warnings", "record"));
  WEIGHTD_ASSIGN_OR_RETURN(m.load_seconds, Field<double>(j, "load_seconds", "record"));
  WEIGHTD_ASSIGN_OR_RETURN(m.checkpoint_bytes, Field<uint64_t>(j, "checkpoint_bytes", "record"));
  WEIGHTD_ASSIGN_OR_RETURN(m.host_bytes, Field<uint64_t>(j, "host_bytes", "record"));
  WEIGHTD_ASSIGN_OR_RETURN(m.bytes_read, Field<uint64_t>(j, "bytes_read", "record"));
  WEIGHTD_ASSIGN_OR_RETURN(m.bytes_reused, Field<uint64_t>(j, "bytes_reused", "record"));
  WEIGHTD_ASSIGN_OR_RETURN(m.tensor_count, Field<uint64_t>(j, "tensor_count", "record"));
  WEIGHTD_ASSIGN_OR_RETURN(const json* host, ArrayField(j, "host_segment_fds", "record", kMaxSegments));
  WEIGHTD_ASSIGN_OR_RETURN(const json* arenas, ArrayField(j, "arena_fds", "record", kMaxSegments));
  for (const json& s : *host) {
    WEIGHTD_ASSIGN_OR_RETURN(StoredSegment seg, DecodeSegment(s, "host_segment_fds[]"));
    if (seg.backend != SegmentBackend::kMemfd) return absl::InvalidArgumentError("host_segment_fds[]: not a memfd");
    out.host_segments.push_back(std::move(seg));
  }
  for (const json& s : *arenas) {
    WEIGHTD_ASSIGN_OR_RETURN(StoredSegment seg, DecodeSegment(s, "arena_fds[]"));
    out.arenas.push_back(std::move(seg));
  }
  WEIGHTD_RETURN_IF_ERROR(DecodeSegmentRecords(j, out.host_segments.size(), out.arenas.size(), m));
  for (const SegmentRecord& s : m.segments) {
    const StoredSegment& owner = s.placement == Placement::kHost ? out.host_segments[s.owner] : out.arenas[s.owner];
    if (owner.size != s.size) {
      return absl::InvalidArgumentError(absl::StrCat("segment of ", s.size, " bytes stored as ", owner.size, " bytes"));
    }
  }
  WEIGHTD_RETURN_IF_ERROR(DecodeFiles(j, m));
  WEIGHTD_RETURN_IF_ERROR(DecodeRanks(j, m));
  WEIGHTD_RETURN_IF_ERROR(DecodeNumaCopies(j, m));
  if (j.contains("from_files")) {
    WEIGHTD_ASSIGN_OR_RETURN(m.from_files, Field<bool>(j, "from_files", "record"));
  }
  std::string fingerprint = FingerprintOf(m.ranks[0].tensors);
  if (fingerprint != m.fingerprint) {
    return absl::InvalidArgumentError(absl::StrCat("record fingerprint ", m.fingerprint,
                                                   " differs from the one its tensors give, ", fingerprint));
  }
  return absl::OkStatus();
}

absl::StatusOr<LayoutTensor> DecodeLayoutTensor(const json& j, const std::string& where) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " is not an object"));
  LayoutTensor t;
  WEIGHTD_ASSIGN_OR_RETURN(t.record.name, Field<std::string>(j, "name", where));
  WEIGHTD_ASSIGN_OR_RETURN(std::string dtype, Field<std::string>(j, "dtype", where));
  std::optional<DType> parsed = ParseDType(dtype);
  if (!parsed) return absl::InvalidArgumentError(absl::StrCat(where, ".dtype '", dtype, "' is unknown"));
  t.record.dtype = *parsed;
  WEIGHTD_ASSIGN_OR_RETURN(t.record.shape, Field<std::vector<uint64_t>>(j, "shape", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.strides, Field<std::vector<uint64_t>>(j, "strides", where));
  WEIGHTD_ASSIGN_OR_RETURN(std::string placement, Field<std::string>(j, "placement", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.record.placement, ParsePlacement(placement, where));
  WEIGHTD_ASSIGN_OR_RETURN(t.record.segment, Field<uint32_t>(j, "segment", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.record.offset, Field<uint64_t>(j, "offset", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.record.nbytes, Field<uint64_t>(j, "nbytes", where));
  WEIGHTD_ASSIGN_OR_RETURN(t.record.content_hash, Field<uint64_t>(j, "content_hash", where));
  if (t.record.name.empty() || t.record.name.size() > kMaxLayoutTensorNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".name must be 1..", kMaxLayoutTensorNameBytes, " bytes"));
  }
  LayoutTensorSpec spec{t.record.name, t.record.dtype, t.record.shape, t.strides, t.record.placement};
  absl::StatusOr<uint64_t> bytes = LayoutTensorBytes(spec);
  if (!bytes.ok()) return Annotate(bytes.status(), where);
  if (*bytes != t.record.nbytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, " (", ElideName(t.record.name), "): nbytes ", t.record.nbytes,
                                                   " does not match its dtype, shape and strides"));
  }
  return t;
}

// One layout of a record (DecodeLayouts).
absl::StatusOr<StoredLayout> DecodeOneLayout(const json& lj, const StateRecord& out) {
  const ModelGeneration& m = *out.model;
  const std::string where = "record.layouts[]";
  if (!lj.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " is not an object"));
  StoredLayout stored;
  stored.layout = std::make_shared<Layout>();
  Layout& l = *stored.layout;
  l.model = m.request.name;
  l.generation = m.generation;
  WEIGHTD_ASSIGN_OR_RETURN(l.key, Field<std::string>(lj, "key", where));
  WEIGHTD_RETURN_IF_ERROR(ValidateLayoutKey(l.key));
  WEIGHTD_ASSIGN_OR_RETURN(l.rank, Field<uint32_t>(lj, "rank", where));
  if (l.rank >= m.ranks.size()) return absl::InvalidArgumentError(absl::StrCat(where, ".rank is out of range"));
  WEIGHTD_ASSIGN_OR_RETURN(l.identity, (Field<std::map<std::string, std::string>>(lj, "identity", where)));
  WEIGHTD_RETURN_IF_ERROR(ValidateLayoutIdentity(l.identity));
  WEIGHTD_ASSIGN_OR_RETURN(l.fingerprint, Field<std::string>(lj, "fingerprint", where));
  WEIGHTD_ASSIGN_OR_RETURN(l.publish_seconds, Field<double>(lj, "publish_seconds", where));
  WEIGHTD_ASSIGN_OR_RETURN(l.published_at, Field<double>(lj, "published_at", where));
  WEIGHTD_ASSIGN_OR_RETURN(const json* segments, ArrayField(lj, "segments", where, 2));
  for (const json& sj : *segments) {
    SegmentRecord seg;
    WEIGHTD_ASSIGN_OR_RETURN(std::string placement, Field<std::string>(sj, "placement", where + ".segments[]"));
    WEIGHTD_ASSIGN_OR_RETURN(seg.placement, ParsePlacement(placement, where + ".segments[]"));
    WEIGHTD_ASSIGN_OR_RETURN(size_t at, Field<size_t>(sj, "stored", where + ".segments[]"));
    WEIGHTD_ASSIGN_OR_RETURN(seg.size, Field<uint64_t>(sj, "size", where + ".segments[]"));
    WEIGHTD_ASSIGN_OR_RETURN(seg.gpu_uuid, Field<std::string>(sj, "gpu_uuid", where + ".segments[]"));
    WEIGHTD_ASSIGN_OR_RETURN(std::string backend, Field<std::string>(sj, "backend", where + ".segments[]"));
    WEIGHTD_ASSIGN_OR_RETURN(seg.backend, ParseSegmentBackend(backend));
    const bool is_host = seg.placement == Placement::kHost;
    const std::vector<StoredSegment>& pool = is_host ? out.layout_host_segments : out.layout_arenas;
    if (at >= pool.size() || pool[at].size != seg.size || (is_host && seg.backend != SegmentBackend::kMemfd) ||
        (!is_host && (pool[at].backend != seg.backend || pool[at].gpu_uuid != seg.gpu_uuid))) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".segments[]: stored index ", at,
                                                     " is out of range or disagrees with its fd"));
    }
    std::vector<size_t>& owners = is_host ? stored.host : stored.arenas;
    seg.owner = static_cast<uint32_t>(owners.size());
    owners.push_back(at);
    (is_host ? l.host_bytes : l.device_bytes) += seg.size;
    if (!is_host) l.gpu_uuid = seg.gpu_uuid;
    l.segments.push_back(std::move(seg));
  }
  WEIGHTD_ASSIGN_OR_RETURN(const json* tensors, ArrayField(lj, "tensors", where, kMaxLayoutTensors));
  std::set<std::string> names;
  for (const json& tj : *tensors) {
    WEIGHTD_ASSIGN_OR_RETURN(LayoutTensor t, DecodeLayoutTensor(tj, where + ".tensors[]"));
    const TensorRecord& r = t.record;
    if (r.segment >= l.segments.size() || l.segments[r.segment].placement != r.placement ||
        r.offset > l.segments[r.segment].size || r.nbytes > l.segments[r.segment].size - r.offset) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".tensors[] (", ElideName(r.name),
                                                     ") lies outside its segment"));
    }
    if (!names.insert(r.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".tensors[]: ", ElideName(r.name), " appears twice"));
    }
    l.tensors.push_back(std::move(t));
  }
  if (l.tensors.empty()) return absl::InvalidArgumentError(absl::StrCat(where, " has no tensors"));
  if (LayoutFingerprint(l.tensors) != l.fingerprint) {
    return absl::InvalidArgumentError(absl::StrCat(where, " (", ElideName(l.key),
                                                   "): its fingerprint differs from the one its tensors give"));
  }
  return stored;
}

// The record's layouts, each checked: key, identity, rank, segments in
// range of the stored fds with their sizes, tensors inside their segments,
// names unique, fingerprint.
absl::Status DecodeLayouts(const json& j, StateRecord& out) {
  if (!j.contains("layouts")) return absl::OkStatus();  // records before runtime layouts
  WEIGHTD_ASSIGN_OR_RETURN(const json* host, ArrayField(j, "layout_host_fds", "record", kMaxSegments));
  WEIGHTD_ASSIGN_OR_RETURN(const json* arenas, ArrayField(j, "layout_arena_fds", "record", kMaxSegments));
  for (const json& s : *host) {
    WEIGHTD_ASSIGN_OR_RETURN(StoredSegment seg, DecodeSegment(s, "layout_host_fds[]"));
    if (seg.backend != SegmentBackend::kMemfd) return absl::InvalidArgumentError("layout_host_fds[]: not a memfd");
    out.layout_host_segments.push_back(std::move(seg));
  }
  for (const json& s : *arenas) {
    WEIGHTD_ASSIGN_OR_RETURN(StoredSegment seg, DecodeSegment(s, "layout_arena_fds[]"));
    out.layout_arenas.push_back(std::move(seg));
  }
  WEIGHTD_ASSIGN_OR_RETURN(const json* layouts, ArrayField(j, "layouts", "record", kMaxSegments));
  for (const json& lj : *layouts) {
    absl::StatusOr<StoredLayout> stored = DecodeOneLayout(lj, out);
    if (stored.ok()) {
      out.layouts.push_back(std::move(*stored));
    } else {  // dropped alone: its generation is still restored
      std::string key = lj.is_object() && lj.contains("key") && lj["key"].is_string() ? lj["key"].get<std::string>() : "?";
      out.dropped_layouts.push_back(absl::StrCat("layout ", QuoteName(key), ": ", stored.status().message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> EncodeStateRecord(const ModelGeneration& model, const std::vector<StoredSegment>& host_segments,
                                              const std::vector<StoredSegment>& arenas, const RecordKey* key,
                                              const LayoutsToStore& layouts) {
  if (host_segments.size() != model.host_segments.size() || arenas.size() != model.arenas.size()) {
    return absl::InvalidArgumentError("stored segments do not match the generation's");
  }
  size_t layout_host = 0, layout_arenas = 0;
  for (const auto& l : layouts.layouts) layout_host += l->host_segments.size(), layout_arenas += l->arenas.size();
  if (layouts.host.size() != layout_host || layouts.arenas.size() != layout_arenas) {
    return absl::InvalidArgumentError("stored segments do not match the layouts'");
  }
  json body = ModelJson(model);
  json host = json::array(), devices = json::array();
  for (const StoredSegment& s : host_segments) host.push_back(SegmentJson(s));
  for (const StoredSegment& s : arenas) devices.push_back(SegmentJson(s));
  body["host_segment_fds"] = std::move(host);
  body["arena_fds"] = std::move(devices);
  json layout_list = json::array(), layout_host_fds = json::array(), layout_arena_fds = json::array();
  size_t host_base = 0, arena_base = 0;
  for (const auto& l : layouts.layouts) {
    layout_list.push_back(LayoutJson(*l, host_base, arena_base));
    host_base += l->host_segments.size();
    arena_base += l->arenas.size();
  }
  for (const StoredSegment& s : layouts.host) layout_host_fds.push_back(SegmentJson(s));
  for (const StoredSegment& s : layouts.arenas) layout_arena_fds.push_back(SegmentJson(s));
  body["layouts"] = std::move(layout_list);
  body["layout_host_fds"] = std::move(layout_host_fds);
  body["layout_arena_fds"] = std::move(layout_arena_fds);
  body["written_ns"] = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  std::string text;
  try {
    text = body.dump();
  } catch (const json::exception& e) {  // a name that is not UTF-8
    return absl::InvalidArgumentError(absl::StrCat("cannot encode the state record of '", model.request.name, "': ", e.what()));
  }
  if (text.size() > kMaxStateRecordBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the state record of '", model.request.name, "' would be ", text.size(),
                                                   " bytes, over the ", kMaxStateRecordBytes, "-byte bound"));
  }
  std::string out(kMagic, sizeof(kMagic));
  PutU64(out, text.size());
  PutU64(out, XXH3_64bits(text.data(), text.size()));
  out += text;
  if (key != nullptr) out += key->Mac(out);
  return out;
}

absl::StatusOr<StateRecord> DecodeStateRecord(absl::string_view bytes, const RecordKey* key) {
  if (bytes.size() < kStateRecordHeaderBytes || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError("not a weightd state record (magic WDSTATE1 missing)");
  }
  uint64_t length = GetU64(bytes, 8);
  const uint64_t after_header = bytes.size() - kStateRecordHeaderBytes;
  if (length > kMaxStateRecordBytes || (length != after_header && length + kRecordMacBytes != after_header)) {
    return absl::DataLossError(absl::StrCat("state record body is ", after_header, " bytes, its header says ", length,
                                            " (", kRecordMacBytes, " more with an HMAC)"));
  }
  absl::string_view body = bytes.substr(kStateRecordHeaderBytes, length);
  absl::string_view mac = bytes.substr(kStateRecordHeaderBytes + length);
  if (XXH3_64bits(body.data(), body.size()) != GetU64(bytes, 16)) {
    return absl::DataLossError("state record checksum (XXH3-64 of the body) does not match");
  }
  json j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("state record body is not a JSON object");
  StateRecord out;
  out.model = std::make_unique<ModelGeneration>();
  out.authenticated = key != nullptr && !mac.empty() && key->Verify(bytes.substr(0, kStateRecordHeaderBytes + length), mac);
  WEIGHTD_RETURN_IF_ERROR(DecodeModel(j, out));
  WEIGHTD_RETURN_IF_ERROR(DecodeLayouts(j, out));
  if (j.contains("written_ns")) {
    WEIGHTD_ASSIGN_OR_RETURN(out.written_ns, Field<uint64_t>(j, "written_ns", "record"));
  }
  return out;
}

}  // namespace weightd
