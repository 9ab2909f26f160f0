#include "common/transport/tcp_address.h"

#include "absl/strings/str_cat.h"

namespace weightd {

absl::StatusOr<AddrInfoPtr> ResolveTcpAddress(const std::string& address, int flags) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos) return absl::InvalidArgumentError(absl::StrCat(address, ": no port"));
  std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_flags = flags | AI_NUMERICSERV;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* info = nullptr;
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &info); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(address, ": ", gai_strerror(rc)));
  }
  return AddrInfoPtr(info, &freeaddrinfo);
}

}  // namespace weightd
