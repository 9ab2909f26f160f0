// A RegistryListener that records what it is told, for registry tests.
#ifndef WEIGHTD_TESTS_TESTING_RECORDING_REGISTRY_LISTENER_H_
#define WEIGHTD_TESTS_TESTING_RECORDING_REGISTRY_LISTENER_H_

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "server/registry/registry.h"

namespace weightd::testing {

// Thread-safe; the registry calls it with its lock held, so it only records.
class RecordingRegistryListener : public RegistryListener {
 public:
  void OnModelServing(const std::string& name, bool serving) override {
    std::lock_guard<std::mutex> lock(mu_);
    serving_.emplace_back(name, serving);
  }
  void OnLoadFailed(const LoadRequest&, const absl::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    failures_.push_back(status);
  }
  void OnLeasesChanged(const std::string& name, int active) override {
    std::lock_guard<std::mutex> lock(mu_);
    leases_.emplace_back(name, active);
  }

  void OnUpdateAborted(const std::string& name, const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    aborts_.emplace_back(name, reason);
  }
  // (name, reason) of every aborted update, in call order.
  std::vector<std::pair<std::string, std::string>> aborts() const {
    std::lock_guard<std::mutex> lock(mu_);
    return aborts_;
  }

  // (name, serving) in call order.
  std::vector<std::pair<std::string, bool>> serving() const {
    std::lock_guard<std::mutex> lock(mu_);
    return serving_;
  }
  std::vector<absl::Status> failures() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }
  // (name, active lease count) in call order.
  std::vector<std::pair<std::string, int>> leases() const {
    std::lock_guard<std::mutex> lock(mu_);
    return leases_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, bool>> serving_;
  std::vector<absl::Status> failures_;
  std::vector<std::pair<std::string, int>> leases_;
  std::vector<std::pair<std::string, std::string>> aborts_;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_RECORDING_REGISTRY_LISTENER_H_
