#include "common/format/safetensors.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "common/format/format_error.h"
#include "common/format/shape.h"
#include "nlohmann/json.hpp"

namespace weightd {
namespace {

using json = nlohmann::json;

// Streams the header JSON (SAX) straight into TensorHeaders: no DOM, one pass,
// and duplicate names are seen (a DOM would silently keep the last one).
class HeaderHandler {
 public:
  explicit HeaderHandler(SafetensorsHeader* out) : out_(out) {}

  // The first rule broken; OK when the handler saw nothing wrong.
  absl::Status error() const { return error_.empty() ? absl::OkStatus() : CheckpointError(error_rule_, error_); }

  bool null() { return Scalar("null"); }
  bool boolean(bool) { return Scalar("a boolean"); }
  bool binary(json::binary_t&) { return Scalar("binary"); }
  bool number_float(double, const std::string& text) {
    if (where_ == Where::kShape || where_ == Where::kOffsets) {
      return Fail(kInvalid, absl::StrCat(TensorRef(), FieldName(), " holds ", text, ", not an integer in [0, 2^64)"));
    }
    return Scalar("a number");
  }
  bool number_integer(int64_t value) {
    if (where_ == Where::kShape) return Fail(kNegativeValue, absl::StrCat(TensorRef(), "dimension ", value, " is negative"));
    if (where_ == Where::kOffsets) {
      return Fail(kNegativeValue, absl::StrCat(TensorRef(), "data offset ", value, " is negative"));
    }
    return Scalar("a number");
  }
  bool number_unsigned(uint64_t value) {
    if (skip_ > 0) return true;
    if (where_ == Where::kShape) {
      draft_.shape.push_back(value);
      return true;
    }
    if (where_ == Where::kOffsets) {
      if (++offset_count_ > 2) return Fail(kInvalid, absl::StrCat(TensorRef(), "data_offsets must hold exactly 2 integers"));
      (offset_count_ == 1 ? draft_.begin : draft_.end) = value;
      return true;
    }
    return Scalar("a number");
  }
  bool string(std::string& value) {
    if (skip_ > 0) return true;
    if (where_ == Where::kMetadata) {
      out_->metadata.emplace(std::move(pending_key_), std::move(value));
      return true;
    }
    if (where_ == Where::kTensor && field_ == Field::kDtype) {
      std::optional<DType> dtype = ParseDType(value);
      if (!dtype) return Fail(kUnknownDtype, absl::StrCat(TensorRef(), "unknown dtype ", QuoteName(value)));
      draft_.dtype = *dtype;
      return true;
    }
    return Scalar("a string");
  }
  bool start_object(std::size_t) {
    if (skip_ > 0) return ++skip_, true;
    switch (where_) {
      case Where::kStart:
        where_ = Where::kTop;
        return true;
      case Where::kTop:
        return BeginEntry();
      case Where::kTensor:
        if (field_ == Field::kUnknown) return ++skip_, true;
        return Fail(kInvalid, absl::StrCat(TensorRef(), FieldName(), " must not be an object"));
      case Where::kMetadata:
        return Fail(kBadMetadata,
                    absl::StrCat("__metadata__ value of ", QuoteName(pending_key_), " must be a string, not an object"));
      default:
        return Fail(kInvalid, absl::StrCat(TensorRef(), FieldName(), " must hold integers, not objects"));
    }
  }
  bool end_object() {
    if (skip_ > 0) return --skip_, true;
    if (where_ == Where::kTensor) return EndTensor();
    if (where_ == Where::kMetadata) return where_ = Where::kTop, true;
    where_ = Where::kDone;
    return true;
  }
  bool start_array(std::size_t) {
    if (skip_ > 0) return ++skip_, true;
    if (where_ == Where::kStart) return Fail(kInvalid, "header is a JSON array, not an object");
    if (where_ == Where::kTop) return Fail(EntryRule(), absl::StrCat("entry ", QuoteName(pending_key_), " must be an object"));
    if (where_ == Where::kMetadata) {
      return Fail(kBadMetadata,
                  absl::StrCat("__metadata__ value of ", QuoteName(pending_key_), " must be a string, not an array"));
    }
    if (where_ != Where::kTensor) return Fail(kInvalid, absl::StrCat(TensorRef(), FieldName(), " must not nest arrays"));
    if (field_ == Field::kShape) return where_ = Where::kShape, true;
    if (field_ == Field::kOffsets) return where_ = Where::kOffsets, true;
    if (field_ == Field::kUnknown) return ++skip_, true;
    return Fail(kInvalid, absl::StrCat(TensorRef(), "dtype must be a string"));
  }
  bool end_array() {
    if (skip_ > 0) return --skip_, true;
    if (where_ == Where::kOffsets && offset_count_ != 2) {
      return Fail(kInvalid, absl::StrCat(TensorRef(), "data_offsets must hold exactly 2 integers"));
    }
    where_ = Where::kTensor;
    return true;
  }
  bool key(std::string& name) {
    if (skip_ > 0) return true;
    if (where_ == Where::kTop) {
      pending_key_ = std::move(name);
      return true;
    }
    if (where_ == Where::kMetadata) {
      if (out_->metadata.count(name) != 0) {
        return Fail(kDuplicateKey, absl::StrCat("__metadata__ key ", QuoteName(name), " appears twice"));
      }
      pending_key_ = std::move(name);
      return true;
    }
    return TensorField(name);
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& ex) {
    // ex.what() reads "[json.exception.parse_error.101] parse error at line 1, column 2: ...".
    absl::string_view what = ex.what();
    size_t colon = what.find(": ");
    absl::string_view detail = colon == absl::string_view::npos ? what : what.substr(colon + 2);
    // nlohmann's lexer is what checks UTF-8, and says so only in its text
    // (before "; last read: ...", which quotes the header itself).
    absl::string_view lexer_says = detail.substr(0, detail.find("; last read"));
    CheckpointRule rule = absl::StrContains(lexer_says, "ill-formed UTF-8") ? kHeaderNotUtf8 : kHeaderNotJson;
    return Fail(rule, absl::StrCat("header is not valid JSON at header byte ", position, ": ", detail));
  }

