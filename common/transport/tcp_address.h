// "HOST:PORT" addresses of the daemon's TCP listeners: IPv4, "[IPv6]", or a
// name; "" or "0.0.0.0" as host means every address (AI_PASSIVE).
#ifndef WEIGHTD_COMMON_TRANSPORT_TCP_ADDRESS_H_
#define WEIGHTD_COMMON_TRANSPORT_TCP_ADDRESS_H_

#include <netdb.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace weightd {

using AddrInfoPtr = std::unique_ptr<addrinfo, decltype(&freeaddrinfo)>;

// getaddrinfo(3) of `address` for a SOCK_STREAM socket, with `flags`
// (AI_PASSIVE to listen, AI_NUMERICHOST to connect without DNS) plus
// AI_NUMERICSERV: the port must be a number. INVALID_ARGUMENT naming the
// address when it has no port or does not resolve. Thread-safe.
absl::StatusOr<AddrInfoPtr> ResolveTcpAddress(const std::string& address, int flags);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_TRANSPORT_TCP_ADDRESS_H_
