// Attach latency: a fresh Client attaching until every tensor view is ready,
// alone, 64 at once, and the self-serve baseline (catalog the checkpoint's
// headers and mmap its files, what a rank does without weightd); and `hold`,
// a client process that touches every page and waits (for PSS).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <fstream>
#include <tuple>
#include <iostream>
#include <latch>
#include <thread>

#include "common/format/catalog.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/subcommands.h"
#include "weightd/client.h"

namespace weightd::bench {
namespace {

// A connected client: its channel is up, so Attach is what gets timed.
absl::StatusOr<std::unique_ptr<Client>> ConnectedClient(const std::string& socket) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(socket);
  if (!client.ok()) return client.status();
  absl::StatusOr<std::vector<ModelSummary>> models = (*client)->List();
  if (!models.ok()) return models.status();
  return client;
}

// --packed true|false (default true): the manifest encoding asked for;
// --prefault true|false (default false).
AttachOptions OptionsOf(const Flags& flags) {
  AttachOptions options;
  options.packed_manifest = flags.Get("packed", "true") == "true";
  options.prefault = flags.Get("prefault", "false") == "true";
  return options;
}

// Attaches and checks that every tensor of the manifest has its view.
absl::StatusOr<MappedModel> AttachAll(Client& client, const std::string& name, const AttachOptions& options = {}) {
  absl::StatusOr<MappedModel> model = client.Attach(name, 0, options);
  if (model.ok() && model->tensors().size() != model->manifest().tensors.size()) {
    return absl::InternalError("views missing");
  }
  return model;
}

// User + system CPU seconds of this process so far.
double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

}  // namespace

// attach --socket S --name N [--runs K] [--packed B] [--prefault B]:
// milliseconds from Attach to all views ready, each run on a new, connected Client.
int AttachCommand(const Flags& flags) {
  std::vector<double> ms, cpu_ms, find_ms;
  size_t tensors = 0;
  for (long run = 0; run < flags.GetInt("runs", 20); ++run) {
    absl::StatusOr<std::unique_ptr<Client>> client = ConnectedClient(flags.Get("socket"));
    if (!client.ok()) return Fail(client.status().ToString());
    double cpu = CpuSeconds();
    double start = Now();
    absl::StatusOr<MappedModel> model = AttachAll(**client, flags.Get("name"), OptionsOf(flags));
    double elapsed = Now() - start;
    cpu_ms.push_back((CpuSeconds() - cpu) * 1e3);
    if (!model.ok()) return Fail(model.status().ToString());
    tensors = model->tensors().size();
    ms.push_back(elapsed * 1e3);
    if (tensors > 0) {  // the first Find() builds the name index
      double t0 = Now();
      if (model->Find(model->tensors().back().info->name) == nullptr) return Fail("Find failed");
      find_ms.push_back((Now() - t0) * 1e3);
    }
  }
  // cpu_ms: this process's CPU time (all its threads, gRPC's included) per attach.
  Emit({{"tensors", tensors}, {"ms", Summarize(ms)}, {"cpu_ms", Summarize(cpu_ms)},
        {"first_find_ms", Summarize(find_ms)}});
  return 0;
}

// self-map --path P [--runs K]: milliseconds to catalog the checkpoint and
// mmap its files read-only with a pointer per tensor (lazy, like Attach).
int SelfMapCommand(const Flags& flags) {
  std::vector<double> ms;
  for (long run = 0; run < flags.GetInt("runs", 20); ++run) {
    double start = Now();
    absl::StatusOr<Catalog> catalog = BuildCatalog(flags.Get("path"));
    if (!catalog.ok()) return Fail(catalog.status().ToString());
    std::vector<std::pair<void*, size_t>> maps;
    for (const CatalogFile& f : catalog->files) {
      int fd = open(f.path.c_str(), O_RDONLY);
      maps.emplace_back(mmap(nullptr, f.size, PROT_READ, MAP_SHARED, fd, 0), f.size);
      close(fd);
    }
    std::vector<const char*> views;
    views.reserve(catalog->tensors.size());
    for (const CatalogTensor& t : catalog->tensors) views.push_back(static_cast<const char*>(maps[t.file].first) + t.offset);
    ms.push_back((Now() - start) * 1e3);
    for (auto& [addr, size] : maps) munmap(addr, size);
  }
  Emit({{"ms", Summarize(ms)}});
  return 0;
}

