#include "common/base/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "common/base/status.h"

namespace weightd {

absl::Status ParallelFor(size_t n, const std::function<absl::Status(size_t)>& fn, size_t max_threads) {
  size_t threads = std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (max_threads != 0) threads = std::min(threads, max_threads);
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) WEIGHTD_RETURN_IF_ERROR(fn(i));
    return absl::OkStatus();
  }
  std::atomic<size_t> next{0};
  std::vector<absl::Status> errors(threads);
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t i; (i = next.fetch_add(1)) < n;) {
        absl::Status status = fn(i);
        if (!status.ok()) {
          errors[t] = status;
          next = n;
        }
      }
    });
  }
  for (std::thread& th : pool) th.join();
  for (const absl::Status& e : errors) WEIGHTD_RETURN_IF_ERROR(e);
  return absl::OkStatus();
}

}  // namespace weightd
