// A catalog: every tensor of a checkpoint (name, dtype, shape, file, byte
// range), built from safetensors headers only; tensor data is never read.
//
// A checkpoint path is one of (the Hugging Face conventions):
//   - a single `.safetensors` file;
//   - a folder with `model.safetensors.index.json`: only the shard files its
//     `weight_map` names are read. Errors: a named file is missing, a tensor is
//     absent from its named shard, a tensor is stored in two shards, a shard
//     path leaves the folder (absolute, "..", or a symlink out). A wrong
//     `metadata.total_size` is a warning; the `metadata` block is optional.
//     A tensor a shard holds but the index does not name is kept, with a warning;
//   - a folder of `.safetensors` files without an index: all of them, sorted by
//     name; a tensor name in two files is an error.
// An index that exists in any form (a dangling symlink, a directory, a FIFO)
// but is not a regular file is an error, never a fall-back to the folder's
// files. A shard name holding a NUL byte is an error. A shard must resolve
// into the checkpoint folder, or, for a Hugging Face cache snapshot
// (`<repo>/snapshots/<rev>`, whose files are symlinks to `../../blobs/<sha>`),
// into the repository folder `<repo>`.
//
// Files are opened once (Env::OpenForRead: O_PATH first, so a FIFO, device
// or directory is refused without being opened for reading) and kept open in
// CatalogFile::file; the load pipeline reads those, never the path again, so
// the bytes cataloged are the bytes loaded. With model roots (the daemon),
// every file, the index included, must lie under one of them, checked on the
// open file before a byte of it is read (common/io/model_roots.h). Symlinks
// that stay inside a root work; PERMISSION_DENIED otherwise, naming the file
// and where it resolved. Without roots (offline `weightctl inspect`) only
// the folder rules above apply.
#ifndef WEIGHTD_COMMON_FORMAT_CATALOG_H_
#define WEIGHTD_COMMON_FORMAT_CATALOG_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/format/dtype.h"
#include "common/io/env.h"

namespace weightd {

inline constexpr char kIndexFileName[] = "model.safetensors.index.json";

struct CatalogFile {
  std::string name;  // relative to the checkpoint folder (the basename for a single file)
  std::string path;  // as opened (the folder joined with `name`)
  uint64_t size = 0;        // bytes
  uint64_t data_start = 0;  // file offset of the data section (8 + header length)
  int64_t mtime_ns = 0;     // modification time when cataloged
  FileIdentity identity;    // of the open file (common/io/env.h)
  uint64_t header_hash = 0;  // SafetensorsHeader::header_hash
  std::map<std::string, std::string> metadata;  // the header's __metadata__
  // The file as opened and checked by BuildCatalog, shared by every copy of
  // the catalog and closed with the last; readers use it, never `path`.
  std::shared_ptr<const RandomAccessFile> file;
};

struct CatalogTensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  uint32_t file = 0;    // index into Catalog::files
  uint64_t offset = 0;  // absolute byte offset within the file
  uint64_t nbytes = 0;
};

class Catalog {
 public:
  std::string root;                  // the checkpoint path as given
  std::vector<CatalogFile> files;    // in reading order
  std::vector<CatalogTensor> tensors;  // by file, then by offset
  std::map<std::string, std::string> index_metadata;  // index "metadata", values as JSON text
  std::vector<std::string> warnings;                   // advisory problems, one line each

  uint64_t total_bytes() const;
  // The tensor called `name`, or nullptr. O(1) after Finish().
  const CatalogTensor* Find(absl::string_view name) const;
  // Builds the name index; called by BuildCatalog.
  void Finish();

 private:
  absl::flat_hash_map<std::string, size_t> by_name_;
};

struct CatalogOptions {
  Env* env = nullptr;                    // null: Env::Default()
  std::vector<std::string> model_roots;  // every file must lie under one; empty: no such check (offline)
};

// Catalogs the checkpoint at `path`. Errors are INVALID_ARGUMENT (malformed
// checkpoint; the message names the file, the tensor and the rule),
// NOT_FOUND (no such path / no safetensors files) or PERMISSION_DENIED (a
// file outside every model root). Reads headers only. The catalog owns the
// open files. Thread-safe for distinct calls.
absl::StatusOr<Catalog> BuildCatalog(const std::string& path, const CatalogOptions& options);
// Offline: no model roots.
absl::StatusOr<Catalog> BuildCatalog(const std::string& path, Env& env = *Env::Default());

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FORMAT_CATALOG_H_
