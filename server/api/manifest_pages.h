// GetManifest's pages: how many tensors, and how many encoded bytes, one
// page may hold. The limits bound the memory one call can make the daemon
// allocate at a time, whatever page_size a client asks for (docs/api.md
// "GetManifest paging"). Plain functions: testable without a server.
#ifndef WEIGHTD_SERVER_API_MANIFEST_PAGES_H_
#define WEIGHTD_SERVER_API_MANIFEST_PAGES_H_

#include <cstddef>
#include <cstdint>

#include "server/model/model.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

// A page in flight costs the daemon about three times its encoded size
// (the message's objects, then its encoding); 24 concurrent calls held
// 217 MB with pages of 16384 tensors and 52 MB with 4096, measured by
// tests/e2e/limits_e2e_test.cc. Larger pages save nothing worth that.
inline constexpr uint32_t kDefaultManifestPageTensors = 4096;
inline constexpr uint32_t kMaxManifestPageTensors = 4096;
inline constexpr size_t kMaxManifestPageBytes = 1 << 20;  // encoded ManifestPage, segments included

// The tensors per page a request gets: 0 means the default, and a larger
// request is clamped to kMaxManifestPageTensors (not refused: the caller
// still receives every tensor, in more pages).
uint32_t ManifestPageTensors(uint32_t requested);

// Fills page `first` on of rank `rank` of `m` (the caller has range-checked
// the rank): the page's header fields, the segments when `first` is 0, then
// tensors from index `first` while the page holds fewer than `max_tensors`
// and its encoded size stays within kMaxManifestPageBytes. A tensor whose
// entry alone exceeds that goes alone on its page, so every page makes
// progress. Returns the index after the last tensor placed.
size_t FillManifestPage(const ModelGeneration& m, uint32_t rank, size_t first, uint32_t max_tensors,
                        v1::ManifestPage* page);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_API_MANIFEST_PAGES_H_
