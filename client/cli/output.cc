#include "client/cli/output.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ostream>

#include "absl/strings/str_format.h"

namespace weightd::cli {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int ReportError(const absl::Status& status, std::ostream& err) {
  err << "weightctl: " << status.message() << "\n";
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kResourceExhausted:
      return kExitBadInput;
    default:
      return kExitFailure;
  }
}

std::string HumanBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) value /= 1024, ++unit;
  return unit == 0 ? absl::StrFormat("%d B", bytes) : absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

ProgressBar::ProgressBar(std::string label, bool enabled)
    : label_(std::move(label)), enabled_(enabled && isatty(STDERR_FILENO)), start_(Now()) {}

ProgressBar::~ProgressBar() { Finish(); }

void ProgressBar::Update(uint64_t done, uint64_t total) {
  if (!enabled_) return;
  double now = Now();
  if (now - last_draw_ < 0.1 && done < total) return;
  last_draw_ = now;
  double elapsed = now - start_;
  double fraction = total == 0 ? 1.0 : static_cast<double>(done) / static_cast<double>(total);
  double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
  double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0;
  int filled = static_cast<int>(fraction * 30);
  std::string bar(filled, '#');
  bar.append(30 - filled, '.');
  std::fprintf(stderr, "\r%s [%s] %5.1f%%  %s / %s  %.2f GB/s  ETA %.0fs ", label_.c_str(), bar.c_str(),
               fraction * 100, HumanBytes(done).c_str(), HumanBytes(total).c_str(), rate / 1e9, eta);
  drawn_ = true;
}

void ProgressBar::Finish() {
  if (drawn_) std::fprintf(stderr, "\n");
  drawn_ = false;
}

}  // namespace weightd::cli
