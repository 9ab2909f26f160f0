#include "server/restart/fd_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <malloc.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "server/restart/upgrade.h"

namespace weightd {
namespace {

class SystemdFdStore final : public FdStoreSink {
 public:
  absl::Status Store(const std::string& name, int fd) override {
    int r = sd_pid_notify_with_fds(0, 0, absl::StrCat("FDSTORE=1\nFDNAME=", name).c_str(), &fd, 1);
    if (r < 0) return ErrnoToStatus(absl::StrCat("sd_pid_notify_with_fds FDSTORE ", name), -r);
    return absl::OkStatus();
  }
  absl::Status Remove(const std::string& name) override {
    int r = sd_pid_notify(0, 0, absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", name).c_str());
    if (r < 0) return ErrnoToStatus(absl::StrCat("sd_pid_notify FDSTOREREMOVE ", name), -r);
    return absl::OkStatus();
  }
};

uint64_t InodeOf(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// How a record names arena `arena` of `layout`, stored as `name`.
StoredSegment ArenaStored(const Layout& layout, const DeviceArena& arena, const std::string& name) {
  SegmentBackend backend = SegmentBackend::kEmulated;
  for (const SegmentRecord& s : layout.segments) {
    if (s.placement == Placement::kDevice) backend = s.backend;
  }
  uint64_t inode = backend == SegmentBackend::kEmulated ? InodeOf(arena.export_fd()) : 0;
  return {name, backend, arena.size(), inode, false, arena.device().uuid};
}

}  // namespace

std::unique_ptr<FdStoreSink> MakeSystemdFdStore() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  if (socket == nullptr || *socket == '\0') return nullptr;
  // systemd 254+ says how many fds it keeps ($FDSTORE); older ones say
  // nothing and drop fds over FileDescriptorStoreMax= without telling us.
  const char* limit = std::getenv("FDSTORE");
  uint64_t n = 0;
  if (limit != nullptr && absl::SimpleAtoi(limit, &n) && n == 0) {
    LogWarning("fd store: the service manager keeps no fds (FileDescriptorStoreMax=0): models will not survive a "
               "restart; set FileDescriptorStoreMax= (deploy/systemd/weightd.service)");
    return nullptr;
  }
  if (limit != nullptr) LogInfo(absl::StrCat("fd store: the service manager keeps up to ", limit, " fds"));
  return std::make_unique<SystemdFdStore>();
}

bool SealedAgainstWrites(int fd) {
  constexpr int kSealed = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW;
  int seals = fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & kSealed) == kSealed;
}

std::string InheritedFdProblem(int fd, const std::string& name) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return "it is not open";
  if (S_ISSOCK(st.st_mode) || S_ISDIR(st.st_mode) || S_ISFIFO(st.st_mode)) {
    return "it is a socket, directory or FIFO, not a memory segment";
  }
  if (absl::StartsWith(name, "wd-rec-") && !SealedAgainstWrites(fd)) {
    return "a state record must be a memfd sealed against writes";
  }
  return "";
}

// Keeps the fds that are what their names claim; closes the others (those
// that are open) with one log line each.
static std::vector<NamedFd> KeepGenuine(std::vector<NamedFd> fds, const std::string& source) {
  std::vector<NamedFd> kept;
  for (NamedFd& f : fds) {
    std::string problem = InheritedFdProblem(f.fd.get(), f.name);
    if (problem.empty()) {
      kept.push_back(std::move(f));
      continue;
    }
    LogWarning(absl::StrCat(source, " names fd ", f.fd.get(), " (", ElideName(f.name), "), refused: ", problem));
    if (problem == "it is not open") (void)f.fd.Release();  // nothing to close: the number may be reused later
  }
  return kept;
}

std::vector<NamedFd> TakeListenFds() {
  std::optional<std::vector<NamedFd>> handed = TakeHandoffFds();
  if (handed && !handed->empty()) return KeepGenuine(std::move(*handed), kHandoffEnv);
  char** names = nullptr;
  int n = sd_listen_fds_with_names(/*unset_environment=*/1, &names);
  std::vector<NamedFd> fds;
  if (n == -EBADF) {  // sd_listen_fds(3) could not mark one of them close-on-exec
    LogWarning(absl::StrCat("LISTEN_FDS names fds from ", SD_LISTEN_FDS_START,
                            " on that were not passed (not open): nothing adopted"));
    return fds;
  }
  if (n < 0) {
    LogWarning(absl::StrCat("cannot read the fds passed at start (LISTEN_FDS): ", ErrnoToStatus("sd_listen_fds", -n).message()));
    return fds;
  }
  for (int i = 0; i < n; ++i) {
    int fd = SD_LISTEN_FDS_START + i;
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    fds.push_back({names != nullptr && names[i] != nullptr ? names[i] : "unknown", ScopedFd(fd)});
  }
  if (names != nullptr) {
    for (int i = 0; i < n; ++i) std::free(names[i]);
    std::free(names);
  }
  return KeepGenuine(std::move(fds), "LISTEN_FDS");
}