// concurrent --socket S --name N [--clients 64] [--packed B]: that many
// threads, each with its own connected Client, attach at the same moment.
int ConcurrentCommand(const Flags& flags) {
  int n = static_cast<int>(flags.GetInt("clients", 64));
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<std::unique_ptr<Client>> client = ConnectedClient(flags.Get("socket"));
    if (!client.ok()) return Fail(client.status().ToString());
    clients.push_back(std::move(*client));
  }
  std::vector<double> ms(n);
  std::vector<std::string> errors(n);
  std::latch start(n), done(n);
  std::vector<std::thread> threads;
  double cpu = CpuSeconds();
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      start.arrive_and_wait();
      double t0 = Now();
      absl::StatusOr<MappedModel> model = AttachAll(*clients[i], flags.Get("name"), OptionsOf(flags));
      ms[i] = (Now() - t0) * 1e3;
      if (!model.ok()) errors[i] = model.status().ToString();
      done.arrive_and_wait();  // every lease is held at once
    });
  }
  for (std::thread& t : threads) t.join();
  double client_cpu_ms = (CpuSeconds() - cpu) * 1e3;  // the 64 clients' CPU, gRPC threads included
  int ok = 0;
  std::string first_error;
  for (const std::string& e : errors) {
    ok += e.empty();
    if (!e.empty() && first_error.empty()) first_error = e;
  }
  Emit({{"clients", n}, {"ok", ok}, {"ms", Summarize(ms)}, {"first_error", first_error},
        {"client_cpu_ms", client_cpu_ms}});
  return 0;
}

// hold --socket S --name N: attach, read one byte of every page of every
// host tensor, print a JSON line, then wait until stdin closes.
int HoldCommand(const Flags& flags) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(flags.Get("socket"));
  if (!client.ok()) return Fail(client.status().ToString());
  absl::StatusOr<MappedModel> model = AttachAll(**client, flags.Get("name"));
  if (!model.ok()) return Fail(model.status().ToString());
  uint64_t sum = 0, pages = 0;
  for (const TensorView& v : model->tensors()) {
    if (v.location != Location::kHost) continue;
    const volatile char* p = static_cast<const char*>(v.data);
    for (uint64_t off = 0; off < v.nbytes; off += 4096, ++pages) sum += p[off];
  }
  Emit({{"pid", getpid()}, {"pages_touched", pages}, {"checksum", sum}});
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  return 0;
}

// Bytes of this process's weightd memfd mappings on 2 MiB pages
// (KernelPageSize in /proc/self/smaps), and on any page size.
std::pair<uint64_t, uint64_t> SegmentMappingBytes() {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool segment = false;
  uint64_t size_kb = 0, huge = 0, all = 0;
  while (std::getline(smaps, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') < line.find(' ')) {
      segment = line.find("memfd:weightd:") != std::string::npos;
    } else if (segment && line.rfind("Size:", 0) == 0) {
      size_kb = std::stoull(line.substr(5));
      all += size_kb << 10;
    } else if (segment && line.rfind("KernelPageSize:", 0) == 0 && std::stoull(line.substr(15)) == 2048) {
      huge += size_kb << 10;
    }
  }
  return {huge, all};
}

// touch --socket S --name N [--prefault B] [--runs K]: attach (lazily or
// prefaulted), then read one byte of every 4 KiB page of every host tensor:
// the attach time, the touch time and the page faults the touch took, per
// run, and how many of the mapped segment bytes are on 2 MiB pages.
int TouchCommand(const Flags& flags) {
  std::vector<double> attach_ms, touch_ms, total_ms, faults;
  uint64_t pages = 0, sum = 0, huge_bytes = 0, mapped_bytes = 0;
  for (long run = 0; run < flags.GetInt("runs", 5); ++run) {
    absl::StatusOr<std::unique_ptr<Client>> client = ConnectedClient(flags.Get("socket"));
    if (!client.ok()) return Fail(client.status().ToString());
    double t0 = Now();
    absl::StatusOr<MappedModel> model = AttachAll(**client, flags.Get("name"), OptionsOf(flags));
    double t1 = Now();
    if (!model.ok()) return Fail(model.status().ToString());
    rusage before{}, after{};
    getrusage(RUSAGE_SELF, &before);
    pages = 0;
    for (const TensorView& v : model->tensors()) {
      if (v.location != Location::kHost) continue;
      const volatile char* p = static_cast<const char*>(v.data);
      for (uint64_t off = 0; off < v.nbytes; off += 4096, ++pages) sum += p[off];
    }
    double t2 = Now();
    getrusage(RUSAGE_SELF, &after);
    std::tie(huge_bytes, mapped_bytes) = SegmentMappingBytes();
    attach_ms.push_back((t1 - t0) * 1e3);
    touch_ms.push_back((t2 - t1) * 1e3);
    total_ms.push_back((t2 - t0) * 1e3);
    faults.push_back(static_cast<double>(after.ru_minflt - before.ru_minflt + after.ru_majflt - before.ru_majflt));
  }
  Emit({{"pages_touched", pages}, {"checksum", sum}, {"huge_bytes", huge_bytes}, {"mapped_bytes", mapped_bytes},
        {"attach_ms", Summarize(attach_ms)},
        {"touch_ms", Summarize(touch_ms)}, {"total_ms", Summarize(total_ms)}, {"faults", Summarize(faults)}});
  return 0;
}

}  // namespace weightd::bench
