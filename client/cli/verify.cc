#include "client/cli/verify.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/format/catalog.h"
#include "common/format/content_hash.h"
#include "common/base/status.h"

namespace weightd::cli {
namespace {

// Compares `n` bytes of `file` at `offset` with the mapped tensor's bytes
// [tensor_byte, tensor_byte + n), in bounded chunks. Device bytes are copied
// back to the host to compare.
absl::Status CompareRange(const RandomAccessFile& file, uint64_t offset, const MappedModel& model,
                          const TensorView& view, uint64_t tensor_byte, uint64_t n) {
  constexpr uint64_t kChunk = 16ull << 20;
  std::string expected, mapped;
  for (uint64_t done = 0; done < n; done += kChunk) {
    uint64_t len = std::min(kChunk, n - done);
    expected.resize(len);
    mapped.resize(len);
    WEIGHTD_RETURN_IF_ERROR(file.ReadAt(offset + done, len, expected.data()));
    WEIGHTD_RETURN_IF_ERROR(model.CopyToHost(view, tensor_byte + done, mapped.data(), len));
    if (expected != mapped) {
      uint64_t i = 0;
      while (expected[i] == mapped[i]) ++i;
      return absl::DataLossError(absl::StrCat("tensor '", view.info->name, "' differs from the checkpoint at byte ",
                                              tensor_byte + done + i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<VerifyResult> VerifyAgainstCheckpoint(const MappedModel& model, const std::string& checkpoint_dir) {
  WEIGHTD_ASSIGN_OR_RETURN(Catalog catalog, BuildCatalog(checkpoint_dir));
  VerifyResult result;
  for (const TensorView& view : model.tensors()) {
    const TensorInfo& t = *view.info;
    const CatalogTensor* source = catalog.Find(t.name);
    if (source == nullptr) return absl::NotFoundError(absl::StrCat("tensor '", t.name, "' is not in ", checkpoint_dir));
    const RandomAccessFile& file = *catalog.files[source->file].file;  // the file cataloged, not its path again
    if (t.split_dim < 0) {
      if (t.nbytes != source->nbytes) {
        return absl::DataLossError(absl::StrCat("tensor '", t.name, "' has ", t.nbytes, " bytes, the checkpoint ",
                                                source->nbytes));
      }
      WEIGHTD_RETURN_IF_ERROR(CompareRange(file, source->offset, model, view, 0, t.nbytes));
    } else {
      // Row-major: `outer` runs of `run` bytes, each taken at split_start of the split dim.
      uint64_t outer = 1, inner_elems = 1;
      for (int d = 0; d < t.split_dim; ++d) outer *= t.full_shape[d];
      for (size_t d = t.split_dim + 1; d < t.full_shape.size(); ++d) inner_elems *= t.full_shape[d];
      uint64_t full_elems = outer * t.full_shape[t.split_dim] * inner_elems;
      uint64_t elem_bits = full_elems == 0 ? 0 : source->nbytes * 8 / full_elems;
      uint64_t row = inner_elems * elem_bits / 8;
      uint64_t run = t.shape[t.split_dim] * row;
      for (uint64_t o = 0; o < outer; ++o) {
        uint64_t src = source->offset + (o * t.full_shape[t.split_dim] + t.split_start) * row;
        WEIGHTD_RETURN_IF_ERROR(CompareRange(file, src, model, view, o * run, run));
      }
    }
    ++result.tensors;
    result.bytes += t.nbytes;
  }
  return result;
}

absl::StatusOr<VerifyResult> VerifyLayoutHashes(const MappedModel& model) {
  VerifyResult result;
  std::string block;
  for (const TensorView& view : model.tensors()) {
    const TensorInfo& t = *view.info;
    std::vector<uint64_t> blocks;
    for (uint64_t at = 0; at < t.nbytes; at += kHashBlockBytes) {
      block.resize(std::min(kHashBlockBytes, t.nbytes - at));
      WEIGHTD_RETURN_IF_ERROR(model.CopyToHost(view, at, block.data(), block.size()));
      blocks.push_back(TensorContentHash(block.data(), block.size()));
    }
    uint64_t hash = CombineBlockHashes(blocks);  // the daemon's block scheme (content_hash.h)
    if (ContentHashHex(hash) != t.content_hash) {
      return absl::DataLossError(absl::StrCat("layout tensor '", t.name, "' (", t.nbytes, " bytes) hashes to ",
                                              ContentHashHex(hash), " but the daemon recorded ", t.content_hash));
    }
    ++result.tensors;
    result.bytes += t.nbytes;
  }
  return result;
}

}  // namespace weightd::cli
