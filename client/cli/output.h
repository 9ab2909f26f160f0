// Output conventions shared by weightctl commands (DESIGN.md "Command line"):
// exit 0 on success, 2 for bad input or a refused request, 1 otherwise, with
// one line on stderr; progress only on a terminal.
#ifndef WEIGHTD_CLIENT_CLI_OUTPUT_H_
#define WEIGHTD_CLIENT_CLI_OUTPUT_H_

#include <cstdint>
#include <iosfwd>
#include <string>

#include "absl/status/status.h"

namespace weightd::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;

// Prints "weightctl: <message>" to `err` and returns the exit code for `status`.
int ReportError(const absl::Status& status, std::ostream& err);
// "1.50 GiB", "512 B".
std::string HumanBytes(uint64_t bytes);

// A one-line progress bar redrawn in place on stderr; silent unless stderr is
// a terminal and `enabled`. Not thread-safe.
class ProgressBar {
 public:
  ProgressBar(std::string label, bool enabled);
  ~ProgressBar();
  void Update(uint64_t done, uint64_t total);
  void Finish();

 private:
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  double start_;
  double last_draw_ = 0;
};

}  // namespace weightd::cli

#endif  // WEIGHTD_CLIENT_CLI_OUTPUT_H_
