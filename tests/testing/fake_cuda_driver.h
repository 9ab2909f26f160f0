// The registrations of the fake CUDA driver (tests/gpu/fake_libcuda.cc),
// for tests that pin host memory through it.
#ifndef WEIGHTD_TESTS_TESTING_FAKE_CUDA_DRIVER_H_
#define WEIGHTD_TESTS_TESTING_FAKE_CUDA_DRIVER_H_

#include <dlfcn.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace weightd::testing {

// A host range the fake driver holds registered: (base address, bytes,
// cuMemHostRegister flags).
using FakeCudaRegistration = std::tuple<uintptr_t, uint64_t, unsigned>;

class FakeCudaDriver {
 public:
  // Loads the fake library at `path` RTLD_GLOBAL (so the driver loader finds
  // the same copy) and its listing hook; "" when it did, else why not.
  std::string Open(const char* path) {
    void* library = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (library == nullptr) return dlerror();
    list_ = reinterpret_cast<int (*)(uintptr_t*, uint64_t*, unsigned*, int)>(
        dlsym(library, "weightd_fake_cuda_host_registrations"));
    return list_ != nullptr ? "" : "no weightd_fake_cuda_host_registrations in the fake library";
  }
  // What the fake driver holds registered now, at most 16 ranges.
  std::vector<FakeCudaRegistration> Registrations() const {
    uintptr_t bases[16];
    uint64_t sizes[16];
    unsigned flags[16];
    int n = list_(bases, sizes, flags, 16);
    std::vector<FakeCudaRegistration> out;
    for (int i = 0; i < n && i < 16; ++i) out.emplace_back(bases[i], sizes[i], flags[i]);
    return out;
  }

 private:
  int (*list_)(uintptr_t*, uint64_t*, unsigned*, int) = nullptr;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FAKE_CUDA_DRIVER_H_
