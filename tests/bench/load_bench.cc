// Load throughput: weightd's LoadModel against one thread read()ing the same
// files into freshly allocated memory (the baseline (b)).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <thread>
#include <vector>

#include "tests/bench/bench_util.h"
#include "tests/bench/subcommands.h"
#include "weightd/client.h"

namespace weightd::bench {

// load --socket S --name N --path P [--runs K]: K loads, each unloaded
// afterwards; per run the client's wall time and when each phase began.
int LoadCommand(const Flags& flags) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(flags.Get("socket"));
  if (!client.ok()) return Fail(client.status().ToString());
  nlohmann::json runs = nlohmann::json::array();
  for (long run = 0; run < flags.GetInt("runs", 1); ++run) {
    std::string name = flags.Get("name", "bench") + "-" + std::to_string(run);
    std::map<std::string, double> phase_start;
    double start = Now();
    absl::StatusOr<LoadResult> result = (*client)->Load(name, flags.Get("path"), LoadOptions{},
                                                        [&](const LoadProgressInfo& p) {
                                                          phase_start.emplace(p.phase, Now() - start);
                                                        });
    double seconds = Now() - start;
    if (!result.ok()) return Fail(result.status().ToString());
    uint64_t bytes = result->model.checkpoint_bytes;
    nlohmann::json phases;
    for (const auto& [phase, at] : phase_start) phases[phase] = at;
    runs.push_back({{"seconds", seconds}, {"bytes", bytes}, {"gbps", bytes / seconds / 1e9},
                    {"server_seconds", result->model.load_seconds}, {"phase_start", phases},
                    {"host_bytes", result->model.host_bytes}, {"bytes_read", result->bytes_read},
                    {"huge_page_bytes", result->model.huge_page_bytes}});
    if (flags.Get("keep") != "true") {
      absl::StatusOr<std::pair<ModelSummary, bool>> unloaded = (*client)->Unload(name, true);
      if (!unloaded.ok()) return Fail(unloaded.status().ToString());
    }
  }
  Emit({{"runs", runs}});
  return 0;
}

// read-malloc FILE...: one thread read()s each file, 16 MiB per call, into
// a fresh malloc'd buffer of the file's size (kept until the end).
int ReadMallocCommand(const Flags& flags) {
  std::vector<std::string> files;
  for (const std::string& p : flags.positional()) {
    for (const std::string& f : CheckpointFiles(p)) files.push_back(f);
  }
  std::vector<char*> buffers;
  uint64_t total = 0;
  double start = Now();
  for (const std::string& f : files) {
    int fd = open(f.c_str(), O_RDONLY);
    if (fd < 0) return Fail("open " + f);
    uint64_t size = FileSize(f);
    char* buf = static_cast<char*>(std::malloc(size));
    buffers.push_back(buf);
    for (uint64_t got = 0; got < size;) {
      ssize_t n = read(fd, buf + got, std::min<uint64_t>(size - got, 16u << 20));
      if (n <= 0) return Fail("read " + f);
      got += static_cast<uint64_t>(n);
    }
    close(fd);
    total += size;
  }
  double seconds = Now() - start;
  for (char* b : buffers) std::free(b);
  Emit({{"seconds", seconds}, {"bytes", total}, {"gbps", total / seconds / 1e9}});
  return 0;
}

// memfd-fill --bytes B [--threads T]: the ceiling a load into fresh shared
// memory can reach here: T threads pwrite(2) 1 MiB of zeros at a time into
// a new memfd of B bytes, reading no file. What it costs is the kernel
// allocating, zeroing and charging each new page.
int MemfdFillCommand(const Flags& flags) {
  uint64_t bytes = static_cast<uint64_t>(flags.GetInt("bytes", 1 << 30));
  int threads = static_cast<int>(flags.GetInt("threads", 2));
  constexpr uint64_t kSlice = 1 << 20;
  int fd = memfd_create("weightd-bench-fill", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) return Fail("memfd_create/ftruncate");
  std::atomic<uint64_t> next{0};
  double start = Now();
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      std::vector<char> zeros(kSlice, 0);
      for (uint64_t at; (at = next.fetch_add(kSlice)) < bytes;) {
        (void)!pwrite(fd, zeros.data(), std::min(kSlice, bytes - at), static_cast<off_t>(at));
      }
    });
  }
  for (std::thread& w : workers) w.join();
  double seconds = Now() - start;
  close(fd);
  Emit({{"seconds", seconds}, {"bytes", bytes}, {"gbps", bytes / seconds / 1e9}, {"threads", threads}});
  return 0;
}

}  // namespace weightd::bench
