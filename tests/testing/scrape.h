// Scraping for metrics tests: a minimal HTTP/1.0 client (so tests need
// neither curl nor libcurl) and a reader of the Prometheus text format.
#ifndef WEIGHTD_TESTS_TESTING_SCRAPE_H_
#define WEIGHTD_TESTS_TESTING_SCRAPE_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/scoped_fd.h"

namespace weightd::testing {

// GET http://127.0.0.1:<port><path>: the body of a 200 response;
// UNAVAILABLE when nothing listens, FAILED_PRECONDITION for another status.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// A TCP connection to 127.0.0.1:<port>; an invalid ScopedFd when refused.
ScopedFd ConnectLoopback(int port);

// A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, close),
// for servers such as Prometheus that cannot report the port they chose.
int PickFreePort();

// The value of one series in a text exposition, written exactly as it
// appears there ('weightd_models{state="READY"}'); nullopt when absent.
std::optional<double> SampleValue(const std::string& exposition, const std::string& series);

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_SCRAPE_H_
