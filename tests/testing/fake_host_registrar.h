// A HostRegistrar for tests (common/memory/host_registrar.h) that records
// every call, refuses overlapping ranges as cuMemHostRegister does, and can
// hold a registration until the test releases it or fail one.
//
// The registrar a HostPinner owns writes into a FakeRegistry the test keeps:
//   auto registry = std::make_shared<FakeRegistry>();
//   HostPinner::Start(input, registry->Factory());
// Device addresses are host address + kFakeDeviceOffset, so a test can tell
// them from host addresses.
#ifndef WEIGHTD_TESTS_TESTING_FAKE_HOST_REGISTRAR_H_
#define WEIGHTD_TESTS_TESTING_FAKE_HOST_REGISTRAR_H_

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/memory/host_pinner.h"
#include "common/memory/host_registrar.h"

namespace weightd::testing {

inline constexpr uint64_t kFakeDeviceOffset = uint64_t{1} << 44;

struct RegistrarCall {
  enum Kind { kRegister, kUnregister } kind;
  uintptr_t base = 0;
  uint64_t bytes = 0;        // kRegister
  bool read_only = false;    // kRegister
  std::thread::id thread;
};

class FakeRegistry : public std::enable_shared_from_this<FakeRegistry> {
 public:
  // Knobs; set before Start.
  bool read_only_supported = true;
  int ordinal = 0;
  absl::Status factory_error;  // returned by the factory instead of a registrar

  // Registration number `n` (0-based) waits in Register until Release().
  void HoldAt(size_t n) {
    absl::MutexLock lock(&mu_);
    hold_at_ = n;
  }
  // Waits (up to 10 s) until a registration is held; whether one is.
  bool WaitHeld() {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&held_), absl::Seconds(10));
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    hold_at_ = SIZE_MAX;
  }
  // Registration number `n` fails with `error` (nothing registered).
  void FailAt(size_t n, absl::Status error) {
    absl::MutexLock lock(&mu_);
    fail_at_ = n;
    fail_with_ = std::move(error);
  }

  std::vector<RegistrarCall> calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  // Registered ranges now: base -> bytes.
  std::map<uintptr_t, uint64_t> registered() {
    absl::MutexLock lock(&mu_);
    return registered_;
  }

  HostPinner::RegistrarFactory Factory();

  // Called by FakeHostRegistrar.
  absl::StatusOr<uint64_t> Register(const void* base, uint64_t bytes, bool read_only) {
    absl::MutexLock lock(&mu_);
    uintptr_t p = reinterpret_cast<uintptr_t>(base);
    calls_.push_back({RegistrarCall::kRegister, p, bytes, read_only, std::this_thread::get_id()});
    size_t n = registrations_++;
    if (n == hold_at_) {
      held_ = true;
      auto released = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return hold_at_ != n; };
      mu_.Await(absl::Condition(&released));
      held_ = false;
    }
    if (n == fail_at_) return fail_with_;
    if (p % 4096 != 0 || bytes % 4096 != 0 || bytes == 0) return absl::InvalidArgumentError("unaligned range");
    auto next = registered_.lower_bound(p);
    bool overlaps = (next != registered_.end() && next->first < p + bytes) ||
                    (next != registered_.begin() && std::prev(next)->first + std::prev(next)->second > p);
    if (overlaps) return absl::InternalError("CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED");
    registered_[p] = bytes;
    return p + kFakeDeviceOffset;
  }
  absl::Status Unregister(const void* base) {
    absl::MutexLock lock(&mu_);
    uintptr_t p = reinterpret_cast<uintptr_t>(base);
    calls_.push_back({RegistrarCall::kUnregister, p, 0, false, std::this_thread::get_id()});
    if (registered_.erase(p) == 0) return absl::InvalidArgumentError("CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED");
    return absl::OkStatus();
  }

 private:
  absl::Mutex mu_;
  std::vector<RegistrarCall> calls_ ABSL_GUARDED_BY(mu_);
  std::map<uintptr_t, uint64_t> registered_ ABSL_GUARDED_BY(mu_);
  size_t registrations_ ABSL_GUARDED_BY(mu_) = 0;
  size_t hold_at_ ABSL_GUARDED_BY(mu_) = SIZE_MAX;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  size_t fail_at_ ABSL_GUARDED_BY(mu_) = SIZE_MAX;
  absl::Status fail_with_ ABSL_GUARDED_BY(mu_);
};

class FakeHostRegistrar final : public HostRegistrar {
 public:
  explicit FakeHostRegistrar(std::shared_ptr<FakeRegistry> registry) : registry_(std::move(registry)) {}
  bool read_only_supported() const override { return registry_->read_only_supported; }
  int device_ordinal() const override { return registry_->ordinal; }
  absl::StatusOr<uint64_t> Register(const void* base, uint64_t bytes, bool read_only) override {
    return registry_->Register(base, bytes, read_only);
  }
  absl::Status Unregister(const void* base) override { return registry_->Unregister(base); }

 private:
  std::shared_ptr<FakeRegistry> registry_;
};

inline HostPinner::RegistrarFactory FakeRegistry::Factory() {
  std::shared_ptr<FakeRegistry> self = shared_from_this();
  return [self]() -> absl::StatusOr<std::unique_ptr<HostRegistrar>> {
    if (!self->factory_error.ok()) return self->factory_error;
    return std::unique_ptr<HostRegistrar>(new FakeHostRegistrar(self));
  };
}

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FAKE_HOST_REGISTRAR_H_
