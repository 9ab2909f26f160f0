#include "common/format/packed_manifest.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

constexpr char kMagic[4] = {'W', 'D', 'P', 'M'};
constexpr uint64_t kU32Max = std::numeric_limits<uint32_t>::max();

// Little-endian loads and stores, byte by byte: the compiler turns them into
// one move on little-endian hosts and they stay right on big-endian ones.
template <typename T>
T Load(const char* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

template <typename T>
void Store(char* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<char>(static_cast<uint64_t>(v) >> (8 * i));
}

template <typename T>
void Append(std::string* out, T v) {
  char bytes[sizeof(T)];
  Store(bytes, v);
  out->append(bytes, sizeof(T));
}

absl::Status Corrupt(absl::string_view what) { return absl::DataLossError(absl::StrCat("packed manifest: ", what)); }

absl::Status CorruptTensor(uint32_t i, absl::string_view what) {
  return Corrupt(absl::StrCat("tensor record ", i, ": ", what));
}

struct Header {
  uint16_t version, record_bytes;
  uint32_t tensor_count, dtype_count, dtype_bytes, dim_count, name_bytes, reserved;
};

Header ReadHeader(const char* p) {
  return {Load<uint16_t>(p + 4),  Load<uint16_t>(p + 6),  Load<uint32_t>(p + 8),  Load<uint32_t>(p + 12),
          Load<uint32_t>(p + 16), Load<uint32_t>(p + 20), Load<uint32_t>(p + 24), Load<uint32_t>(p + 28)};
}

// The dtype table: dtype_count entries of (u8 length >= 1, bytes), exactly dtype_bytes.
absl::StatusOr<std::vector<absl::string_view>> ParseDtypes(const char* p, const Header& h) {
  // Each entry takes at least 2 bytes: a count the table cannot hold is
  // refused before anything is reserved for it.
  if (h.dtype_count > h.dtype_bytes / 2) {
    return Corrupt(absl::StrCat(h.dtype_count, " dtypes cannot fit a dtype table of ", h.dtype_bytes, " bytes"));
  }
  std::vector<absl::string_view> out;
  out.reserve(h.dtype_count);
  uint64_t at = 0;
  for (uint32_t i = 0; i < h.dtype_count; ++i) {
    if (at >= h.dtype_bytes) return Corrupt(absl::StrCat("dtype table ends inside entry ", i));
    uint8_t length = static_cast<uint8_t>(p[at]);
    if (length == 0) return Corrupt(absl::StrCat("dtype table entry ", i, " is empty"));
    if (at + 1 + length > h.dtype_bytes) return Corrupt(absl::StrCat("dtype table entry ", i, " runs past the table"));
    out.emplace_back(p + at + 1, length);
    at += 1 + length;
  }
  if (at != h.dtype_bytes) {
    return Corrupt(absl::StrCat("dtype table holds ", h.dtype_bytes - at, " bytes after its ", h.dtype_count, " entries"));
  }
  return out;
}

}  // namespace

void PackedManifestWriter::Add(const PackedTensorInput& t) {
  auto [it, added] = dtype_index_.try_emplace(std::string(t.dtype), static_cast<uint32_t>(dtype_index_.size()));
  if (added) {
    dtypes_.push_back(static_cast<char>(t.dtype.size()));
    dtypes_.append(t.dtype.data(), t.dtype.size());
  }
  char r[kPackedManifestRecordBytes] = {};
  Store<uint64_t>(r + 0, t.offset);
  Store<uint64_t>(r + 8, t.nbytes);
  Store<uint64_t>(r + 16, t.split_start);
  Store<uint64_t>(r + 24, t.content_hash);
  Store<uint32_t>(r + 32, static_cast<uint32_t>(names_.size()));
  Store<uint32_t>(r + 36, static_cast<uint32_t>(t.name.size()));
  Store<uint32_t>(r + 40, t.segment);
  Store<uint32_t>(r + 44, static_cast<uint32_t>(dim_count_));
  Store<uint32_t>(r + 48, static_cast<uint32_t>(t.shape.size()));
  Store<uint32_t>(r + 52, static_cast<uint32_t>(t.full_shape.size()));
  Store<int32_t>(r + 56, t.split_dim);
  Store<uint16_t>(r + 60, static_cast<uint16_t>(it->second));
  r[62] = static_cast<char>(t.placement);
  records_.append(r, sizeof(r));
  // Checked in Finish: a name past 4 GiB, or more dims than a u32 counts.
  overflow_ |= names_.size() > kU32Max || t.name.size() > kU32Max || dim_count_ > kU32Max ||
               t.shape.size() > kU32Max || t.full_shape.size() > kU32Max || t.dtype.empty() || t.dtype.size() > 255;
  for (uint64_t d : t.shape) Append<uint64_t>(&dims_, d);
  for (uint64_t d : t.full_shape) Append<uint64_t>(&dims_, d);
  dim_count_ += t.shape.size() + t.full_shape.size();
  names_.append(t.name.data(), t.name.size());
  ++count_;
}

