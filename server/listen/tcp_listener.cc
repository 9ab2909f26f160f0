#include "server/listen/tcp_listener.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/io/env.h"
#include "common/base/status.h"
#include "common/transport/tcp_address.h"
#include "server/listen/grpc_limits.h"
#include "server/listen/rpc_metrics.h"

namespace weightd {
namespace {

std::string Mode(const TcpListenerOptions& o) {
  std::string transport = o.tls_cert.empty() ? "plain TCP" : o.tls_client_ca.empty() ? "TLS" : "mutual TLS";
  return absl::StrCat(transport, o.admin ? ", admin" : ", read-only");
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerTlsCredentials(const ServerTlsFiles& files) {
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  WEIGHTD_ASSIGN_OR_RETURN(pair.cert_chain, ReadPemFile(files.cert_flag, files.cert));
  WEIGHTD_ASSIGN_OR_RETURN(pair.private_key, ReadPemFile(files.key_flag, files.key));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!files.ca.empty()) {
    WEIGHTD_ASSIGN_OR_RETURN(options.pem_root_certs, ReadPemFile(files.ca_flag, files.ca));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<ScopedFd> AddTcpPort(const GrpcServerLimits& limits, const std::string& address,
                                    const std::string& flag, const std::shared_ptr<grpc::ServerCredentials>& tls,
                                    grpc::ServerBuilder& builder, int* port) {
  if (tls == nullptr) return ListenTcp(address, port, flag);
  builder.AddListeningPort(address, tls, port);
  RefuseSharedPort(builder);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(limits.first_bytes_timeout.count()));
  return ScopedFd();
}

absl::StatusOr<std::unique_ptr<GrpcAcceptor>> AcceptTcp(const GrpcServerLimits& limits, ScopedFd listener,
                                                        const std::string& name, grpc::Server* server) {
  if (!listener.valid()) return std::unique_ptr<GrpcAcceptor>();
  GrpcAcceptorOptions accept;
  accept.listener = std::move(listener);
  accept.name = name;
  accept.max_connections = limits.max_connections;
  accept.first_bytes_timeout = limits.first_bytes_timeout;
  return GrpcAcceptor::Start(std::move(accept), server);
}

absl::StatusOr<ScopedFd> ListenTcp(const std::string& address, int* port, const std::string& flag) {
  absl::StatusOr<AddrInfoPtr> resolved = ResolveTcpAddress(address, AI_PASSIVE);
  if (!resolved.ok()) return Annotate(resolved.status(), flag);
  const addrinfo* info = resolved->get();
  ScopedFd sock(socket(info->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int one = 1;
  if (!sock.valid() || setsockopt(sock.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(sock.get(), info->ai_addr, info->ai_addrlen) != 0 || listen(sock.get(), SOMAXCONN) != 0) {
    return ErrnoToStatus(absl::StrCat("cannot listen on ", flag, " ", address), errno);
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  getsockname(sock.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  *port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return sock;
}


TcpListener::~TcpListener() { Shutdown(); }

absl::StatusOr<std::unique_ptr<TcpListener>> TcpListener::Start(const TcpListenerOptions& options, ModelRegistry* registry,
                                                                Metrics* metrics) {
  if (options.admin && options.tls_client_ca.empty()) {
    return absl::InvalidArgumentError("--grpc-tcp-admin needs mutual TLS on --grpc-address");
  }
  // TLS with grpc_tls_cert; mutual TLS with grpc_tls_client_ca too.
  std::shared_ptr<grpc::ServerCredentials> tls;
  if (!options.tls_cert.empty()) {
    WEIGHTD_ASSIGN_OR_RETURN(tls, ServerTlsCredentials({options.tls_cert, options.tls_key,
                                                        options.tls_client_ca, "--grpc-tls-cert", "--grpc-tls-key",
                                                        "--grpc-tls-client-ca"}));
  }
  std::unique_ptr<TcpListener> tcp(new TcpListener());
  tcp->mode_ = Mode(options);
  tcp->full_ = std::make_unique<WeightdService>(registry, options.fd_socket, options.mlock, options.encodings);
  grpc::ServerBuilder builder;
  // Plain TCP is accepted by our own GrpcAcceptor (bounded, recovers after
  // EMFILE); TLS only by gRPC's listener (AddTcpPort), so the self-check
  // watches its accept queue.
  WEIGHTD_ASSIGN_OR_RETURN(ScopedFd listener,
                           AddTcpPort(options.limits, options.address, "--grpc-address", tls, builder, &tcp->port_));
  if (options.admin) {
    builder.RegisterService(tcp->full_.get());
  } else {
    tcp->read_only_ = std::make_unique<ReadOnlyWeightdService>(tcp->full_.get());
    builder.RegisterService(tcp->read_only_.get());
  }
  builder.SetMaxSendMessageSize(-1);
  ApplyGrpcLimits(options.limits, builder);
  CountRpcs(builder, metrics);
  tcp->server_ = builder.BuildAndStart();
  if (tcp->server_ == nullptr || tcp->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on --grpc-address ", options.address));
  }
  WEIGHTD_ASSIGN_OR_RETURN(tcp->acceptor_, AcceptTcp(options.limits, std::move(listener),
                                                    absl::StrCat("gRPC TCP listener ", options.address),
                                                    tcp->server_.get()));
  return tcp;
}

void TcpListener::Shutdown(std::chrono::milliseconds grace) {
  acceptor_.reset();  // no new connections
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + grace);
}

}  // namespace weightd
