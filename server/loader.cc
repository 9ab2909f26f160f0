#include "server/loader.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace weightd {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// One pread of at most kReadBlockBytes into a host segment; also one hash block.
struct ReadTask {
  uint32_t tensor;
  uint32_t file;
  uint64_t src;    // file offset
  uint64_t dst;    // segment offset
  uint64_t n;
  uint32_t block;  // index of this block within its tensor
};

struct Plan {
  std::vector<TensorRecord> tensors;  // catalog order
  std::vector<ReadTask> tasks;
  std::vector<std::vector<uint64_t>> block_hashes;  // per tensor
  uint64_t segment_bytes = 0;
};

absl::Status CheckRequestSupported(const LoadRequest& request) {
  if (!request.devices.empty() || request.tp_size > 1) {
    return absl::InvalidArgumentError(
        "device placement and tensor parallelism need a device backend; this daemon places every tensor on the host");
  }
  return absl::OkStatus();
}

Plan MakeHostPlan(const Catalog& catalog) {
  Plan plan;
  plan.tensors.reserve(catalog.tensors.size());
  plan.block_hashes.resize(catalog.tensors.size());
  uint64_t offset = 0;
  for (uint32_t i = 0; i < catalog.tensors.size(); ++i) {
    const CatalogTensor& t = catalog.tensors[i];
    offset = AlignUp(offset, kHostAlignment);
    TensorRecord r;
    r.name = t.name;
    r.dtype = t.dtype;
    r.shape = t.shape;
    r.full_shape = t.shape;
    r.placement = Placement::kHost;
    r.segment = 0;
    r.offset = offset;
    r.nbytes = t.nbytes;
    plan.tensors.push_back(std::move(r));
    uint32_t blocks = static_cast<uint32_t>((t.nbytes + kReadBlockBytes - 1) / kReadBlockBytes);
    plan.block_hashes[i].assign(std::max<uint32_t>(blocks, 1), 0);
    for (uint32_t b = 0; b < blocks; ++b) {
      uint64_t start = uint64_t{b} * kReadBlockBytes;
      plan.tasks.push_back({i, t.file, t.offset + start, offset + start, std::min(kReadBlockBytes, t.nbytes - start), b});
    }
    if (blocks == 0) plan.block_hashes[i][0] = XXH3_64bits(nullptr, 0);
    offset += t.nbytes;
  }
  plan.segment_bytes = offset;
  return plan;
}

// Shared state of one parallel read; workers take tasks by atomic index.
class ReadJob {
 public:
  ReadJob(const Catalog& catalog, Plan& plan, char* base, std::vector<std::unique_ptr<RandomAccessFile>>& files)
      : catalog_(catalog), plan_(plan), base_(base), files_(files), file_remaining_(catalog.files.size()) {
    for (const ReadTask& t : plan.tasks) file_remaining_[t.file] += t.n;
    for (uint64_t r : file_remaining_) files_done_ += r == 0;
  }

  void Work() {
    for (size_t i; (i = next_.fetch_add(1)) < plan_.tasks.size();) {
      if (failed_.load()) return;
      const ReadTask& task = plan_.tasks[i];
      absl::Status read = files_[task.file]->ReadAt(task.src, task.n, base_ + task.dst);
      if (!read.ok()) return Fail(read, task);
      plan_.block_hashes[task.tensor][task.block] = XXH3_64bits(base_ + task.dst, task.n);
      bytes_done_.fetch_add(task.n);
      if (file_remaining_[task.file].fetch_sub(task.n) == task.n) files_done_.fetch_add(1);
    }
  }

  // Blocks until every worker returned; reports progress meanwhile.
  absl::Status Run(int threads, const std::function<void(uint64_t, uint32_t)>& report) {
    std::vector<std::thread> workers;
    for (int i = 0; i < threads; ++i) {
      workers.emplace_back([this] {
        Work();
        std::lock_guard<std::mutex> lock(mu_);
        ++finished_;
        cv_.notify_all();
      });
    }
    std::unique_lock<std::mutex> lock(mu_);
    while (finished_ < threads) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      lock.unlock();
      report(bytes_done_.load(), files_done_.load());
      lock.lock();
    }
    lock.unlock();
    for (std::thread& w : workers) w.join();
    return error_;
  }

 private:
  void Fail(const absl::Status& status, const ReadTask& task) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.exchange(true)) {
      error_ = Annotate(status, absl::StrCat(catalog_.files[task.file].name, ": tensor '",
                                             catalog_.tensors[task.tensor].name, "'"));
    }
  }

  const Catalog& catalog_;
  Plan& plan_;
  char* base_;
  std::vector<std::unique_ptr<RandomAccessFile>>& files_;
  std::vector<std::atomic<uint64_t>> file_remaining_;
  std::atomic<size_t> next_{0};
  std::atomic<uint64_t> bytes_done_{0};
  std::atomic<uint32_t> files_done_{0};
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int finished_ = 0;
  absl::Status error_;
};