absl::StatusOr<ScopedFd> SealedMemfd(const std::string& model, const std::string& bytes) {
  ScopedFd fd(memfd_create(absl::StrCat("wd-state:", model).substr(0, 249).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoToStatus("memfd_create for a state record", errno);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t put = pwrite(fd.get(), bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return ErrnoToStatus("write a state record", put < 0 ? errno : ENOSPC);
    done += static_cast<size_t>(put);
  }
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
    return ErrnoToStatus("seal a state record", errno);
  }
  return fd;
}

FdStoreKeeper::FdStoreKeeper(std::unique_ptr<FdStoreSink> sink, const RecordKey* key)
    : key_(key), sink_(std::move(sink)) {
  worker_ = std::thread([this] { Run(); });
}

FdStoreKeeper::~FdStoreKeeper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  worker_.join();
}

void FdStoreKeeper::Adopted(const std::shared_ptr<ModelGeneration>& model, const std::string& record_name,
                            ScopedFd record_fd, const std::vector<std::string>& host_segment_names,
                            const std::vector<std::string>& arena_names,
                            const std::vector<std::pair<std::shared_ptr<const Layout>, std::vector<std::string>>>& layouts) {
  absl::MutexLock lock(&state_mu_);
  Stored stored{record_name, std::move(record_fd), model, {}, {}, {}, {}};
  for (size_t i = 0; i < model->host_segments.size() && i < host_segment_names.size(); ++i) {
    AdoptSegment(model->host_segments[i], model->host_segments[i]->fd(), host_segment_names[i], stored);
  }
  for (size_t i = 0; i < model->arenas.size() && i < arena_names.size(); ++i) {
    AdoptSegment(model->arenas[i], model->arenas[i]->export_fd(), arena_names[i], stored);
  }
  // A rewritten record ("wd-rec-G.N") was adopted: the next rewrite's name
  // must differ from it, or storing the new record and removing the old
  // one would remove both (FDSTOREREMOVE drops every fd of a name).
  if (size_t dot = record_name.rfind('.'); dot != std::string::npos) {
    uint64_t n = 0;
    if (absl::SimpleAtoi(record_name.substr(dot + 1), &n)) next_rewrite_ = std::max(next_rewrite_, n + 1);
  }
  // The record to write again (Handoff without a sink) names the layouts'
  // segments as the restored record did.
  for (const auto& [layout, names] : layouts) {
    size_t k = 0;
    for (const auto& segment : layout->host_segments) {
      if (k >= names.size()) break;
      AdoptSegment(segment, segment->fd(), names[k], stored);
      stored.layouts.host.push_back({names[k++], SegmentBackend::kMemfd, segment->size(), InodeOf(segment->fd()),
                                     segment->huge_pages(), ""});
    }
    for (const auto& arena : layout->arenas) {
      if (k >= names.size()) break;
      AdoptSegment(arena, arena->export_fd(), names[k], stored);
      stored.layouts.arenas.push_back(ArenaStored(*layout, *arena, names[k++]));
    }
    stored.layouts.layouts.push_back(layout);
  }
  models_[model->request.name] = std::move(stored);
}

void FdStoreKeeper::AdoptSegment(std::shared_ptr<const void> object, int fd, const std::string& name, Stored& stored) {
  const void* key = object.get();
  segment_names_[key] = {name, std::move(object), fd};
  ++segment_refs_[name];
  stored.segments.push_back(name);
  uint64_t n = 0;
  if (name.rfind("wd-seg-", 0) == 0 && absl::SimpleAtoi(name.substr(7), &n)) next_segment_ = std::max(next_segment_, n + 1);
}

void FdStoreKeeper::Drop(const std::string& name) {
  absl::MutexLock lock(&state_mu_);
  if (sink_) Note(sink_->Remove(name), absl::StrCat("drop ", name));
}

void FdStoreKeeper::OnGenerationPublished(const std::shared_ptr<ModelGeneration>& model) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({model, model->request.name});
}

void FdStoreKeeper::OnModelUnloaded(const std::string& name) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({nullptr, name});
}

void FdStoreKeeper::OnLayoutsChanged(const std::shared_ptr<ModelGeneration>& model) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({model, model->request.name, true});
}

void FdStoreKeeper::Run() {
  for (;;) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](FdStoreKeeper* k) ABSL_NO_THREAD_SAFETY_ANALYSIS { return k->stop_ || !k->queue_.empty(); }, this));
      if (queue_.empty()) return;  // stopping, all done
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    {
      absl::MutexLock lock(&state_mu_);
      if (task.publish) {
        Publish(task.publish, task.relayout);
      } else {
        Unload(task.name);
      }
    }
    task.publish.reset();  // may free the generation: outside both locks
    absl::MutexLock lock(&mu_);
    busy_ = false;
  }
}

