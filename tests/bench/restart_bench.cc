// Restart: what a freshly started rank pays to get every weight. Through
// weightd (attach; attach + read every byte once) against reading the
// checkpoint itself the way safetensors does (parse the header, mmap, copy
// each tensor into its own allocation) and pread into malloc. The time is
// taken inside the process, from the subcommand's start.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
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

// The down window of a restart as a client sees it: asks the daemon for its
// models every ~1 ms (a fresh connection after any failure, so that gRPC's
// reconnect backoff does not stretch the window) and reports the longest
// interval between two answers that list `name` READY. Runs until it has
// seen an interval of failures end, or for --seconds.
int Probe(const Flags& flags) {
  const std::string socket = flags.Get("socket"), name = flags.Get("name");
  const double until = Now() + std::stod(flags.Get("seconds", "30"));
  std::unique_ptr<Client> client;
  double last_ok = 0, longest = 0;
  uint64_t answers = 0, failures = 0;
  bool failed = false;
  while (Now() < until) {
    bool ok = false;
    if (client == nullptr) {
      absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(socket);
      if (connected.ok()) client = std::move(*connected);
    }
    if (client != nullptr) {
      absl::StatusOr<std::vector<ModelSummary>> models = client->List();
      if (models.ok()) {
        for (const ModelSummary& m : *models) ok = ok || (m.name == name && m.state == "READY");
      } else {
        client.reset();
      }
    }
    double now = Now();
    if (ok) {
      ++answers;
      if (last_ok == 0) std::fprintf(stderr, "probing\n");  // the caller starts the restart from here
      if (last_ok > 0) longest = std::max(longest, now - last_ok);
      last_ok = now;
      if (failed) break;
    } else {
      ++failures;
      failed = last_ok > 0;
    }
    usleep(1000);
  }
  if (answers == 0) return Fail("no answer listing " + name + " READY from " + socket);
  Emit({{"mode", "probe"}, {"down_seconds", longest}, {"answers", answers},
        {"failures", failures}, {"recovered", failed}});
  return 0;
}

}  // namespace

// restart --mode attach|attach-read|mmap-copy|pread-malloc|probe
//         (--socket S --name N [--seconds T] | --path P)
int RestartCommand(const Flags& flags) {
  if (flags.Get("mode") == "probe") return Probe(flags);
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