absl::StatusOr<std::string> PackedManifestWriter::Finish() {
  if (overflow_ || count_ > kU32Max || dim_count_ > kU32Max || names_.size() > kU32Max ||
      dtype_index_.size() > std::numeric_limits<uint16_t>::max() + 1ull) {
    return absl::InvalidArgumentError(
        "the manifest does not fit the packed tensor table (32-bit counts and name offsets, dtype names of 1-255 bytes)");
  }
  std::string out;
  out.reserve(kPackedManifestHeaderBytes + records_.size() + dims_.size() + dtypes_.size() + names_.size());
  out.append(kMagic, sizeof(kMagic));
  Append<uint16_t>(&out, kPackedManifestVersion);
  Append<uint16_t>(&out, kPackedManifestRecordBytes);
  Append<uint32_t>(&out, static_cast<uint32_t>(count_));
  Append<uint32_t>(&out, static_cast<uint32_t>(dtype_index_.size()));
  Append<uint32_t>(&out, static_cast<uint32_t>(dtypes_.size()));
  Append<uint32_t>(&out, static_cast<uint32_t>(dim_count_));
  Append<uint32_t>(&out, static_cast<uint32_t>(names_.size()));
  Append<uint32_t>(&out, 0);
  out += records_;
  out += dims_;
  out += dtypes_;
  out += names_;
  return out;
}

uint64_t PackedTensor::Dim(uint32_t k) const { return Load<uint64_t>(dims + 8ull * k); }
uint64_t PackedTensor::FullDim(uint32_t k) const { return Load<uint64_t>(dims + 8ull * (ndim + k)); }

absl::StatusOr<PackedManifest> PackedManifest::Parse(absl::string_view bytes) {
  if (bytes.size() < kPackedManifestHeaderBytes) {
    return Corrupt(absl::StrCat(bytes.size(), " bytes, shorter than its ", kPackedManifestHeaderBytes, "-byte header"));
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) return Corrupt("bad magic (expected \"WDPM\")");
  Header h = ReadHeader(bytes.data());
  if (h.version != kPackedManifestVersion) {
    return Corrupt(absl::StrCat("version ", h.version, "; this client reads version ", kPackedManifestVersion));
  }
  if (h.record_bytes < kPackedManifestRecordBytes) {
    return Corrupt(absl::StrCat("record_bytes ", h.record_bytes, " is under ", kPackedManifestRecordBytes));
  }
  if (h.reserved != 0) return Corrupt("header reserved field is not 0");
  // Each term is below 2^48, so the sum cannot overflow 64 bits.
  uint64_t expected = kPackedManifestHeaderBytes + uint64_t{h.tensor_count} * h.record_bytes +
                      uint64_t{h.dim_count} * 8 + h.dtype_bytes + h.name_bytes;
  if (bytes.size() != expected) {
    return Corrupt(absl::StrCat(bytes.size(), " bytes where its header describes ", expected));
  }
  PackedManifest m;
  m.records_ = bytes.data() + kPackedManifestHeaderBytes;
  m.count_ = h.tensor_count;
  m.record_bytes_ = h.record_bytes;
  m.dims_ = m.records_ + uint64_t{h.tensor_count} * h.record_bytes;
  const char* dtypes = m.dims_ + uint64_t{h.dim_count} * 8;
  m.names_ = dtypes + h.dtype_bytes;
  absl::StatusOr<std::vector<absl::string_view>> parsed = ParseDtypes(dtypes, h);
  if (!parsed.ok()) return parsed.status();
  m.dtypes_ = std::move(*parsed);
  for (uint32_t i = 0; i < h.tensor_count; ++i) {
    const char* r = m.records_ + uint64_t{i} * h.record_bytes;
    uint64_t name_offset = Load<uint32_t>(r + 32), name_length = Load<uint32_t>(r + 36);
    uint64_t dims_start = Load<uint32_t>(r + 44), ndim = Load<uint32_t>(r + 48), full_ndim = Load<uint32_t>(r + 52);
    uint8_t placement = static_cast<uint8_t>(r[62]);
    if (name_offset + name_length > h.name_bytes) return CorruptTensor(i, "name runs past the names section");
    if (dims_start + ndim + full_ndim > h.dim_count) return CorruptTensor(i, "dims run past the dims section");
    if (Load<uint16_t>(r + 60) >= h.dtype_count) return CorruptTensor(i, "dtype index past the dtype table");
    if (placement != kPackedPlacementHost && placement != kPackedPlacementDevice) {
      return CorruptTensor(i, absl::StrCat("placement ", int{placement}, " is neither 1 (host) nor 2 (device)"));
    }
    if (r[63] != 0) return CorruptTensor(i, "reserved byte is not 0");
  }
  return m;
}

PackedTensor PackedManifest::Tensor(uint32_t i) const {
  const char* r = records_ + uint64_t{i} * record_bytes_;
  PackedTensor t;
  t.offset = Load<uint64_t>(r + 0);
  t.nbytes = Load<uint64_t>(r + 8);
  t.split_start = Load<uint64_t>(r + 16);
  t.content_hash = Load<uint64_t>(r + 24);
  t.name = absl::string_view(names_ + Load<uint32_t>(r + 32), Load<uint32_t>(r + 36));
  t.segment = Load<uint32_t>(r + 40);
  t.dims = dims_ + 8ull * Load<uint32_t>(r + 44);
  t.ndim = Load<uint32_t>(r + 48);
  t.full_ndim = Load<uint32_t>(r + 52);
  t.split_dim = static_cast<int32_t>(Load<uint32_t>(r + 56));
  t.dtype = dtypes_[Load<uint16_t>(r + 60)];
  t.placement = static_cast<uint8_t>(r[62]);
  return t;
}

}  // namespace weightd
