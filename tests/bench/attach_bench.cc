// Attach latency: a fresh Client attaching until every tensor view is ready,
// alone, 64 at once, and the self-serve baseline (catalog the checkpoint's
// headers and mmap its files, what a rank does without weightd); and `hold`,
// a client process that touches every page and waits (for PSS).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
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

// Attaches and checks that every tensor of the manifest has its view.
absl::StatusOr<MappedModel> AttachAll(Client& client, const std::string& name) {
  absl::StatusOr<MappedModel> model = client.Attach(name, 0);
  if (model.ok() && model->tensors().size() != model->manifest().tensors.size()) {
    return absl::InternalError("views missing");
  }
  return model;
}

}  // namespace

// attach --socket S --name N [--runs K]: milliseconds from Attach to all
// views ready, each run on a new, connected Client.
int AttachCommand(const Flags& flags) {
  std::vector<double> ms;
  size_t tensors = 0;
  for (long run = 0; run < flags.GetInt("runs", 20); ++run) {
    absl::StatusOr<std::unique_ptr<Client>> client = ConnectedClient(flags.Get("socket"));
    if (!client.ok()) return Fail(client.status().ToString());
    double start = Now();
    absl::StatusOr<MappedModel> model = AttachAll(**client, flags.Get("name"));
    double elapsed = Now() - start;
    if (!model.ok()) return Fail(model.status().ToString());
    tensors = model->tensors().size();
    ms.push_back(elapsed * 1e3);
  }
  Emit({{"tensors", tensors}, {"ms", Summarize(ms)}});
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

// concurrent --socket S --name N [--clients 64]: that many threads, each
// with its own connected Client, attach at the same moment.
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
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      start.arrive_and_wait();
      double t0 = Now();
      absl::StatusOr<MappedModel> model = AttachAll(*clients[i], flags.Get("name"));
      ms[i] = (Now() - t0) * 1e3;
      if (!model.ok()) errors[i] = model.status().ToString();
      done.arrive_and_wait();  // every lease is held at once
    });
  }
  for (std::thread& t : threads) t.join();
  int ok = 0;
  std::string first_error;
  for (const std::string& e : errors) {
    ok += e.empty();
    if (!e.empty() && first_error.empty()) first_error = e;
  }
  Emit({{"clients", n}, {"ok", ok}, {"ms", Summarize(ms)}, {"first_error", first_error}});
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

}  // namespace weightd::bench
