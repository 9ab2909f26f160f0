#include "common/format/catalog.h"

#include <algorithm>
#include <set>
#include <stdexcept>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/io/model_roots.h"
#include "common/format/safetensors.h"
#include "common/base/status.h"
#include "common/format/format_error.h"
#include "nlohmann/json.hpp"

namespace weightd {
namespace {

using json = nlohmann::json;

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string Basename(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string Dirname(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos || slash == 0 ? "/" : path.substr(0, slash);
}

using FilePtr = std::shared_ptr<const RandomAccessFile>;

// What BuildCatalog carries while it walks one checkpoint.
struct Walk {
  Env& env;
  ModelRoots roots;  // empty: no root check (offline)
  Catalog& catalog;
};

// Opens `path` (`name` in messages) once; with model roots, the open file
// must lie under one, checked before a byte of it is read.
absl::StatusOr<FilePtr> OpenChecked(const Walk& w, const std::string& path, const std::string& name) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, w.env.OpenForRead(path));
  if (!w.roots.empty()) WEIGHTD_RETURN_IF_ERROR(w.roots.Check(*file, name));
  return FilePtr(std::move(file));
}

// Reads the header of the open `file` and appends its tensors to the catalog.
absl::Status AddFile(Walk& w, FilePtr file, const std::string& path, const std::string& name) {
  WEIGHTD_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadHeader(*file, name));
  Catalog& catalog = w.catalog;
  uint32_t index = static_cast<uint32_t>(catalog.files.size());
  catalog.files.push_back({name, path, file->size(), header.data_start, file->mtime_ns(), file->identity(),
                           header.header_hash, std::move(header.metadata), std::move(file)});
  for (TensorHeader& t : header.tensors) {
    catalog.tensors.push_back(
        {std::move(t.name), t.dtype, std::move(t.shape), index, header.data_start + t.begin, t.end - t.begin});
  }
  return absl::OkStatus();
}

// A tensor name held by two files is an error whichever way the files were found.
absl::Status CheckUniqueNames(const Catalog& catalog) {
  absl::flat_hash_map<absl::string_view, uint32_t> seen;
  seen.reserve(catalog.tensors.size());
  for (const CatalogTensor& t : catalog.tensors) {
    auto [it, inserted] = seen.emplace(t.name, t.file);
    if (!inserted) {
      return CheckpointError(CheckpointRule::kDuplicateTensor,
                             absl::StrCat("tensor ", QuoteName(t.name), " is stored in both ",
                                          ElideName(catalog.files[it->second].name), " and ",
                                          ElideName(catalog.files[t.file].name)));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckShardName(Env& env, const std::string& dir, const std::string& shard) {
  using enum CheckpointRule;
  bool dotdot = false;
  for (absl::string_view part : absl::StrSplit(shard, '/')) dotdot |= part == "..";
  if (shard.empty() || shard[0] == '/' || dotdot) {
    return CheckpointError(kShardOutsideCheckpoint,
                           absl::StrCat(kIndexFileName, ": shard path ", QuoteName(shard), " leaves the checkpoint folder"));
  }
  WEIGHTD_ASSIGN_OR_RETURN(FileKind kind, env.Stat(Join(dir, shard)));
  if (kind == FileKind::kMissing) {
    return CheckpointError(kMissingShard,
                           absl::StrCat(kIndexFileName, ": names shard file ", QuoteName(shard), ", which does not exist"));
  }
  if (kind != FileKind::kRegular) {
    return CheckpointError(kBadIndex, absl::StrCat(kIndexFileName, ": names shard file ", QuoteName(shard),
                                                   ", which is not a regular file"));
  }
  return absl::OkStatus();
}

// The folder an index's shards must resolve into: the checkpoint folder
// `dir_real`, or for a Hugging Face cache snapshot `<repo>/snapshots/<rev>`
// (files are symlinks to ../../blobs/<sha>) the repository folder `<repo>`.
std::string ShardBoundary(const std::string& dir_real) {
  std::string snapshots = Dirname(dir_real);
  std::string repo = Dirname(snapshots);
  return Basename(snapshots) == "snapshots" && repo != "/" ? repo : dir_real;
}

// Opens one shard named by the index; the open file must lie in `boundary`.
absl::Status AddShard(Walk& w, const std::string& dir, const std::string& boundary, const std::string& shard) {
  WEIGHTD_RETURN_IF_ERROR(CheckShardName(w.env, dir, shard));
  WEIGHTD_ASSIGN_OR_RETURN(FilePtr file, OpenChecked(w, Join(dir, shard), shard));
  WEIGHTD_ASSIGN_OR_RETURN(std::string real, file->ResolvedPath());
  if (!PathUnder(real, boundary)) {
    return CheckpointError(CheckpointRule::kShardOutsideCheckpoint,
                           absl::StrCat(kIndexFileName, ": shard path ", QuoteName(shard), " resolves to ",
                                        real, ", outside the checkpoint folder"));
  }
  return AddFile(w, std::move(file), Join(dir, shard), shard);
}

// Parses JSON refusing nesting deeper than kMaxJsonDepth: serialising or
// walking a deeper document recursively could overflow the stack.
constexpr int kMaxJsonDepth = 64;
json ParseJsonBounded(const std::string& text) {
  return json::parse(text, [](int depth, json::parse_event_t, json&) {
    if (depth > kMaxJsonDepth) throw std::runtime_error(absl::StrCat("nests deeper than ", kMaxJsonDepth, " levels"));
    return true;
  });
}

struct Index {
  std::vector<std::pair<std::string, std::string>> weight_map;  // tensor -> shard, in file order
  std::map<std::string, std::string> metadata;
  std::optional<uint64_t> total_size;
};

// Every error is kBadIndex (CatalogIndexed attaches it).
absl::StatusOr<Index> ParseIndex(const std::string& text) {
  json doc;
  try {
    doc = ParseJsonBounded(text);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(kIndexFileName, ": not valid JSON: ", e.what()));
  }
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(kIndexFileName, ": missing the \"weight_map\" object"));
  }
  Index index;
  for (auto& [tensor, shard] : doc["weight_map"].items()) {
    if (!shard.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kIndexFileName, ": weight_map entry ", QuoteName(tensor), " must be a file name string"));
    }
    std::string name = shard.get<std::string>();
    if (name.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(kIndexFileName, ": weight_map entry ", QuoteName(tensor),
                                                     " names a shard with a NUL byte: ", ElideName(shard.dump())));
    }
    index.weight_map.emplace_back(tensor, std::move(name));
  }
  if (doc.contains("metadata")) {
    const json& meta = doc["metadata"];
    if (!meta.is_object()) return absl::InvalidArgumentError(absl::StrCat(kIndexFileName, ": \"metadata\" must be an object"));
    for (auto& [key, value] : meta.items()) index.metadata[key] = value.is_string() ? value.get<std::string>() : value.dump();
    if (meta.contains("total_size") && meta["total_size"].is_number_unsigned()) {
      index.total_size = meta["total_size"].get<uint64_t>();
    }
  }
  return index;
}