uint64_t CombineBlockHashes(const std::vector<uint64_t>& blocks) {
  if (blocks.size() == 1) return blocks[0];
  std::vector<unsigned char> bytes(blocks.size() * 8);
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (int b = 0; b < 8; ++b) bytes[i * 8 + b] = static_cast<unsigned char>(blocks[i] >> (8 * b));
  }
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string Fingerprint(const std::vector<TensorRecord>& tensors) {
  std::vector<const TensorRecord*> sorted;
  for (const TensorRecord& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  for (const TensorRecord* t : sorted) {
    std::string line = absl::StrCat(t->name, std::string(1, '\0'), DTypeName(t->dtype), std::string(1, '\0'));
    for (size_t i = 0; i < t->full_shape.size(); ++i) absl::StrAppend(&line, i ? "," : "", t->full_shape[i]);
    absl::StrAppend(&line, std::string(1, '\0'), absl::StrFormat("%016x", t->content_hash), "\n");
    XXH3_128bits_update(state, line.data(), line.size());
  }
  XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

}  // namespace

uint64_t TensorContentHash(const char* data, uint64_t n) {
  std::vector<uint64_t> blocks;
  for (uint64_t start = 0; start < n; start += kHashBlockBytes) {
    blocks.push_back(XXH3_64bits(data + start, std::min(kHashBlockBytes, n - start)));
  }
  if (blocks.empty()) blocks.push_back(XXH3_64bits(nullptr, 0));
  return CombineBlockHashes(blocks);
}

absl::StatusOr<std::unique_ptr<ModelGeneration>> LoadGeneration(const Catalog& catalog, const LoadRequest& request,
                                                                 const LoaderOptions& options,
                                                                 const ProgressFn& progress) {
  auto start = std::chrono::steady_clock::now();
  LoadProgress p;
  p.files_total = static_cast<uint32_t>(catalog.files.size());
  p.bytes_total = catalog.total_bytes();
  auto report = [&](LoadProgress::Phase phase) {
    p.phase = phase;
    p.seconds = SecondsSince(start);
    if (progress) progress(p);
  };
  WEIGHTD_RETURN_IF_ERROR(CheckRequestSupported(request));
  report(LoadProgress::Phase::kPlan);
  Plan plan = MakeHostPlan(catalog);

  report(LoadProgress::Phase::kAllocate);
  auto gen = std::make_unique<ModelGeneration>();
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<HostSegment> segment,
                           HostSegment::Create(absl::StrCat(request.name, ":host"), plan.segment_bytes));
  std::vector<std::unique_ptr<RandomAccessFile>> files;
  for (const CatalogFile& f : catalog.files) {
    WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, Env::Default()->OpenForRead(f.path));
    if (file->size() != f.size) {
      return absl::FailedPreconditionError(absl::StrCat(f.name, ": file changed size while loading (", f.size, " -> ",
                                                        file->size(), " bytes)"));
    }
    gen->files.push_back({f.name, f.size, file->mtime_ns()});
    files.push_back(std::move(file));
  }

  report(LoadProgress::Phase::kRead);
  int threads = options.threads > 0 ? options.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<size_t>(threads, std::max<size_t>(plan.tasks.size(), 1)));
  ReadJob job(catalog, plan, segment->writable(), files);
  WEIGHTD_RETURN_IF_ERROR(job.Run(threads, [&](uint64_t bytes, uint32_t files_done) {
    p.bytes_done = bytes;
    p.files_done = files_done;
    report(LoadProgress::Phase::kRead);
  }));

  report(LoadProgress::Phase::kSeal);
  for (size_t i = 0; i < plan.tensors.size(); ++i) plan.tensors[i].content_hash = CombineBlockHashes(plan.block_hashes[i]);
  WEIGHTD_RETURN_IF_ERROR(segment->Seal(options.mlock));
  gen->request = request;
  gen->fingerprint = Fingerprint(plan.tensors);
  gen->tensor_count = plan.tensors.size();
  gen->host_bytes = segment->size();
  gen->locked_bytes = segment->locked() ? segment->size() : 0;
  gen->segments.push_back({Placement::kHost, segment->size(), "memfd", "", segment->fd()});
  gen->host_segments.push_back(std::move(segment));
  RankManifest rank;
  rank.segments = {0};
  rank.tensors = std::move(plan.tensors);
  gen->ranks.push_back(std::move(rank));
  gen->load_seconds = SecondsSince(start);
  return gen;
}

}  // namespace weightd