 private:
  enum class Where { kStart, kTop, kTensor, kShape, kOffsets, kMetadata, kDone };
  enum class Field { kNone, kDtype, kShape, kOffsets, kUnknown };

  using enum CheckpointRule;

  bool Fail(CheckpointRule rule, std::string message) {
    if (error_.empty()) error_ = std::move(message), error_rule_ = rule;
    return false;
  }
  // A top-level entry that is not an object: __metadata__ or a tensor.
  CheckpointRule EntryRule() const { return pending_key_ == "__metadata__" ? kBadMetadata : kInvalid; }
  bool Scalar(absl::string_view what) {
    if (skip_ > 0) return true;
    switch (where_) {
      case Where::kStart:
        return Fail(kHeaderNotJson, absl::StrCat("header is ", what, ", not a JSON object"));
      case Where::kTop:
        return Fail(EntryRule(), absl::StrCat("entry ", QuoteName(pending_key_), " must be an object, not ", what));
      case Where::kMetadata:
        return Fail(kBadMetadata,
                    absl::StrCat("__metadata__ value of ", QuoteName(pending_key_), " must be a string, not ", what));
      case Where::kTensor:
        if (field_ == Field::kUnknown) return true;
        return Fail(kInvalid, absl::StrCat(TensorRef(), FieldName(), " must not be ", what));
      default:
        return Fail(kInvalid, absl::StrCat(TensorRef(), FieldName(), " must hold non-negative integers, not ", what));
    }
  }
  bool BeginEntry() {
    if (pending_key_ == "__metadata__") {
      if (seen_metadata_) return Fail(kDuplicateKey, "__metadata__ appears twice");
      seen_metadata_ = true;
      where_ = Where::kMetadata;
      return true;
    }
    for (size_t i = 0; i < pending_key_.size(); ++i) {
      unsigned char c = static_cast<unsigned char>(pending_key_[i]);
      if (c < 0x20 || c == 0x7F) {
        // Stricter than the reference: such names break one-line errors,
        // logs and tables, and the fingerprint's line format.
        return Fail(kInvalid, absl::StrFormat("tensor name holds control character 0x%02X at byte %d", c, i));
      }
    }
    if (!names_.insert(pending_key_).second) {
      return Fail(kDuplicateKey, absl::StrCat("tensor name ", QuoteName(pending_key_), " appears twice"));
    }
    draft_ = TensorHeader{};
    draft_.name = std::move(pending_key_);
    seen_fields_ = 0;
    offset_count_ = 0;
    where_ = Where::kTensor;
    return true;
  }
  bool TensorField(const std::string& name) {
    int bit = 0;
    if (name == "dtype") {
      field_ = Field::kDtype, bit = 1;
    } else if (name == "shape") {
      field_ = Field::kShape, bit = 2;
    } else if (name == "data_offsets") {
      field_ = Field::kOffsets, bit = 4;
    } else {
      field_ = Field::kUnknown;  // ignored, as serde does for unknown fields
      return true;
    }
    if (seen_fields_ & bit) return Fail(kDuplicateKey, absl::StrCat(TensorRef(), "field '", name, "' appears twice"));
    seen_fields_ |= bit;
    return true;
  }
  bool EndTensor() {
    static constexpr absl::string_view kFieldNames[] = {"dtype", "shape", "data_offsets"};
    for (int i = 0; i < 3; ++i) {
      if (!(seen_fields_ & (1 << i))) {
        return Fail(kInvalid, absl::StrCat(TensorRef(), "missing field '", kFieldNames[i], "'"));
      }
    }
    out_->tensors.push_back(std::move(draft_));
    where_ = Where::kTop;
    field_ = Field::kNone;
    return true;
  }
  std::string TensorRef() const { return absl::StrCat("tensor ", QuoteName(draft_.name), ": "); }
  absl::string_view FieldName() const {
    switch (field_) {
      case Field::kDtype: return "dtype";
      case Field::kShape: return "shape";
      case Field::kOffsets: return "data_offsets";
      default: return "field";
    }
  }