// The index exists in the folder listing; anything but a regular file there
// is an error, not a reason to read every .safetensors file instead.
absl::Status CheckIndexKind(Env& env, const std::string& index_path) {
  WEIGHTD_ASSIGN_OR_RETURN(FileKind kind, env.Stat(index_path));
  if (kind == FileKind::kRegular) return absl::OkStatus();
  const char* what = kind == FileKind::kMissing     ? "dangling symbolic link"
                     : kind == FileKind::kDirectory ? "not a regular file (directory)"
                                                    : "not a regular file (FIFO, socket or device)";
  return absl::InvalidArgumentError(absl::StrCat(
      kIndexFileName, ": ", what, "; an index that exists must be a regular file (no fall-back to every .safetensors file)"));
}

// Opens, reads and parses the index; any error there is kBadIndex, whatever
// its code (as an index outside the model roots, or one that cannot be read).
absl::StatusOr<Index> ReadIndex(const Walk& w, const std::string& dir) {
  WEIGHTD_RETURN_IF_ERROR(CheckIndexKind(w.env, Join(dir, kIndexFileName)));
  WEIGHTD_ASSIGN_OR_RETURN(FilePtr index_file, OpenChecked(w, Join(dir, kIndexFileName), kIndexFileName));
  WEIGHTD_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(*index_file, kMaxHeaderBytes));
  return ParseIndex(text);
}

