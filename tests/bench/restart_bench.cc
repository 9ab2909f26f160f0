// Restart: what a freshly started rank pays to get every weight. Through
// weightd (attach; attach + read every byte once) against reading the
// checkpoint itself the way safetensors does (parse the header, mmap, copy
// each tensor into its own allocation) and pread into malloc. The time is
// taken inside the process, from the subcommand's start.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "common/format/catalog.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/subcommands.h"
#include "weightd/client.h"

namespace weightd::bench {
namespace {

uint64_t SumWords(const char* p, uint64_t n) {
  uint64_t sum = 0, word;
  for (uint64_t i = 0; i + 8 <= n; i += 8) {
    std::memcpy(&word, p + i, 8);
    sum += word;
  }
  return sum;
}

absl::StatusOr<uint64_t> ViaWeightd(const Flags& flags, bool read_all) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(flags.Get("socket"));
  if (!client.ok()) return client.status();
  absl::StatusOr<MappedModel> model = (*client)->Attach(flags.Get("name"), 0);
  if (!model.ok()) return model.status();
  uint64_t sum = model->tensors().size();
  if (read_all) {
    for (const TensorView& v : model->tensors()) sum += SumWords(static_cast<const char*>(v.data), v.nbytes);
  }
  return sum;
}

// safetensors' load_file: header parse, mmap, one copy per tensor.
absl::StatusOr<uint64_t> MmapCopy(const std::string& path) {
  absl::StatusOr<Catalog> catalog = BuildCatalog(path);
  if (!catalog.ok()) return catalog.status();
  std::vector<const char*> maps;
  for (const CatalogFile& f : catalog->files) {
    int fd = open(f.path.c_str(), O_RDONLY);
    maps.push_back(static_cast<const char*>(mmap(nullptr, f.size, PROT_READ, MAP_SHARED, fd, 0)));
    close(fd);
  }
  uint64_t sum = 0;
  for (const CatalogTensor& t : catalog->tensors) {
    char* copy = static_cast<char*>(std::malloc(t.nbytes));
    std::memcpy(copy, maps[t.file] + t.offset, t.nbytes);
    sum += static_cast<unsigned char>(copy[t.nbytes / 2]);  // kept: the copies live until exit
  }
  return sum;
}

absl::StatusOr<uint64_t> PreadMalloc(const std::string& path) {
  uint64_t sum = 0;
  for (const std::string& f : CheckpointFiles(path)) {
    uint64_t size = FileSize(f);
    char* buf = static_cast<char*>(std::malloc(size));
    int fd = open(f.c_str(), O_RDONLY);
    for (uint64_t got = 0; got < size;) {
      ssize_t n = pread(fd, buf + got, std::min<uint64_t>(size - got, 16u << 20), static_cast<off_t>(got));
      if (n <= 0) return absl::InternalError("pread " + f);
      got += static_cast<uint64_t>(n);
    }
    close(fd);
    sum += static_cast<unsigned char>(buf[size / 2]);
  }
  return sum;
}

}  // namespace

// restart --mode attach|attach-read|mmap-copy|pread-malloc
//         (--socket S --name N | --path P)
int RestartCommand(const Flags& flags) {
  double start = Now();
  std::string mode = flags.Get("mode");
  absl::StatusOr<uint64_t> sum = absl::InvalidArgumentError("unknown --mode " + mode);
  if (mode == "attach" || mode == "attach-read") sum = ViaWeightd(flags, mode == "attach-read");
  if (mode == "mmap-copy") sum = MmapCopy(flags.Get("path"));
  if (mode == "pread-malloc") sum = PreadMalloc(flags.Get("path"));
  double seconds = Now() - start;
  if (!sum.ok()) return Fail(sum.status().ToString());
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  Emit({{"mode", mode}, {"seconds", seconds}, {"checksum", *sum}, {"minor_faults", usage.ru_minflt}});
  return 0;
}

}  // namespace weightd::bench