void FdStoreKeeper::Publish(const std::shared_ptr<ModelGeneration>& model, bool relayout) {
  const std::string& name = model->request.name;
  auto old = models_.find(name);
  const bool stored_now = old != models_.end() && old->second.model.lock() == model;
  if (stored_now && !relayout) return;  // adopted at start
  if (relayout && !stored_now) return;  // a newer generation replaced it, or its name was unloaded
  Stored next{relayout ? absl::StrCat("wd-rec-", model->generation, ".", next_rewrite_++)
                       : absl::StrCat("wd-rec-", model->generation),
              ScopedFd(), model, {}, {}, {}, {}};
  std::vector<StoredSegment> host, arenas;
  absl::Status status;
  for (const auto& segment : model->host_segments) {
    absl::StatusOr<std::string> fd_name = Need(segment, segment->fd());
    if (!fd_name.ok()) { status = fd_name.status(); break; }
    next.segments.push_back(*fd_name);
    host.push_back({*fd_name, SegmentBackend::kMemfd, segment->size(), InodeOf(segment->fd()), segment->huge_pages(), ""});
  }
  for (size_t i = 0; status.ok() && i < model->arenas.size(); ++i) {
    const DeviceArena& arena = *model->arenas[i];
    SegmentBackend backend = SegmentBackend::kEmulated;
    for (const SegmentRecord& s : model->segments) {
      if (s.placement == Placement::kDevice && s.owner == i) backend = s.backend;
    }
    if (arena.export_fd() < 0) {
      status = absl::UnimplementedError(absl::StrCat("its ", SegmentBackendName(backend),
                                                     " arenas are exported by handle, which no fd store can keep"));
      break;
    }
    absl::StatusOr<std::string> fd_name = Need(model->arenas[i], arena.export_fd());
    if (!fd_name.ok()) { status = fd_name.status(); break; }
    next.segments.push_back(*fd_name);
    uint64_t inode = backend == SegmentBackend::kEmulated ? InodeOf(arena.export_fd()) : 0;
    arenas.push_back({*fd_name, backend, arena.size(), inode, false, arena.device().uuid});
  }
  if (status.ok()) {
    absl::StatusOr<LayoutsToStore> layouts = StoreLayouts(*model, next.segments);
    if (layouts.ok()) next.layouts = std::move(*layouts);
    status = layouts.status();
  }
  // Without a service manager the record is written only if an upgrade
  // needs it (Handoff): encoding 100,000 tensors takes ~100 MB of heap.
  absl::StatusOr<ScopedFd> record = ScopedFd();
  if (status.ok() && sink_) {
    record = WriteRecord(*model, host, arenas, next.layouts);
    if (record.ok()) status = sink_->Store(next.record_name, record->get());
  }
  if (!record.ok()) status = record.status();
  if (relayout && !status.ok()) {  // the record stored before still holds the generation
    Release(next.segments);
    Note(status, absl::StrCat("keep the layouts of '", name, "' generation ", model->generation, " across a restart"));
    return;
  }
  // The name's older record goes either way: after a failure, a restart must
  // not bring back a generation older than the one served now.
  if (old != models_.end()) {
    if (sink_ && old->second.record_name != next.record_name) {
      Note(sink_->Remove(old->second.record_name), absl::StrCat("drop ", old->second.record_name));
    }
    Release(old->second.segments);
    models_.erase(old);
  }
  if (!status.ok()) {
    Release(next.segments);
    Note(status, absl::StrCat("keep '", name, "' generation ", model->generation, " across a restart"));
    return;
  }
  next.record_fd = std::move(*record);
  next.host = std::move(host);
  next.arenas = std::move(arenas);
  models_[name] = std::move(next);
}

absl::StatusOr<LayoutsToStore> FdStoreKeeper::StoreLayouts(const ModelGeneration& model, std::vector<std::string>& names) {
  LayoutsToStore out;
  for (const auto& layout : model.layouts->List()) {
    // Arenas exported by handle (cuda-legacy-ipc) die with this process:
    // such a layout is left out of the record, the others are kept.
    if (std::any_of(layout->arenas.begin(), layout->arenas.end(), [](const auto& a) { return a->export_fd() < 0; })) {
      LogWarning(absl::StrCat("fd store: layout ", QuoteName(layout->key), " of rank ", layout->rank, " of '",
                              model.request.name, "' is not kept across a restart: its arenas are exported by "
                              "handle, which no fd store can keep"));
      continue;
    }
    for (const auto& segment : layout->host_segments) {
      WEIGHTD_ASSIGN_OR_RETURN(std::string fd_name, Need(segment, segment->fd()));
      names.push_back(fd_name);
      out.host.push_back({fd_name, SegmentBackend::kMemfd, segment->size(), InodeOf(segment->fd()), segment->huge_pages(), ""});
    }
    for (const auto& arena : layout->arenas) {
      WEIGHTD_ASSIGN_OR_RETURN(std::string fd_name, Need(arena, arena->export_fd()));
      names.push_back(fd_name);
      out.arenas.push_back(ArenaStored(*layout, *arena, fd_name));
    }
    out.layouts.push_back(layout);
  }
  return out;
}