absl::Status CatalogIndexed(Walk& w, const std::string& dir) {
  Catalog& catalog = w.catalog;
  absl::StatusOr<Index> read = ReadIndex(w, dir);
  if (!read.ok()) return WithCheckpointRule(read.status(), CheckpointRule::kBadIndex);
  Index& index = *read;
  WEIGHTD_ASSIGN_OR_RETURN(std::string dir_real, w.env.RealPath(dir));
  const std::string boundary = ShardBoundary(dir_real);
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : index.weight_map) shards.insert(shard);
  for (const std::string& shard : shards) WEIGHTD_RETURN_IF_ERROR(AddShard(w, dir, boundary, shard));
  WEIGHTD_RETURN_IF_ERROR(CheckUniqueNames(catalog));
  catalog.Finish();
  for (const auto& [tensor, shard] : index.weight_map) {
    const CatalogTensor* t = catalog.Find(tensor);
    if (t == nullptr || catalog.files[t->file].name != shard) {
      return CheckpointError(CheckpointRule::kTensorAbsentFromShard,
                             absl::StrCat(kIndexFileName, ": places tensor ", QuoteName(tensor), " in ",
                                          ElideName(shard), ", whose header does not hold it"));
    }
  }
  if (catalog.tensors.size() > index.weight_map.size()) {
    catalog.warnings.push_back(absl::StrCat(catalog.tensors.size() - index.weight_map.size(),
                                            " tensor(s) in the shards are not named by ", kIndexFileName,
                                            "; they are kept"));
  }
  if (index.total_size && *index.total_size != catalog.total_bytes()) {
    catalog.warnings.push_back(absl::StrCat(kIndexFileName, ": metadata.total_size is ", *index.total_size,
                                            " but the tensors hold ", catalog.total_bytes(), " bytes"));
  }
  catalog.index_metadata = std::move(index.metadata);
  return absl::OkStatus();
}

absl::Status CatalogFolder(Walk& w, const std::string& dir, const std::vector<std::string>& names) {
  Catalog& catalog = w.catalog;
  for (const std::string& name : names) {
    if (!absl::EndsWith(name, ".safetensors")) continue;
    WEIGHTD_ASSIGN_OR_RETURN(FileKind kind, w.env.Stat(Join(dir, name)));
    // A dangling link or a FIFO among the weights would silently load a partial model.
    if (kind != FileKind::kRegular) {
      return CheckpointError(CheckpointRule::kInvalid,
                             absl::StrCat(ElideName(name), ": ",
                                          kind == FileKind::kMissing ? "dangling symbolic link" : "not a regular file",
                                          " among the checkpoint's .safetensors files"));
    }
    WEIGHTD_ASSIGN_OR_RETURN(FilePtr file, OpenChecked(w, Join(dir, name), name));
    WEIGHTD_RETURN_IF_ERROR(AddFile(w, std::move(file), Join(dir, name), name));
  }
  if (catalog.files.empty()) return absl::NotFoundError(absl::StrCat(dir, ": folder holds no .safetensors files"));
  WEIGHTD_RETURN_IF_ERROR(CheckUniqueNames(catalog));
  catalog.Finish();
  return absl::OkStatus();
}

}  // namespace

uint64_t Catalog::total_bytes() const {
  uint64_t total = 0;
  for (const CatalogTensor& t : tensors) total += t.nbytes;
  return total;
}

const CatalogTensor* Catalog::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors[it->second];
}

void Catalog::Finish() {
  by_name_.clear();
  by_name_.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) by_name_.emplace(tensors[i].name, i);
}

absl::StatusOr<Catalog> BuildCatalog(const std::string& path, const CatalogOptions& options) {
  Env& env = options.env != nullptr ? *options.env : *Env::Default();
  Catalog catalog;
  catalog.root = path;
  Walk w{env, ModelRoots::Resolve(env, options.model_roots), catalog};
  WEIGHTD_ASSIGN_OR_RETURN(FileKind kind, env.Stat(path));
  switch (kind) {
    case FileKind::kMissing:
      return absl::NotFoundError(absl::StrCat(path, ": no such file or folder"));
    case FileKind::kRegular: {
      WEIGHTD_ASSIGN_OR_RETURN(FilePtr file, OpenChecked(w, path, Basename(path)));
      WEIGHTD_RETURN_IF_ERROR(AddFile(w, std::move(file), path, Basename(path)));
      catalog.Finish();
      return catalog;
    }
    case FileKind::kDirectory: {
      WEIGHTD_ASSIGN_OR_RETURN(std::vector<std::string> names, env.ListDir(path));
      bool indexed = std::find(names.begin(), names.end(), kIndexFileName) != names.end();
      WEIGHTD_RETURN_IF_ERROR(indexed ? CatalogIndexed(w, path) : CatalogFolder(w, path, names));
      return catalog;
    }
    default:
      return CheckpointError(CheckpointRule::kInvalid, absl::StrCat(path, ": not a file or folder"));
  }
}

absl::StatusOr<Catalog> BuildCatalog(const std::string& path, Env& env) {
  return BuildCatalog(path, CatalogOptions{&env, {}});
}

}  // namespace weightd
