// The fixture shared by the registry tests: a temporary model root, a
// registry over it with a recording listener and a fake clock, and
// generated checkpoints.
#ifndef WEIGHTD_TESTS_SERVER_REGISTRY_FIXTURE_H_
#define WEIGHTD_TESTS_SERVER_REGISTRY_FIXTURE_H_

#include <sys/stat.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/registry/registry.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/recording_registry_listener.h"
#include "tests/testing/shared_inputs.h"

namespace weightd::registry_test {

using ::weightd::testing::FakeClock;
using ::weightd::testing::RecordingRegistryListener;
using ::weightd::testing::SafetensorsBuilder;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;

struct Tensor {
  std::string name, dtype;
  std::vector<uint64_t> shape;
  std::string data;
};

// Three tensors of 16, 3 and 8 bytes whose bytes derive from `seed`.
inline std::vector<Tensor> Tensors(char seed) {
  auto bytes = [&](size_t n, int salt) {
    std::string s(n, '\0');
    for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + salt * 17 + i * 3);
    return s;
  };
  return {{"a.weight", "F32", {2, 2}, bytes(16, 1)}, {"b.bias", "U8", {3}, bytes(3, 2)},
          {"c.scale", "F16", {4}, bytes(8, 3)}};
}

inline void WriteCheckpoint(const std::string& path, const std::vector<Tensor>& tensors) {
  SafetensorsBuilder builder;
  for (const Tensor& t : tensors) builder.Add(t.name, t.dtype, t.shape, t.data);
  WriteFile(path, builder.Build());
}

inline std::string MakeDir(const std::string& path) {
  mkdir(path.c_str(), 0755);
  return path;
}

inline std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? buf : "";
}

class RegistryTest : public ::testing::Test {
 protected:
  RegistryOptions Options(std::chrono::milliseconds claim_timeout = std::chrono::seconds(10)) {
    RegistryOptions options;
    options.model_roots = {root_.path()};
    options.loader.threads = 2;
    options.loader.mlock = false;
    options.claim_timeout = claim_timeout;
    options.clock = clock_.AsFunction();
    return options;
  }
  absl::StatusOr<ModelRegistry::LoadResult> Load(const std::string& name, const std::string& path,
                                                 ModelRegistry* registry = nullptr) {
    LoadRequest request;
    request.name = name;
    request.checkpoint_path = path;
    return (registry ? registry : &registry_)->Load(request, nullptr);
  }
  // root/<name>/model.safetensors from Tensors(seed).
  std::string Checkpoint(const std::string& name, char seed) {
    WriteCheckpoint(MakeDir(root_.Join(name)) + "/model.safetensors", Tensors(seed));
    return name;
  }

  TempDir root_;
  FakeClock clock_;
  RecordingRegistryListener listener_;
  ModelRegistry registry_{Options(), &listener_};
};

}  // namespace weightd::registry_test

#endif  // WEIGHTD_TESTS_SERVER_REGISTRY_FIXTURE_H_
