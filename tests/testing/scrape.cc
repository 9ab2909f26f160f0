#include "tests/testing/scrape.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/transport/unix_socket.h"

namespace weightd::testing {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

}  // namespace

ScopedFd ConnectLoopback(int port) {
  ScopedFd sock(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr = Loopback(port);
  if (!sock.valid() || connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return ScopedFd();
  return sock;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  ScopedFd sock(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) return ErrnoToStatus("socket", errno);
  timeval timeout{10, 0};
  setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr = Loopback(port);
  if (connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect 127.0.0.1:", port, ": ", strerror(errno)));
  }
  // HTTP/1.0: the server closes after the body, and never chunks it.
  std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (write(sock.get(), request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    return ErrnoToStatus("write", errno);
  }
  std::string response;
  char buf[65536];
  for (ssize_t n; (n = read(sock.get(), buf, sizeof(buf))) != 0;) {
    if (n < 0) return ErrnoToStatus(absl::StrCat("read from 127.0.0.1:", port), errno);
    response.append(buf, static_cast<size_t>(n));
  }
  size_t end = response.find("\r\n\r\n");
  if (end == std::string::npos) return absl::DataLossError(absl::StrCat("no HTTP header in '", response, "'"));
  std::string status_line = response.substr(0, response.find("\r\n"));
  if (!absl::StrContains(status_line, " 200 ")) {
    return absl::FailedPreconditionError(absl::StrCat("GET ", path, ": ", status_line));
  }
  return response.substr(end + 4);
}

int PickFreePort() {
  ScopedFd sock(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr = Loopback(0);
  socklen_t len = sizeof(addr);
  if (bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(sock.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return 0;
  }
  return ntohs(addr.sin_port);
}

std::optional<double> SampleValue(const std::string& exposition, const std::string& series) {
  std::string prefix = "\n" + series + " ";
  size_t at = ("\n" + exposition).find(prefix);
  if (at == std::string::npos) return std::nullopt;
  size_t begin = at + prefix.size() - 1;  // in `exposition`, which lacks the leading "\n"
  double value;
  if (!absl::SimpleAtod(exposition.substr(begin, exposition.find('\n', begin) - begin), &value)) return std::nullopt;
  return value;
}

}  // namespace weightd::testing
