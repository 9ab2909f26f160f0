// The writer path (issue "Generations from a writer"): a writer process
// publishing new bytes for some or all tensors of a served model, the
// baseline it is held against (one memcpy of the same bytes into fresh
// shared memory), and a partial reload from disk.
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/subcommands.h"
#include "weightd/client.h"

namespace weightd::bench {
namespace {

// `n` bytes of malloc'd memory, every page touched, holding words that
// depend on `seed`: the trainer's new weights, already in its memory.
char* NewBytes(uint64_t n, uint64_t seed) {
  char* p = static_cast<char*>(std::malloc(n + 8));
  uint64_t word = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t i = 0; i < n; i += 8, word += 0x9E3779B97F4A7C15ull) std::memcpy(p + i, &word, 8);
  return p;
}

long MinorFaults() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// The host tensors of rank 0 that the flags select, in manifest (layout)
// order: --prefixes P1,P2 (names starting with one of them), --every K
// (every K-th tensor), or all.
std::vector<const TensorInfo*> Select(const Manifest& manifest, const Flags& flags) {
  std::vector<std::string> prefixes = absl::StrSplit(flags.Get("prefixes"), ',', absl::SkipEmpty());
  long every = flags.GetInt("every", 0);
  std::vector<const TensorInfo*> chosen;
  for (size_t i = 0; i < manifest.tensors.size(); ++i) {
    const TensorInfo& t = manifest.tensors[i];
    bool match = prefixes.empty() && every <= 0;
    for (const std::string& p : prefixes) match = match || absl::StartsWith(t.name, p);
    if (every > 0 && i % static_cast<size_t>(every) == static_cast<size_t>(every / 2)) match = true;
    if (match && t.location == Location::kHost) chosen.push_back(&t);
  }
  return chosen;
}

}  // namespace

// publish --socket S --name N [--prefixes P,... | --every K] [--seed X]:
// one update by this process. New bytes for the selected tensors are
// prepared first (untimed); then BeginUpdate (the daemon stages copies of
// the segments holding them), one memcpy per tensor into its writable
// view, and Commit (unmap; the daemon seals, hashes, publishes). Names no
// tensor in BeginUpdate when all are selected (the API's "all").
int PublishCommand(const Flags& flags) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(flags.Get("socket"));
  if (!client.ok()) return Fail(client.status().ToString());
  std::string name = flags.Get("name");
  absl::StatusOr<Manifest> manifest = (*client)->GetManifest(name, 0);
  if (!manifest.ok()) return Fail(manifest.status().ToString());
  std::vector<const TensorInfo*> chosen = Select(*manifest, flags);
  std::vector<std::string> names;
  uint64_t bytes = 0;
  for (const TensorInfo* t : chosen) {
    names.push_back(t->name);
    bytes += t->nbytes;
  }
  if (chosen.size() == manifest->tensors.size()) names.clear();
  char* source = NewBytes(bytes, static_cast<uint64_t>(flags.GetInt("seed", 1)));

  double t0 = Now();
  absl::StatusOr<Updater> update = (*client)->BeginUpdate(name, names);
  if (!update.ok()) return Fail(update.status().ToString());
  double t1 = Now();
  long faults = MinorFaults();
  uint64_t at = 0;
  for (const WritableTensor& w : update->tensors()) {
    std::memcpy(w.data, source + at, w.info.nbytes);
    at += w.info.nbytes;
  }
  double t2 = Now();
  faults = MinorFaults() - faults;
  uint64_t staged = update->bytes_staged(), shared = update->bytes_shared();
  absl::StatusOr<CommitInfo> commit = update->Commit({}, flags.Get("label", "bench"));
  double t3 = Now();
  std::free(source);
  if (!commit.ok()) return Fail(commit.status().ToString());
  if (at != bytes) return Fail("the update's tensors differ from the manifest's selection");
  Emit({{"tensors", chosen.size()}, {"model_tensors", manifest->tensors.size()}, {"tensor_bytes", bytes},
        {"bytes_staged", staged}, {"bytes_shared", shared}, {"begin_s", t1 - t0}, {"write_s", t2 - t1},
        {"commit_s", t3 - t2}, {"commit_server_s", commit->seconds}, {"total_s", t3 - t0},
        {"write_minor_faults", faults}, {"generation", commit->model.generation},
        {"tensors_changed", commit->tensors_changed}, {"first", chosen.front()->name},
        {"last", chosen.back()->name}});
  return 0;
}

// shm-copy --bytes B [--seed X]: the writer path's baseline: one memcpy of
// B new bytes from this process's memory into fresh shared memory (a new
// memfd mapped MAP_SHARED; creating and first touching its pages included).
int ShmCopyCommand(const Flags& flags) {
  uint64_t bytes = static_cast<uint64_t>(flags.GetInt("bytes", 1 << 30));
  char* source = NewBytes(bytes, static_cast<uint64_t>(flags.GetInt("seed", 1)));
  double start = Now();
  int fd = memfd_create("weightd-bench-shm-copy", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) return Fail("memfd_create/ftruncate");
  void* addr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) return Fail("mmap");
  long faults = MinorFaults();
  std::memcpy(addr, source, bytes);
  double seconds = Now() - start;
  faults = MinorFaults() - faults;
  munmap(addr, bytes);
  close(fd);
  std::free(source);
  Emit({{"seconds", seconds}, {"bytes", bytes}, {"gbps", bytes / seconds / 1e9}, {"minor_faults", faults}});
  return 0;
}

// reload --socket S --name N [--path P]: one Client::Reload of READY `name`
// (only the files whose identity changed are read), timed by the client.
int ReloadCommand(const Flags& flags) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(flags.Get("socket"));
  if (!client.ok()) return Fail(client.status().ToString());
  double start = Now();
  absl::StatusOr<LoadResult> result = (*client)->Reload(flags.Get("name"), flags.Get("path"));
  double seconds = Now() - start;
  if (!result.ok()) return Fail(result.status().ToString());
  Emit({{"seconds", seconds}, {"bytes_read", result->bytes_read}, {"bytes_reused", result->bytes_reused},
        {"generation", result->model.generation}, {"server_seconds", result->model.load_seconds}});
  return 0;
}

}  // namespace weightd::bench
