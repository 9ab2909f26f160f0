#include "server/model/layout.h"

#include <xxhash.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "common/format/content_hash.h"

namespace weightd {

std::shared_ptr<LayoutSet> MakeLayoutSet() { return std::make_shared<LayoutSet>(); }

std::string LayoutFingerprint(const std::vector<LayoutTensor>& tensors) {
  std::vector<const LayoutTensor*> order;
  order.reserve(tensors.size());
  for (const LayoutTensor& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(),
            [](const LayoutTensor* a, const LayoutTensor* b) { return a->record.name < b->record.name; });
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  for (const LayoutTensor* t : order) {
    const TensorRecord& r = t->record;
    std::string line = absl::StrCat(r.name, std::string(1, '\0'), DTypeName(r.dtype), std::string(1, '\0'),
                                    absl::StrJoin(r.shape, ","), std::string(1, '\0'), absl::StrJoin(t->strides, ","),
                                    std::string(1, '\0'), r.placement == Placement::kHost ? "host" : "device",
                                    std::string(1, '\0'), ContentHashHex(r.content_hash), "\n");
    XXH3_128bits_update(state, line.data(), line.size());
  }
  XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

bool LayoutSet::Add(std::shared_ptr<const Layout> layout) {
  absl::MutexLock lock(&mu_);
  return layouts_.emplace(std::make_pair(layout->key, layout->rank), std::move(layout)).second;
}

std::shared_ptr<const Layout> LayoutSet::Find(const std::string& key, uint32_t rank) const {
  absl::MutexLock lock(&mu_);
  auto it = layouts_.find({key, rank});
  return it == layouts_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<const Layout>> LayoutSet::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const Layout>> out;
  for (const auto& [slot, layout] : layouts_) out.push_back(layout);
  return out;
}

std::vector<std::string> LayoutSet::KeysOf(uint32_t rank) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> keys;
  for (const auto& [slot, layout] : layouts_) {
    if (slot.second == rank) keys.push_back(slot.first);
  }
  return keys;
}

std::vector<std::shared_ptr<const Layout>> LayoutSet::Remove(const std::string& key, std::optional<uint32_t> rank) {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const Layout>> removed;
  for (auto it = layouts_.begin(); it != layouts_.end();) {
    if (it->first.first == key && (!rank.has_value() || it->first.second == *rank)) {
      removed.push_back(std::move(it->second));
      it = layouts_.erase(it);
    } else {
      ++it;
    }
  }
  return removed;
}

std::vector<std::shared_ptr<const Layout>> LayoutSet::Clear() {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const Layout>> removed;
  for (auto& [slot, layout] : layouts_) removed.push_back(std::move(layout));
  layouts_.clear();
  return removed;
}

uint64_t LayoutSet::HostBytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (const auto& [slot, layout] : layouts_) bytes += layout->host_bytes;
  return bytes;
}

std::map<std::string, uint64_t> LayoutSet::DeviceBytes() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, uint64_t> bytes;
  for (const auto& [slot, layout] : layouts_) {
    if (layout->device_bytes > 0) bytes[layout->gpu_uuid] += layout->device_bytes;
  }
  return bytes;
}

std::string IdentityDifference(const LayoutIdentity& published, const LayoutIdentity& asked) {
  if (asked.empty()) return "";
  std::map<std::string, std::pair<const std::string*, const std::string*>> fields;  // key -> (published, asked)
  for (const auto& [k, v] : published) fields[k].first = &v;
  for (const auto& [k, v] : asked) fields[k].second = &v;
  std::vector<std::string> clauses;
  for (const auto& [k, pair] : fields) {
    const auto& [was, here] = pair;
    if (was != nullptr && here != nullptr && *was == *here) continue;
    if (was == nullptr) {
      clauses.push_back(absl::StrCat(ElideName(k), " is ", QuoteName(*here), " here but missing from the published layout"));
    } else if (here == nullptr) {
      clauses.push_back(absl::StrCat(ElideName(k), " is missing here (", QuoteName(*was), " in the published layout)"));
    } else {
      clauses.push_back(
          absl::StrCat(ElideName(k), " is ", QuoteName(*here), " here but ", QuoteName(*was), " in the published layout"));
    }
  }
  return absl::StrJoin(clauses, "; ");
}

}  // namespace weightd
