// A Metrics that records every call, for tests of what the daemon reports.
#ifndef WEIGHTD_TESTS_TESTING_FAKE_METRICS_H_
#define WEIGHTD_TESTS_TESTING_FAKE_METRICS_H_

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "server/metrics/metrics.h"

namespace weightd::testing {

// Records every call; thread-safe like the real one.
class FakeMetrics final : public Metrics {
 public:
  void LoadFinished(uint64_t bytes, double seconds) override {
    std::lock_guard<std::mutex> lock(mu_);
    loads.push_back(bytes);
  }
  void LoadFailed(const absl::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    failures.push_back(CheckpointErrorReason(status));
  }
  void HostMemory(uint64_t resident_bytes, uint64_t locked_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    memory.emplace_back(resident_bytes, locked_bytes);
  }
  void AttachFinished(double seconds) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++attaches;
  }
  void RpcFinished(absl::string_view method, absl::string_view code, double seconds) override {
    std::lock_guard<std::mutex> lock(mu_);
    rpcs.emplace_back(std::string(method), std::string(code));
  }

  std::mutex mu_;
  std::vector<uint64_t> loads;
  std::vector<std::string> failures;
  std::vector<std::pair<uint64_t, uint64_t>> memory;
  int attaches = 0;
  std::vector<std::pair<std::string, std::string>> rpcs;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FAKE_METRICS_H_
