#include "server/tcp_listener.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/io/env.h"
#include "common/base/status.h"
#include "server/grpc_limits.h"
#include "server/rpc_metrics.h"

namespace weightd {
namespace {

constexpr uint64_t kMaxPemBytes = 1 << 20;

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadSmallFile(*Env::Default(), path, kMaxPemBytes);
  if (!pem.ok()) return Annotate(pem.status(), absl::StrCat("--", flag));
  return pem;
}

// Insecure credentials without grpc_tls_cert; TLS with it; mutual TLS (the
// client must present a certificate the client CA signed, or the handshake
// fails) with grpc_tls_client_ca too.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const DaemonConfig& c) {
  if (c.grpc_tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  WEIGHTD_ASSIGN_OR_RETURN(pair.cert_chain, ReadPem("grpc-tls-cert", c.grpc_tls_cert));
  WEIGHTD_ASSIGN_OR_RETURN(pair.private_key, ReadPem("grpc-tls-key", c.grpc_tls_key));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!c.grpc_tls_client_ca.empty()) {
    WEIGHTD_ASSIGN_OR_RETURN(options.pem_root_certs, ReadPem("grpc-tls-client-ca", c.grpc_tls_client_ca));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

std::string Mode(const DaemonConfig& c) {
  std::string transport = c.grpc_tls_cert.empty() ? "plain TCP" : c.grpc_tls_client_ca.empty() ? "TLS" : "mutual TLS";
  return absl::StrCat(transport, c.grpc_tcp_admin ? ", admin" : ", read-only");
}

}  // namespace

TcpListener::~TcpListener() { Shutdown(); }

absl::StatusOr<std::unique_ptr<TcpListener>> TcpListener::Start(const DaemonConfig& config, ModelRegistry* registry,
                                                                Metrics* metrics) {
  if (config.grpc_tcp_admin && config.grpc_tls_client_ca.empty()) {
    return absl::InvalidArgumentError("--grpc-tcp-admin needs mutual TLS on --grpc-address");
  }
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, Credentials(config));
  std::unique_ptr<TcpListener> tcp(new TcpListener());
  tcp->mode_ = Mode(config);
  tcp->full_ = std::make_unique<WeightdService>(registry, config.fd_socket);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.grpc_address, credentials, &tcp->port_);
  if (config.grpc_tcp_admin) {
    builder.RegisterService(tcp->full_.get());
  } else {
    tcp->read_only_ = std::make_unique<ReadOnlyWeightdService>(tcp->full_.get());
    builder.RegisterService(tcp->read_only_.get());
  }
  builder.SetMaxSendMessageSize(-1);
  ApplyGrpcLimits(config, builder);
  CountRpcs(builder, metrics);
  tcp->server_ = builder.BuildAndStart();
  if (tcp->server_ == nullptr || tcp->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on --grpc-address ", config.grpc_address));
  }
  return tcp;
}

void TcpListener::Shutdown(std::chrono::milliseconds grace) {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + grace);
}

}  // namespace weightd
