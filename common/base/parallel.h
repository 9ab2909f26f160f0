// Running one function over an index range on several threads, for
// memory-bound work over large segments (copies, content hashes).
#ifndef WEIGHTD_COMMON_BASE_PARALLEL_H_
#define WEIGHTD_COMMON_BASE_PARALLEL_H_

#include <cstddef>
#include <functional>

#include "absl/status/status.h"

namespace weightd {

// Runs fn(i) for every i in [0, n) on up to one thread per core, and at most
// `max_threads` when it is not 0; the calling thread waits for all of them.
// After an error no new index is started; returns one of the errors (the
// first each thread met), or OK. `fn` must be safe to call from several
// threads at once.
absl::Status ParallelFor(size_t n, const std::function<absl::Status(size_t)>& fn, size_t max_threads = 0);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_BASE_PARALLEL_H_
