// A steady clock that moves only when a test says so, for RegistryOptions::clock.
#ifndef WEIGHTD_TESTS_TESTING_FAKE_CLOCK_H_
#define WEIGHTD_TESTS_TESTING_FAKE_CLOCK_H_

#include <atomic>
#include <chrono>
#include <functional>

namespace weightd::testing {

// Thread-safe. Starts at an arbitrary fixed time point.
class FakeClock {
 public:
  using time_point = std::chrono::steady_clock::time_point;

  time_point Now() const { return time_point(std::chrono::nanoseconds(ns_.load())); }
  void Advance(std::chrono::nanoseconds d) { ns_ += d.count(); }
  // Now() as a callable; the clock must outlive it.
  std::function<time_point()> AsFunction() const {
    return [this] { return Now(); };
  }

 private:
  std::atomic<int64_t> ns_{int64_t{1'000'000'000}};
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FAKE_CLOCK_H_
