#include "tests/bench/bench_util.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>

namespace weightd::bench {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

nlohmann::json Summarize(std::vector<double> samples) {
  if (samples.empty()) return {{"n", 0}};
  std::sort(samples.begin(), samples.end());
  auto rank = [&](double p) {
    size_t i = static_cast<size_t>(std::ceil(p * static_cast<double>(samples.size()))) - 1;
    return samples[std::min(i, samples.size() - 1)];
  };
  return {{"n", samples.size()}, {"p50", rank(0.50)}, {"p90", rank(0.90)}, {"p99", rank(0.99)}, {"min", samples.front()},
          {"max", samples.back()}};
}

Flags::Flags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) == 0 && i + 1 < argc) {
      values_[arg.substr(2)] = argv[++i];
    } else {
      positional_.push_back(arg);
    }
  }
}

std::string Flags::Get(const std::string& key, const std::string& fallback) const {
  auto it = values_.find(key);
  return it == values_.end() ? fallback : it->second;
}

long Flags::GetInt(const std::string& key, long fallback) const {
  auto it = values_.find(key);
  return it == values_.end() ? fallback : std::atol(it->second.c_str());
}

std::vector<std::string> CheckpointFiles(const std::string& path) {
  if (!std::filesystem::is_directory(path)) return {path};
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(path)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

uint64_t FileSize(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

void Emit(const nlohmann::json& result) {
  std::cout << result.dump() << std::endl;
}

int Fail(const std::string& message) {
  std::cerr << "weightd_bench: " << message << std::endl;
  return 1;
}

}  // namespace weightd::bench
