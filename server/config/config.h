// The daemon's configuration: flags (DESIGN.md "Command line") and an
// optional JSON file with the same keys (a flag's name without "--", with
// '_' for '-'). Flags win over the file; an unknown key or flag is an error
// that names it.
#ifndef WEIGHTD_SERVER_CONFIG_CONFIG_H_
#define WEIGHTD_SERVER_CONFIG_CONFIG_H_

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace weightd {

// How a preload places and selects tensors: the options of `weightctl load`
// for one `preload` entry, set in the config file only ("preload_plans":
// {"NAME": {...}}, keys as below; an unknown key is an error naming it).
struct PreloadPlan {
  std::vector<std::string> host_resident;  // --host-resident patterns
  std::vector<std::string> include;        // --include patterns (subset load)
  std::vector<std::string> exclude;        // --exclude patterns
  uint32_t tp_size = 1;
  std::vector<std::string> tp_rules;       // "PATTERN:DIM", as --tp-rule
  std::vector<std::string> devices;        // one GPU (UUID or ordinal) per rank
  bool numa_copies = false;                // --numa-copies
  bool operator==(const PreloadPlan&) const = default;
};
void to_json(nlohmann::json& j, const PreloadPlan& plan);
void from_json(const nlohmann::json& j, PreloadPlan& plan);  // throws json::exception naming a bad key

struct DaemonConfig {
  std::string socket = "/run/weightd/weightd.sock";  // gRPC Unix socket, mode 0660
  std::string fd_socket;                             // default: beside socket, "<stem>.fd.sock"
  std::string grpc_address;                          // optional gRPC TCP listener, HOST:PORT; read-only unless grpc_tcp_admin
  std::string grpc_tls_cert;                         // PEM server certificate (chain) for grpc_address; "" = plain TCP
  std::string grpc_tls_key;                          // PEM private key of grpc_tls_cert
  std::string grpc_tls_client_ca;                    // PEM CA(s): clients of grpc_address must present a certificate it signed
  bool grpc_tcp_admin = false;                       // serve LoadModel/UnloadModel/Attach/Detach on grpc_address (needs mTLS)
  std::vector<std::string> model_root;
  std::string metrics_address = "127.0.0.1:9400";    // "" disables
  std::string health_address;                        // optional TCP health-only listener
  std::string device_backend = "auto";               // auto|cuda|cuda-legacy-ipc|emulated|none
  std::map<std::string, std::string> preload;        // name -> checkpoint path
  std::map<std::string, PreloadPlan> preload_plans;  // name (of a preload) -> its plan; config file only
  std::vector<gid_t> allowed_gids;                   // fd socket peers besides our uid and root
  double lease_claim_timeout_seconds = 10;
  int load_threads = 0;                              // 0: one per core
  std::string direct_io = "auto";                    // auto|on|off: O_DIRECT reads (server/load/reader.h)
  bool mlock = true;                                 // pin host segments after publishing (server/model/segment_pinner.h)
  bool huge_pages = true;                            // 2 MiB pages where the kernel allows (common/memory/huge_pages.h)
  // Reliability bounds (docs/operations.md "Reliability").
  int fd_socket_max_connections = 4096;              // claimed + pending fd-socket connections
  int grpc_max_connections = 1024;                  // connections on the gRPC Unix socket, and on a plain-TCP grpc_address
  int grpc_max_threads = 64;                         // sync-server threads in calls at once, all listeners
  int grpc_max_streams_per_connection = 16;          // concurrent calls on one gRPC connection
  double grpc_first_bytes_timeout_seconds = 10;     // a gRPC connection silent this long is closed (server/listen/grpc_acceptor.h)
  double self_check_interval_seconds = 5;            // probe every listener; WATCHDOG=1 only while all answer
  int max_watchers = 256;                            // WatchModel streams open at once, all listeners
  int watch_queue_events = 1024;                     // events a watch stream may fall behind before it is dropped
  // Peer seeding (docs/operations.md "Peer seeding").
  std::string peer_address;                          // HOST:PORT: serve weightd.v1.Peer + UCX to other nodes; "" = off
  std::vector<std::string> peers;                    // HOST:PORT peers every load asks before storage
  int peer_max_joiners = 4;                          // transfer sessions a seed serves at once; more get UNAVAILABLE
  double peer_deadline_seconds = 600;                // joiner: per peer, ask to READY; seed: session limit
  int peer_lanes = 0;                                // joiner: UCX endpoints (helpers) per transfer; 0 = by size and cores
  std::string peer_verify = "per-segment";            // joiner: hash each received segment once sealed, or "per-transfer" (all after the last byte)
  // Tests only: a seed's "corrupt" or "stall" (server/peer/peer_seed.h), a
  // joiner helper's "helper-keeps-mapping" or "helper-writes-late"
  // (UcxHelperOptions::test_fault).
  std::string peer_test_fault;
  std::string peer_helper;                           // weightd-peer-helper path; "" = beside this executable
  std::string peer_helper_user = "nobody";           // when root, helpers run as this user; "" = stay root
  bool peer_helper_sandbox = true;                   // Landlock + seccomp in helpers (common/peer/helper_protocol.h)
  // Mutual TLS between peers (all three or none): this node's certificate
  // (serverAuth and clientAuth) and key, and the CA every node's is signed by.
  std::string peer_tls_cert;
  std::string peer_tls_key;
  std::string peer_tls_ca;
  std::string peer_tls_server_name;                  // name seeds' certificates carry; "" = the address dialled
};

struct ParsedArgs {
  DaemonConfig config;
  bool print_config = false;
  bool help = false;
  bool version = false;  // --version: print "weightd VERSION" and exit 0
};

// Parses argv (without the program name). INVALID_ARGUMENT names the flag,
// key or value at fault; a --config file that cannot be read is NOT_FOUND.
absl::StatusOr<ParsedArgs> ParseDaemonArgs(const std::vector<std::string>& argv);
nlohmann::json ConfigToJson(const DaemonConfig& config);
std::string DaemonUsage();

}  // namespace weightd

#endif  // WEIGHTD_SERVER_CONFIG_CONFIG_H_
