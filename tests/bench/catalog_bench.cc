// Catalog speed on a huge header, and the generator of synthetic
// checkpoints with a chosen tensor count and size (the data section is a
// hole: sparse, instant to write, read back as zeros).
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "common/format/catalog.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/subcommands.h"

namespace weightd::bench {

// make-checkpoint --out FILE --tensors N --bytes B: N U8 tensors of about
// B / N bytes each, named like a transformer's.
int MakeCheckpointCommand(const Flags& flags) {
  uint64_t n = static_cast<uint64_t>(flags.GetInt("tensors", 1000));
  uint64_t total = static_cast<uint64_t>(flags.GetInt("bytes", 1 << 20));
  std::string header = "{";
  uint64_t offset = 0;
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t size = total / n + (i + 1 == n ? total % n : 0);
    char entry[200];
    std::snprintf(entry, sizeof(entry), "%s\"model.layers.%lu.mlp.w%lu.weight\":{\"dtype\":\"U8\",\"shape\":[%lu],"
                  "\"data_offsets\":[%lu,%lu]}", i == 0 ? "" : ",", static_cast<unsigned long>(i / 100),
                  static_cast<unsigned long>(i % 100), static_cast<unsigned long>(size),
                  static_cast<unsigned long>(offset), static_cast<unsigned long>(offset + size));
    header += entry;
    offset += size;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out = flags.Get("out");
  int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return Fail("create " + out);
  unsigned char len[8];
  for (int b = 0; b < 8; ++b) len[b] = static_cast<unsigned char>(header.size() >> (8 * b));
  bool ok = write(fd, len, 8) == 8 && write(fd, header.data(), header.size()) == static_cast<ssize_t>(header.size()) &&
            ftruncate(fd, static_cast<off_t>(8 + header.size() + offset)) == 0;
  close(fd);
  if (!ok) return Fail("write " + out);
  Emit({{"path", out}, {"tensors", n}, {"bytes", offset}, {"header_bytes", header.size()}});
  return 0;
}

// catalog --path P [--runs K]: seconds to catalog (read and validate the
// headers of) a checkpoint.
int CatalogCommand(const Flags& flags) {
  std::vector<double> seconds;
  size_t tensors = 0;
  for (long run = 0; run < flags.GetInt("runs", 3); ++run) {
    double start = Now();
    absl::StatusOr<Catalog> catalog = BuildCatalog(flags.Get("path"));
    seconds.push_back(Now() - start);
    if (!catalog.ok()) return Fail(catalog.status().ToString());
    tensors = catalog->tensors.size();
  }
  Emit({{"tensors", tensors}, {"seconds", Summarize(seconds)}});
  return 0;
}

}  // namespace weightd::bench