absl::StatusOr<ScopedFd> FdStoreKeeper::WriteRecord(const ModelGeneration& model, const std::vector<StoredSegment>& host,
                                                    const std::vector<StoredSegment>& arenas,
                                                    const LayoutsToStore& layouts) const {
  absl::StatusOr<ScopedFd> record;
  {
    absl::StatusOr<std::string> bytes = EncodeStateRecord(model, host, arenas, key_, layouts);
    record = bytes.ok() ? SealedMemfd(model.request.name, *bytes) : bytes.status();
  }
  malloc_trim(0);  // the encoder's many small allocations: give them back now, not at the next load
  return record;
}

void FdStoreKeeper::Unload(const std::string& name) {
  auto it = models_.find(name);
  if (it == models_.end()) return;
  if (sink_) Note(sink_->Remove(it->second.record_name), absl::StrCat("drop ", it->second.record_name));
  Release(it->second.segments);
  models_.erase(it);
}

absl::StatusOr<std::string> FdStoreKeeper::Need(std::shared_ptr<const void> object, int fd) {
  auto it = segment_names_.find(object.get());
  if (it != segment_names_.end()) {
    ++segment_refs_[it->second.name];
    return it->second.name;
  }
  std::string name = absl::StrCat("wd-seg-", next_segment_++);
  if (sink_) WEIGHTD_RETURN_IF_ERROR(sink_->Store(name, fd));
  const void* key = object.get();  // before the move: `a = b` evaluates b first (C++17)
  segment_names_[key] = {name, std::move(object), fd};
  segment_refs_[name] = 1;
  return name;
}

void FdStoreKeeper::Release(const std::vector<std::string>& segments) {
  for (const std::string& name : segments) {
    auto ref = segment_refs_.find(name);
    if (ref == segment_refs_.end() || --ref->second > 0) continue;
    segment_refs_.erase(ref);
    for (auto it = segment_names_.begin(); it != segment_names_.end();) {
      it = it->second.name == name ? segment_names_.erase(it) : std::next(it);
    }
    if (sink_) Note(sink_->Remove(name), absl::StrCat("drop ", name));
  }
}

void FdStoreKeeper::Note(const absl::Status& status, const std::string& what) {
  if (status.ok()) return;
  ++errors_;
  LogWarning(absl::StrCat("fd store: cannot ", what, ": ", status.message()));
}

void FdStoreKeeper::Flush() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](FdStoreKeeper* k) ABSL_NO_THREAD_SAFETY_ANALYSIS { return k->queue_.empty() && !k->busy_; }, this));
}

std::vector<NamedFd> FdStoreKeeper::Handoff() {
  Flush();
  absl::MutexLock lock(&state_mu_);
  std::vector<NamedFd> records, segments;
  std::set<std::string> named;
  auto dup = [](int fd) { return ScopedFd(fcntl(fd, F_DUPFD_CLOEXEC, 3)); };
  for (auto& [name, stored] : models_) {
    if (!stored.record_fd.valid()) {  // no service manager: written now
      std::shared_ptr<ModelGeneration> model = stored.model.lock();
      absl::StatusOr<ScopedFd> record = model ? WriteRecord(*model, stored.host, stored.arenas, stored.layouts)
                                              : absl::StatusOr<ScopedFd>(absl::NotFoundError("freed"));
      if (!record.ok()) {
        Note(record.status(), absl::StrCat("hand '", name, "' over"));
        continue;
      }
      stored.record_fd = std::move(*record);
    }
    records.push_back({stored.record_name, dup(stored.record_fd.get())});
  }
  for (const auto& [object, segment] : segment_names_) {  // the keeper holds each object: its fd is open
    if (named.insert(segment.name).second) segments.push_back({segment.name, dup(segment.fd)});
  }
  for (NamedFd& s : segments) records.push_back(std::move(s));
  return records;
}

std::vector<std::string> FdStoreKeeper::StoredNames() const {
  absl::MutexLock lock(&state_mu_);
  std::vector<std::string> names;
  for (const auto& [model, stored] : models_) names.push_back(stored.record_name);
  for (const auto& [name, refs] : segment_refs_) names.push_back(name);
  return names;
}

uint64_t FdStoreKeeper::errors() const {
  absl::MutexLock lock(&state_mu_);
  return errors_;
}

}  // namespace weightd