  SafetensorsHeader* out_;
  Where where_ = Where::kStart;
  Field field_ = Field::kNone;
  int skip_ = 0;  // depth inside an ignored field's container value
  int seen_fields_ = 0;
  int offset_count_ = 0;
  bool seen_metadata_ = false;
  std::string pending_key_;
  TensorHeader draft_;
  absl::flat_hash_set<std::string> names_;
  std::string error_;
  CheckpointRule error_rule_ = kInvalid;
};

absl::Status CheckTensorSize(const TensorHeader& t) {
  using enum CheckpointRule;
  std::string tensor = absl::StrCat("tensor ", QuoteName(t.name), ": ");
  std::optional<uint64_t> elements = ElementCount(t.shape);
  if (!elements) {
    return CheckpointError(kShapeOverflow,
                           absl::StrCat(tensor, "element count of shape ", ShapeString(t.shape), " overflows 64 bits"));
  }
  uint64_t bits;
  if (__builtin_mul_overflow(*elements, static_cast<uint64_t>(DTypeBits(t.dtype)), &bits)) {
    return CheckpointError(kShapeOverflow, absl::StrCat(tensor, "byte size of ", *elements, " x ", DTypeName(t.dtype),
                                                        " overflows 64 bits"));
  }
  if (bits % 8 != 0) {
    return CheckpointError(kSubByteSize, absl::StrCat(tensor, *elements, " x ", DTypeName(t.dtype), " is ", bits,
                                                      " bits, not a whole number of bytes"));
  }
  if (t.end < t.begin) {
    return CheckpointError(kBadDataOffsets,
                           absl::StrCat(tensor, "data_offsets [", t.begin, ", ", t.end, "] end before they begin"));
  }
  if (t.end - t.begin != bits / 8) {
    return CheckpointError(kSizeMismatch, absl::StrCat(tensor, "shape ", ShapeString(t.shape), " x ",
                                                       DTypeName(t.dtype), " needs ", bits / 8,
                                                       " bytes but data_offsets [", t.begin, ", ", t.end, "] give ",
                                                       t.end - t.begin));
  }
  return absl::OkStatus();
}

absl::Status CheckLayout(const SafetensorsHeader& h) {
  using enum CheckpointRule;
  uint64_t expected = 0;
  const TensorHeader* previous = nullptr;
  for (const TensorHeader& t : h.tensors) {
    if (t.begin > expected && previous == nullptr) {
      return CheckpointError(kOffsetsNotFromZero,
                             absl::StrCat("tensor ", QuoteName(t.name), ": data starts at offset ", t.begin, ", not 0"));
    }
    if (t.begin > expected) {
      return CheckpointError(kHoleBetweenTensors,
                             absl::StrCat("bytes [", expected, ", ", t.begin, ") between tensors ",
                                          QuoteName(previous->name), " and ", QuoteName(t.name), " belong to no tensor"));
    }
    if (t.begin < expected) {
      return CheckpointError(kOverlappingTensors, absl::StrCat("tensors ", QuoteName(previous->name), " and ",
                                                               QuoteName(t.name), " overlap at data bytes [", t.begin,
                                                               ", ", expected, ")"));
    }
    expected = t.end;
    previous = &t;
  }
  if (expected > h.data_length) {
    return CheckpointError(kTruncated, absl::StrCat("truncated: tensor ", QuoteName(previous->name),
                                                    " ends at data byte ", expected, " but the data section holds ",
                                                    h.data_length, " bytes"));
  }
  if (expected < h.data_length) {
    return CheckpointError(kTrailingBytes,
                           absl::StrCat(h.data_length - expected, " trailing bytes after the last tensor (data section is ",
                                        h.data_length, " bytes, tensors end at ", expected, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsHeader> ParseUnlabelled(absl::string_view text, uint64_t header_length, uint64_t file_size) {
  if (text.size() >= 3 && std::memcmp(text.data(), "\xEF\xBB\xBF", 3) == 0) {
    return CheckpointError(CheckpointRule::kHeaderNotJson, "header starts with a UTF-8 byte-order mark, which is not JSON");
  }
  // nlohmann's lexer takes NUL for end of input, so NUL padding would pass;
  // NUL can never appear in JSON text (inside strings it must be escaped).
  if (const void* nul = std::memchr(text.data(), '\0', text.size())) {
    return CheckpointError(CheckpointRule::kHeaderNotJson,
                           absl::StrCat("header holds a NUL byte at header byte ",
                                        static_cast<const char*>(nul) - text.data(), "; only JSON whitespace may pad it"));
  }
  SafetensorsHeader header;
  header.header_length = header_length;
  header.data_start = 8 + header_length;
  header.data_length = file_size - header.data_start;
  HeaderHandler handler(&header);
  bool ok = json::sax_parse(text.begin(), text.end(), &handler, json::input_format_t::json, /*strict=*/true);
  if (!ok) {
    absl::Status error = handler.error();
    return error.ok() ? CheckpointError(CheckpointRule::kHeaderNotJson, "header is not valid JSON") : error;
  }
  for (const TensorHeader& t : header.tensors) WEIGHTD_RETURN_IF_ERROR(CheckTensorSize(t));
  std::stable_sort(header.tensors.begin(), header.tensors.end(), [](const TensorHeader& a, const TensorHeader& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  WEIGHTD_RETURN_IF_ERROR(CheckLayout(header));
  return header;
}

uint64_t LittleEndian64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Recognises files that are commonly mistaken for safetensors, so the error
// says what the file is instead of "header too large".
std::optional<absl::Status> SniffForeignFormat(absl::string_view prefix) {
  using enum CheckpointRule;
  if (prefix.substr(0, 24) == "version https://git-lfs.") {
    return CheckpointError(kGitLfsPointer, "git-LFS pointer, not a safetensors file (run `git lfs pull`)");
  }
  if (prefix.substr(0, 4) == absl::string_view("PK\x03\x04", 4)) {
    return CheckpointError(kForeignFormat, "zip archive (a PyTorch .bin/.pt checkpoint?), not a safetensors file");
  }
  if (prefix.size() >= 2 && static_cast<unsigned char>(prefix[0]) == 0x80 && prefix[1] >= 2 && prefix[1] <= 5) {
    return CheckpointError(kForeignFormat, "Python pickle, not a safetensors file");
  }
  return std::nullopt;
}

// The header length N from the 8-byte prefix, checked against the format's
// limit and the file size.
absl::StatusOr<uint64_t> HeaderLength(absl::string_view prefix, uint64_t file_size) {
  if (file_size < 8) {
    return CheckpointError(CheckpointRule::kFileTooShort,
                           absl::StrCat("file is ", file_size, " bytes, shorter than the 8-byte header length prefix"));
  }
  uint64_t n = LittleEndian64(reinterpret_cast<const unsigned char*>(prefix.data()));
  if (n > kMaxHeaderBytes) {
    return CheckpointError(CheckpointRule::kHeaderTooLarge, absl::StrCat("header length ", n, " exceeds the ",
                                                                         kMaxHeaderBytes,
                                                                         "-byte limit of the safetensors format"));
  }
  if (n > file_size - 8) {
    return CheckpointError(CheckpointRule::kHeaderPastEof,
                           absl::StrCat("header length ", n, " exceeds file size ", file_size));
  }
  return n;
}

absl::StatusOr<SafetensorsHeader> ParsePrefixed(absl::string_view prefix, uint64_t file_size,
                                                const std::function<absl::StatusOr<std::string>(uint64_t)>& read_header) {
  absl::StatusOr<uint64_t> n = HeaderLength(prefix, file_size);
  if (!n.ok()) {
    // Sniffed only when the prefix is no usable length: a valid file whose
    // header is 640 bytes begins 80 02 00 .., exactly like a pickle.
    if (std::optional<absl::Status> foreign = SniffForeignFormat(prefix)) return *foreign;
    return n.status();
  }
  WEIGHTD_ASSIGN_OR_RETURN(std::string text, read_header(*n));
  return ParseUnlabelled(text, *n, file_size);
}

}  // namespace

std::optional<uint64_t> ElementCount(const std::vector<uint64_t>& shape) {
  uint64_t count = 1;
  for (uint64_t dim : shape) {
    if (__builtin_mul_overflow(count, dim, &count)) return std::nullopt;
  }
  return count;
}

absl::StatusOr<SafetensorsHeader> ParseHeaderJson(absl::string_view json_text, uint64_t header_length,
                                                  uint64_t file_size, absl::string_view file_label) {
  absl::StatusOr<SafetensorsHeader> header = ParseUnlabelled(json_text, header_length, file_size);
  if (!header.ok()) return Annotate(header.status(), ElideName(file_label));
  return header;
}

absl::StatusOr<SafetensorsHeader> ParseFileImage(absl::string_view image, absl::string_view file_label) {
  auto header = ParsePrefixed(image.substr(0, 64), image.size(), [&](uint64_t n) -> absl::StatusOr<std::string> {
    return std::string(image.substr(8, n));
  });
  if (!header.ok()) return Annotate(header.status(), ElideName(file_label));
  return header;
}

absl::StatusOr<SafetensorsHeader> ReadHeader(const RandomAccessFile& file, absl::string_view file_label) {
  std::string prefix(std::min<uint64_t>(file.size(), 64), '\0');
  absl::Status read = file.ReadAt(0, prefix.size(), prefix.data());
  if (!read.ok()) return Annotate(read, ElideName(file_label));
  uint64_t hash = 0;
  auto header = ParsePrefixed(prefix, file.size(), [&](uint64_t n) -> absl::StatusOr<std::string> {
    std::string text(n, '\0');
    WEIGHTD_RETURN_IF_ERROR(file.ReadAt(8, n, text.data()));
    hash = XXH3_64bits(text.data(), text.size());
    return text;
  });
  if (!header.ok()) return Annotate(header.status(), ElideName(file_label));
  header->header_hash = hash;
  return header;
}

}  // namespace weightd
