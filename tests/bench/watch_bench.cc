// Publish-to-reattach latency: a writer commits small updates one after
// another while a watching process (Client::Watch) attaches each published
// generation, as an engine re-attaching at a step boundary would. Both sides
// read CLOCK_MONOTONIC (system-wide), so their times compare directly; the
// daemon's publish time comes with the event (Unix seconds) and is moved onto
// the monotonic clock by the watcher.
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <optional>

#include "tests/bench/bench_util.h"
#include "tests/bench/subcommands.h"
#include "weightd/client.h"

namespace weightd::bench {
namespace {

double RealtimeNow() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The watching process: "ready" once subscribed, then per PUBLISHED event
// "GENERATION PUBLISHED WOKE ATTACHED" (monotonic seconds) after attaching
// it; the previous generation is released after the new one is attached.
int RunWatcher(const std::string& socket, const std::string& name, long events, FILE* out) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(socket);
  if (!client.ok()) return Fail(client.status().ToString());
  absl::StatusOr<ModelWatch> watch = (*client)->Watch(name);
  if (!watch.ok()) return Fail(watch.status().ToString());
  std::fprintf(out, "ready\n");
  std::fflush(out);
  std::optional<MappedModel> current;
  for (long seen = 0; seen < events;) {
    absl::StatusOr<WatchEvent> event = watch->Next();
    if (!event.ok()) return Fail(event.status().ToString());
    if (event->kind != "PUBLISHED") continue;
    double woke = Now();
    double published = event->time - (RealtimeNow() - Now());
    absl::StatusOr<MappedModel> model = (*client)->Attach(name, 0);
    double attached = Now();
    if (!model.ok()) return Fail(model.status().ToString());
    std::fprintf(out, "%" PRIu64 " %.9f %.9f %.9f\n", model->manifest().generation, published, woke, attached);
    std::fflush(out);
    current.emplace(std::move(*model));
    ++seen;
  }
  return 0;
}

struct Commit {
  double start = 0, done = 0, server = 0;
  uint64_t generation = 0, staged = 0, written = 0;
};

// One small update: new bytes for `tensor`, committed.
absl::StatusOr<Commit> CommitOne(Client& client, const std::string& name, const std::string& tensor, uint64_t seed) {
  absl::StatusOr<Updater> update = client.BeginUpdate(name, {tensor});
  if (!update.ok()) return update.status();
  Commit c;
  for (const WritableTensor& w : update->tensors()) {
    std::memset(w.data, static_cast<int>(seed), w.info.nbytes);
    c.written += w.info.nbytes;
  }
  c.staged = update->bytes_staged();
  c.start = Now();
  absl::StatusOr<CommitInfo> info = update->Commit({}, "latency-" + std::to_string(seed));
  c.done = Now();
  if (!info.ok()) return info.status();
  c.server = info->seconds;
  c.generation = info->model.generation;
  return c;
}

}  // namespace

// publish-watch --socket S --name N --tensor T [--commits 20] [--warmup 2]:
// forks the watcher (before either side starts gRPC), then commits
// warmup + commits updates of tensor T, each after the watcher attached the
// one before; the warm-up commits are not counted.
int PublishWatchCommand(const Flags& flags) {
  long commits = flags.GetInt("commits", 20), warmup = flags.GetInt("warmup", 2);
  std::string socket = flags.Get("socket"), name = flags.Get("name");
  int fds[2];
  if (pipe(fds) != 0) return Fail("pipe");
  pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    _exit(RunWatcher(socket, name, commits + warmup, fdopen(fds[1], "w")));
  }
  close(fds[1]);
  auto stop = [child](const std::string& message) {  // ends the watcher, then fails
    kill(child, SIGTERM);
    waitpid(child, nullptr, 0);
    return Fail(message);
  };
  FILE* in = fdopen(fds[0], "r");
  char line[256];
  if (!std::fgets(line, sizeof(line), in) || std::strcmp(line, "ready\n") != 0) return stop("watcher did not start");
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(socket);
  if (!client.ok()) return stop(client.status().ToString());
  std::vector<double> from_start, from_return, from_publish, delivery, attach, commit_ms, server_ms;
  uint64_t staged = 0, written = 0;
  for (long i = 0; i < commits + warmup; ++i) {
    absl::StatusOr<Commit> c = CommitOne(**client, name, flags.Get("tensor"), static_cast<uint64_t>(i + 1));
    if (!c.ok()) return stop(c.status().ToString());
    uint64_t generation = 0;
    double published = 0, woke = 0, attached = 0;
    if (!std::fgets(line, sizeof(line), in) ||
        std::sscanf(line, "%" SCNu64 " %lf %lf %lf", &generation, &published, &woke, &attached) != 4) {
      return stop("the watcher stopped");
    }
    if (generation != c->generation) return stop("the watcher attached another generation than the commit's");
    if (i < warmup) continue;
    staged = c->staged;
    written = c->written;
    from_start.push_back((attached - c->start) * 1e3);
    from_return.push_back((attached - c->done) * 1e3);
    from_publish.push_back((attached - published) * 1e3);
    delivery.push_back((woke - published) * 1e3);
    attach.push_back((attached - woke) * 1e3);
    commit_ms.push_back((c->done - c->start) * 1e3);
    server_ms.push_back(c->server * 1e3);
  }
  int status = 0;
  waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return Fail("the watcher failed");
  Emit({{"commits", commits}, {"tensor_bytes", written}, {"bytes_staged", staged}, {"commit_start_to_attached_ms", Summarize(from_start)},
        {"commit_return_to_attached_ms", Summarize(from_return)}, {"publish_to_attached_ms", Summarize(from_publish)},
        {"publish_to_event_ms", Summarize(delivery)}, {"event_to_attached_ms", Summarize(attach)},
        {"commit_ms", Summarize(commit_ms)}, {"commit_server_ms", Summarize(server_ms)}});
  return 0;
}

}  // namespace weightd::bench
