// Small helpers shared by the benchmark subcommands: a monotonic clock,
// percentiles, flag parsing, checkpoint file lists, and the JSON line each
// subcommand prints for tests/bench/bench.py to read.
#ifndef WEIGHTD_TESTS_BENCH_BENCH_UTIL_H_
#define WEIGHTD_TESTS_BENCH_BENCH_UTIL_H_

#include <map>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace weightd::bench {

// Seconds on the monotonic clock.
double Now();

// n, p50, p90, p99, min and max of `samples` (nearest rank), in the samples' unit.
nlohmann::json Summarize(std::vector<double> samples);

// "--key value" pairs, plus bare positional words.
class Flags {
 public:
  Flags(int argc, char** argv);  // argv[0] is the subcommand
  std::string Get(const std::string& key, const std::string& fallback = "") const;
  long GetInt(const std::string& key, long fallback) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// The .safetensors files of a checkpoint folder (sorted), or the file itself.
std::vector<std::string> CheckpointFiles(const std::string& path);
uint64_t FileSize(const std::string& path);

// Prints one JSON document on stdout and flushes.
void Emit(const nlohmann::json& result);
// Prints a message on stderr and returns 1 (for `return Fail(...)`).
int Fail(const std::string& message);

}  // namespace weightd::bench

#endif  // WEIGHTD_TESTS_BENCH_BENCH_UTIL_H_
