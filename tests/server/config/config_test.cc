// ParseDaemonArgs: flags, the --config file, precedence and errors.
#include "server/config/config.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;
using Code = absl::StatusCode;

TEST(DaemonConfig, DefaultsFollowTheDesign) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs parsed, ParseDaemonArgs({}));
  const DaemonConfig& c = parsed.config;
  EXPECT_EQ(c.socket, "/run/weightd/weightd.sock");
  EXPECT_EQ(c.fd_socket, "/run/weightd/weightd.fd.sock");
  EXPECT_EQ(c.grpc_address, "");
  EXPECT_EQ(c.grpc_tls_cert, "");
  EXPECT_EQ(c.grpc_tls_key, "");
  EXPECT_EQ(c.grpc_tls_client_ca, "");
  EXPECT_FALSE(c.grpc_tcp_admin);
  EXPECT_TRUE(c.model_root.empty());
  EXPECT_EQ(c.metrics_address, "127.0.0.1:9400");
  EXPECT_EQ(c.health_address, "");
  EXPECT_EQ(c.device_backend, "auto");
  EXPECT_TRUE(c.preload.empty());
  EXPECT_TRUE(c.allowed_gids.empty());
  EXPECT_EQ(c.lease_claim_timeout_seconds, 10);
  EXPECT_EQ(c.load_threads, 0);
  EXPECT_TRUE(c.mlock);
  EXPECT_EQ(c.fd_socket_max_connections, 4096);
  EXPECT_EQ(c.grpc_max_connections, 1024);
  EXPECT_EQ(c.grpc_max_threads, 64);
  EXPECT_EQ(c.grpc_max_streams_per_connection, 16);
  EXPECT_EQ(c.self_check_interval_seconds, 5);
  EXPECT_FALSE(parsed.help);
  EXPECT_FALSE(parsed.print_config);
}

TEST(DaemonConfig, FdSocketIsDerivedFromSocketUnlessGiven) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs derived, ParseDaemonArgs({"--socket", "/tmp/w/d.sock"}));
  EXPECT_EQ(derived.config.fd_socket, "/tmp/w/d.fd.sock");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs no_suffix, ParseDaemonArgs({"--socket=/tmp/w/grpc"}));
  EXPECT_EQ(no_suffix.config.fd_socket, "/tmp/w/grpc.fd.sock");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs given, ParseDaemonArgs({"--socket", "/a.sock", "--fd-socket", "/b/fd"}));
  EXPECT_EQ(given.config.fd_socket, "/b/fd");
}

TEST(DaemonConfig, RepeatedModelRootAccumulates) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs parsed,
                               ParseDaemonArgs({"--model-root", "/models", "--model-root=/data/ckpt", "--model-root", "/x"}));
  EXPECT_THAT(parsed.config.model_root, ElementsAre("/models", "/data/ckpt", "/x"));
}

TEST(DaemonConfig, PreloadTakesNameEqualsPath) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs parsed,
                               ParseDaemonArgs({"--preload", "llama=/models/llama", "--preload", "tiny=a=b"}));
  EXPECT_THAT(parsed.config.preload, ElementsAre(Pair("llama", "/models/llama"), Pair("tiny", "a=b")));
  EXPECT_THAT(ParseDaemonArgs({"--preload", "no-equals"}), StatusIs(Code::kInvalidArgument, "--preload: expected NAME=PATH"));
  EXPECT_THAT(ParseDaemonArgs({"--preload", "=/path"}), StatusIs(Code::kInvalidArgument, "'=/path'"));
}

TEST(DaemonConfig, TypedFlagsParse) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      ParsedArgs parsed,
      ParseDaemonArgs({"--device-backend", "emulated", "--allowed-gid", "44", "--allowed-gids", "1000",
                       "--lease-claim-timeout-seconds", "2.5", "--load-threads", "3", "--mlock", "false",
                       "--metrics-address", "", "--health-address", "0.0.0.0:8081", "--print-config", "--help"}));
  const DaemonConfig& c = parsed.config;
  EXPECT_EQ(c.device_backend, "emulated");
  EXPECT_THAT(c.allowed_gids, ElementsAre(44u, 1000u));
  EXPECT_EQ(c.lease_claim_timeout_seconds, 2.5);
  EXPECT_EQ(c.load_threads, 3);
  EXPECT_FALSE(c.mlock);
  EXPECT_EQ(c.metrics_address, "");
  EXPECT_EQ(c.health_address, "0.0.0.0:8081");
  EXPECT_TRUE(parsed.print_config);
  EXPECT_TRUE(parsed.help);
  EXPECT_FALSE(parsed.version);
}

TEST(DaemonConfig, VersionIsAFlagWithoutValue) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs parsed, ParseDaemonArgs({"--version"}));
  EXPECT_TRUE(parsed.version);
  EXPECT_FALSE(parsed.help);
  EXPECT_NE(DaemonUsage().find("[--version]"), std::string::npos);
}

TEST(DaemonConfig, PreloadPlansGiveAPreloadItsPlacementAndSubset) {
  TempDir dir;
  WriteFile(dir.Join("weightd.json"), R"({"preload": {"ds": "/m/ds", "draft": "/m/ds"},
      "preload_plans": {"draft": {"exclude": [".engram."], "include": ["model."], "host_resident": ["embed"],
                                  "tp_size": 2, "tp_rules": ["q_proj:0"], "devices": ["0", "1"]}}})");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs parsed, ParseDaemonArgs({"--config", dir.Join("weightd.json")}));
  ASSERT_EQ(parsed.config.preload_plans.size(), 1u);
  const PreloadPlan& p = parsed.config.preload_plans.at("draft");
  EXPECT_THAT(p.exclude, ElementsAre(".engram."));
  EXPECT_THAT(p.include, ElementsAre("model."));
  EXPECT_THAT(p.host_resident, ElementsAre("embed"));
  EXPECT_EQ(p.tp_size, 2u);
  EXPECT_THAT(p.tp_rules, ElementsAre("q_proj:0"));
  EXPECT_THAT(p.devices, ElementsAre("0", "1"));
  // --print-config writes it back the same.
  EXPECT_EQ(ConfigToJson(parsed.config)["preload_plans"]["draft"]["exclude"], nlohmann::json::array({".engram."}));

  WriteFile(dir.Join("unknown.json"), R"({"preload": {"a": "/m/a"}, "preload_plans": {"a": {"exlude": ["x"]}}})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("unknown.json")}),
              StatusIs(Code::kInvalidArgument, "unknown preload plan key 'exlude'"));
  WriteFile(dir.Join("orphan.json"), R"({"preload": {"a": "/m/a"}, "preload_plans": {"b": {}}})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("orphan.json")}),
              StatusIs(Code::kInvalidArgument, "preload_plans 'b' names no preload entry"));
  WriteFile(dir.Join("rule.json"), R"({"preload": {"a": "/m/a"}, "preload_plans": {"a": {"tp_rules": ["q_proj"]}}})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("rule.json")}),
              StatusIs(Code::kInvalidArgument, "preload_plans 'a': a tp_rule must be PATTERN:DIM, got 'q_proj'"));
  // Numbers and types are checked, not wrapped or truncated, and the error
  // names the plan and the key.
  WriteFile(dir.Join("wrap.json"), R"({"preload": {"a": "/m/a"}, "preload_plans": {"a": {"tp_size": 4294967298}}})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("wrap.json")}),
              StatusIs(Code::kInvalidArgument,
                       "key 'preload_plans' plan 'a': must be an integer in [1, 1024], got 4294967298"));
  WriteFile(dir.Join("bool.json"), R"({"preload": {"a": "/m/a"}, "preload_plans": {"a": {"numa_copies": "true"}}})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("bool.json")}),
              StatusIs(Code::kInvalidArgument, "key 'preload_plans' plan 'a': key 'numa_copies' must be true or false"));
  WriteFile(dir.Join("list.json"), R"({"preload": {"a": "/m/a"}, "preload_plans": {"a": {"include": "embed"}}})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("list.json")}),
              StatusIs(Code::kInvalidArgument, "key 'include' must be a list of strings"));
  WriteFile(dir.Join("watchers.json"), R"({"max_watchers": 4294967297})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("watchers.json")}),
              StatusIs(Code::kInvalidArgument,
                       "key 'max_watchers': must be an integer in [-2147483648, 2147483647], got 4294967297"));
  WriteFile(dir.Join("fraction.json"), R"({"load_threads": 1.5})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("fraction.json")}),
              StatusIs(Code::kInvalidArgument, "key 'load_threads': must be an integer"));
  EXPECT_THAT(ParseDaemonArgs({"--preload-plans", "x"}),
              StatusIs(Code::kInvalidArgument, "--preload-plans is set in the config file only (--config FILE.json)"));
}

TEST(DaemonConfig, ConfigFileSetsTheSameKeys) {
  TempDir dir;
  WriteFile(dir.Join("weightd.json"), R"({"socket": "/srv/w.sock", "model_root": ["/m1", "/m2"],
      "preload": {"tiny": "/m1/tiny"}, "device_backend": "none", "allowed_gids": [7],
      "lease_claim_timeout_seconds": 4, "load_threads": 2, "mlock": false})");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs parsed, ParseDaemonArgs({"--config", dir.Join("weightd.json")}));
  const DaemonConfig& c = parsed.config;
  EXPECT_EQ(c.socket, "/srv/w.sock");
  EXPECT_EQ(c.fd_socket, "/srv/w.fd.sock");
  EXPECT_THAT(c.model_root, ElementsAre("/m1", "/m2"));
  EXPECT_THAT(c.preload, ElementsAre(Pair("tiny", "/m1/tiny")));
  EXPECT_EQ(c.device_backend, "none");
  EXPECT_THAT(c.allowed_gids, ElementsAre(7u));
  EXPECT_EQ(c.lease_claim_timeout_seconds, 4);
  EXPECT_EQ(c.load_threads, 2);
  EXPECT_FALSE(c.mlock);
}

TEST(DaemonConfig, FlagsWinOverTheFile) {
  TempDir dir;
  WriteFile(dir.Join("c.json"), R"({"socket": "/file.sock", "model_root": ["/file-root"], "device_backend": "none",
      "load_threads": 8})");
  // The flag comes before --config on purpose: precedence is not order.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs parsed, ParseDaemonArgs({"--socket", "/flag.sock", "--config", dir.Join("c.json"),
                                                                  "--model-root", "/flag-root"}));
  const DaemonConfig& c = parsed.config;
  EXPECT_EQ(c.socket, "/flag.sock");
  EXPECT_EQ(c.fd_socket, "/flag.fd.sock");
  EXPECT_THAT(c.model_root, ElementsAre("/flag-root"));  // a list flag replaces the file's list
  EXPECT_EQ(c.device_backend, "none");                  // from the file: no flag given
  EXPECT_EQ(c.load_threads, 8);
}

TEST(DaemonConfig, UnknownFlagIsInvalidArgumentNamingIt) {
  EXPECT_THAT(ParseDaemonArgs({"--model-roots", "/m"}), StatusIs(Code::kInvalidArgument, "unknown flag --model-roots"));
  EXPECT_THAT(ParseDaemonArgs({"stray"}), StatusIs(Code::kInvalidArgument, "unexpected argument 'stray'"));
  EXPECT_THAT(ParseDaemonArgs({"--socket"}), StatusIs(Code::kInvalidArgument, "--socket needs a value"));
}

TEST(DaemonConfig, UnknownConfigKeyIsInvalidArgumentNamingIt) {
  TempDir dir;
  WriteFile(dir.Join("c.json"), R"({"socket": "/s.sock", "modelroot": ["/m"]})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("c.json")}),
              StatusIs(Code::kInvalidArgument, dir.Join("c.json") + ": unknown key 'modelroot'"));
}

TEST(DaemonConfig, MalformedConfigFileIsInvalidArgumentNamingIt) {
  TempDir dir;
  WriteFile(dir.Join("bad.json"), "{\"socket\": ");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("bad.json")}), StatusIs(Code::kInvalidArgument, "bad.json: not valid JSON"));
  WriteFile(dir.Join("type.json"), R"({"load_threads": "four"})");
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("type.json")}), StatusIs(Code::kInvalidArgument, "type.json"));
  EXPECT_THAT(ParseDaemonArgs({"--config", dir.Join("absent.json")}), StatusIs(Code::kNotFound, "absent.json"));
}

TEST(DaemonConfig, BadValuesAreInvalidArgumentNamingTheFlag) {
  EXPECT_THAT(ParseDaemonArgs({"--device-backend", "gpu"}),
              StatusIs(Code::kInvalidArgument, "--device-backend must be auto, cuda, cuda-legacy-ipc, emulated or none, got 'gpu'"));
  EXPECT_THAT(ParseDaemonArgs({"--load-threads", "many"}), StatusIs(Code::kInvalidArgument, "expected an integer, got 'many'"));
  EXPECT_THAT(ParseDaemonArgs({"--load-threads", "-1"}), StatusIs(Code::kInvalidArgument, "--load-threads must be in [0, 256], got -1"));
  EXPECT_THAT(ParseDaemonArgs({"--mlock", "yes"}), StatusIs(Code::kInvalidArgument, "expected true or false, got 'yes'"));
  EXPECT_THAT(ParseDaemonArgs({"--lease-claim-timeout-seconds", "0"}),
              StatusIs(Code::kInvalidArgument, "--lease-claim-timeout-seconds must be in (0, 86400], got 0"));
  // Regressions: NaN and huge values once passed and overflowed the claim deadline.
  EXPECT_THAT(ParseDaemonArgs({"--lease-claim-timeout-seconds", "nan"}),
              StatusIs(Code::kInvalidArgument, "--lease-claim-timeout-seconds must be in (0, 86400], got nan"));
  EXPECT_THAT(ParseDaemonArgs({"--lease-claim-timeout-seconds", "1e30"}),
              StatusIs(Code::kInvalidArgument, "--lease-claim-timeout-seconds must be in (0, 86400], got 1e+30"));
  EXPECT_THAT(ParseDaemonArgs({"--load-threads", "1000000"}),
              StatusIs(Code::kInvalidArgument, "--load-threads must be in [0, 256], got 1000000"));
  EXPECT_THAT(ParseDaemonArgs({"--allowed-gid", "wheel"}), StatusIs(Code::kInvalidArgument, "expected a numeric gid"));
  EXPECT_THAT(ParseDaemonArgs({"--socket", ""}), StatusIs(Code::kInvalidArgument, "--socket must not be empty"));
  EXPECT_THAT(ParseDaemonArgs({"--socket", "/r/a.sock", "--fd-socket", "/r/a.sock"}),
              StatusIs(Code::kInvalidArgument, "--fd-socket must differ from --socket"));
}

TEST(DaemonConfig, WatchBoundsDefaultParseAndRefuseOutOfRange) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs defaults, ParseDaemonArgs({}));
  EXPECT_EQ(defaults.config.max_watchers, 256);
  EXPECT_EQ(defaults.config.watch_queue_events, 1024);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs parsed, ParseDaemonArgs({"--max-watchers", "3", "--watch-queue-events", "16"}));
  EXPECT_EQ(parsed.config.max_watchers, 3);
  EXPECT_EQ(parsed.config.watch_queue_events, 16);
  EXPECT_THAT(ParseDaemonArgs({"--max-watchers", "0"}),
              StatusIs(Code::kInvalidArgument, "--max-watchers must be in [1, 65536], got 0"));
  EXPECT_THAT(ParseDaemonArgs({"--watch-queue-events", "15"}),
              StatusIs(Code::kInvalidArgument, "--watch-queue-events must be in [16, 1048576], got 15"));
  EXPECT_NE(DaemonUsage().find("[--max-watchers N]"), std::string::npos);
}

TEST(DaemonConfig, PeerKeysDefaultParseAndRefuseBadValues) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs defaults, ParseDaemonArgs({}));
  EXPECT_EQ(defaults.config.peer_address, "");
  EXPECT_TRUE(defaults.config.peers.empty());
  EXPECT_EQ(defaults.config.peer_max_joiners, 4);
  EXPECT_EQ(defaults.config.peer_deadline_seconds, 600);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      ParsedArgs parsed, ParseDaemonArgs({"--peer-address", "0.0.0.0:0", "--peers", "node-a:7400", "--peer", "[::1]:7400",
                                          "--peer-max-joiners", "2", "--peer-deadline-seconds", "30"}));
  EXPECT_EQ(parsed.config.peer_address, "0.0.0.0:0");
  EXPECT_EQ(parsed.config.peers, (std::vector<std::string>{"node-a:7400", "[::1]:7400"}));
  EXPECT_EQ(parsed.config.peer_max_joiners, 2);
  EXPECT_EQ(parsed.config.peer_deadline_seconds, 30);
  EXPECT_THAT(ParseDaemonArgs({"--peers", "node-a"}),
              StatusIs(Code::kInvalidArgument, "--peers: 'node-a' is not HOST:PORT"));
  EXPECT_THAT(ParseDaemonArgs({"--peer-address", "node-a"}),
              StatusIs(Code::kInvalidArgument, "--peer-address must be HOST:PORT (port 0 picks one), got 'node-a'"));
  EXPECT_THAT(ParseDaemonArgs({"--peer-max-joiners", "0"}),
              StatusIs(Code::kInvalidArgument, "--peer-max-joiners must be in [1, 1024], got 0"));
  EXPECT_THAT(ParseDaemonArgs({"--peer-deadline-seconds", "0"}),
              StatusIs(Code::kInvalidArgument, "--peer-deadline-seconds must be in (0, 86400], got 0"));
  EXPECT_THAT(ParseDaemonArgs({"--peer-test-fault", "explode"}),
              StatusIs(Code::kInvalidArgument, "--peer-test-fault must be corrupt, stall, helper-keeps-mapping or "
                                               "helper-writes-late (tests only), got 'explode'"));
  EXPECT_EQ(defaults.config.peer_lanes, 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs lanes, ParseDaemonArgs({"--peer-lanes", "3"}));
  EXPECT_EQ(lanes.config.peer_lanes, 3);
  EXPECT_THAT(ParseDaemonArgs({"--peer-lanes", "9"}),
              StatusIs(Code::kInvalidArgument, "--peer-lanes must be in [0, 8] (0: by size and cores), got 9"));
  EXPECT_THAT(ParseDaemonArgs({"--peer-lanes", "-1"}),
              StatusIs(Code::kInvalidArgument, "--peer-lanes must be in [0, 8] (0: by size and cores), got -1"));
  EXPECT_EQ(defaults.config.peer_verify, "per-segment");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs verify, ParseDaemonArgs({"--peer-verify", "per-transfer"}));
  EXPECT_EQ(verify.config.peer_verify, "per-transfer");
  EXPECT_THAT(ParseDaemonArgs({"--peer-verify", "never"}),
              StatusIs(Code::kInvalidArgument, "--peer-verify must be per-segment or per-transfer, got 'never'"));
  EXPECT_NE(DaemonUsage().find("[--peer-verify per-segment|per-transfer]"), std::string::npos);
  EXPECT_NE(DaemonUsage().find("[--peer-address HOST:PORT]"), std::string::npos);
  EXPECT_EQ(defaults.config.peer_helper, "");
  EXPECT_EQ(defaults.config.peer_helper_user, "nobody");
  EXPECT_TRUE(defaults.config.peer_helper_sandbox);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(parsed, ParseDaemonArgs({"--peer-helper", "/opt/w/weightd-peer-helper",
                                                        "--peer-helper-user", "weightd-peer", "--peer-tls-cert", "n.pem",
                                                        "--peer-tls-key", "n.key", "--peer-tls-ca", "ca.pem",
                                                        "--peer-tls-server-name", "weightd-peer"}));
  EXPECT_EQ(parsed.config.peer_helper, "/opt/w/weightd-peer-helper");
  EXPECT_EQ(parsed.config.peer_helper_user, "weightd-peer");
  EXPECT_EQ(parsed.config.peer_tls_ca, "ca.pem");
  EXPECT_EQ(parsed.config.peer_tls_server_name, "weightd-peer");
  EXPECT_THAT(ParseDaemonArgs({"--peer-helper-user", "a b"}),
              StatusIs(Code::kInvalidArgument, "--peer-helper-user must be a user name"));
  for (std::vector<std::string> partial : {std::vector<std::string>{"--peer-tls-cert", "n.pem"},
                                           {"--peer-tls-cert", "n.pem", "--peer-tls-key", "n.key"},
                                           {"--peer-tls-server-name", "x"}}) {
    EXPECT_THAT(ParseDaemonArgs(partial),
                StatusIs(Code::kInvalidArgument,
                         "mutual TLS between peers needs all of --peer-tls-cert, --peer-tls-key and --peer-tls-ca"));
  }
}

TEST(DaemonConfig, ReliabilityBoundsParseAndRefuseOutOfRange) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      ParsedArgs parsed, ParseDaemonArgs({"--fd-socket-max-connections", "2", "--grpc-max-connections", "3", "--grpc-max-threads", "8",
                                          "--grpc-max-streams-per-connection", "4", "--self-check-interval-seconds",
                                          "0.5"}));
  EXPECT_EQ(parsed.config.fd_socket_max_connections, 2);
  EXPECT_EQ(parsed.config.grpc_max_connections, 3);
  EXPECT_EQ(parsed.config.grpc_max_threads, 8);
  EXPECT_EQ(parsed.config.grpc_max_streams_per_connection, 4);
  EXPECT_EQ(parsed.config.self_check_interval_seconds, 0.5);
  EXPECT_THAT(ParseDaemonArgs({"--fd-socket-max-connections", "0"}),
              StatusIs(Code::kInvalidArgument, "--fd-socket-max-connections must be in [1, 1000000], got 0"));
  EXPECT_THAT(ParseDaemonArgs({"--grpc-max-connections", "-1"}),
              StatusIs(Code::kInvalidArgument, "--grpc-max-connections must be in [1, 1000000], got -1"));
  EXPECT_THAT(ParseDaemonArgs({"--grpc-max-threads", "3"}),
              StatusIs(Code::kInvalidArgument, "--grpc-max-threads must be in [4, 4096], got 3"));
  EXPECT_THAT(ParseDaemonArgs({"--grpc-max-streams-per-connection", "0"}),
              StatusIs(Code::kInvalidArgument, "--grpc-max-streams-per-connection must be in [1, 1024], got 0"));
  EXPECT_THAT(ParseDaemonArgs({"--self-check-interval-seconds", "nan"}),
              StatusIs(Code::kInvalidArgument, "--self-check-interval-seconds must be in [0.1, 3600], got nan"));
}

TEST(DaemonConfig, DirectIoDefaultsToAutoAndRefusesOtherWords) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs defaults, ParseDaemonArgs({}));
  EXPECT_EQ(defaults.config.direct_io, "auto");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs off, ParseDaemonArgs({"--direct-io=off"}));
  EXPECT_EQ(off.config.direct_io, "off");
  EXPECT_THAT(ParseDaemonArgs({"--direct-io", "yes"}),
              StatusIs(Code::kInvalidArgument, "--direct-io must be auto, on or off, got 'yes'"));
}

TEST(DaemonConfig, AdminOnTcpNeedsMutualTls) {
  const std::vector<std::string> tcp = {"--grpc-address", "127.0.0.1:0"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), tcp.begin(), tcp.end());
    return ParseDaemonArgs(extra);
  };
  const char* kNeedsMtls = "--grpc-tcp-admin needs mutual TLS on --grpc-address: set --grpc-tls-cert, --grpc-tls-key "
                           "and --grpc-tls-client-ca";
  EXPECT_THAT(with({"--grpc-tcp-admin", "true"}), StatusIs(Code::kInvalidArgument, kNeedsMtls));
  EXPECT_THAT(with({"--grpc-tcp-admin", "true", "--grpc-tls-cert", "c", "--grpc-tls-key", "k"}),
              StatusIs(Code::kInvalidArgument, kNeedsMtls));
  EXPECT_THAT(with({"--grpc-tcp-admin", "true", "--grpc-tls-client-ca", "ca"}),
              StatusIs(Code::kInvalidArgument, kNeedsMtls));
  EXPECT_THAT(with({"--grpc-tls-cert", "c"}),
              StatusIs(Code::kInvalidArgument, "needs both --grpc-tls-cert and --grpc-tls-key"));
  EXPECT_THAT(with({"--grpc-tls-client-ca", "ca"}),
              StatusIs(Code::kInvalidArgument, "needs both --grpc-tls-cert and --grpc-tls-key"));
  EXPECT_THAT(ParseDaemonArgs({"--grpc-tcp-admin", "true"}),
              StatusIs(Code::kInvalidArgument, "apply to --grpc-address, which is not set"));
  // Read-only TCP, with or without (mutual) TLS, is fine; so is admin with all three files.
  WEIGHTD_EXPECT_OK(with({}));
  WEIGHTD_EXPECT_OK(with({"--grpc-tls-cert", "c", "--grpc-tls-key", "k"}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      ParsedArgs admin,
      with({"--grpc-tls-cert", "c", "--grpc-tls-key", "k", "--grpc-tls-client-ca", "ca", "--grpc-tcp-admin", "true"}));
  EXPECT_TRUE(admin.config.grpc_tcp_admin);
}

TEST(DaemonConfig, ConfigToJsonRoundTripsThroughConfigFile) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      ParsedArgs original,
      ParseDaemonArgs({"--socket", "/r/w.sock", "--fd-socket", "/r/fd.sock", "--grpc-address", "127.0.0.1:0",
                       "--grpc-tls-cert", "/t/s.pem", "--grpc-tls-key", "/t/s.key", "--grpc-tls-client-ca", "/t/ca.pem",
                       "--grpc-tcp-admin", "true", "--model-root", "/a", "--model-root", "/b", "--metrics-address", "", "--health-address", ":8081",
                       "--device-backend", "emulated", "--preload", "x=/a/x", "--preload", "y=/b/y", "--allowed-gid", "5",
                       "--lease-claim-timeout-seconds", "0.25", "--load-threads", "6", "--direct-io", "on", "--mlock", "false",
                       "--huge-pages", "false"}));
  TempDir dir;
  const nlohmann::json json = ConfigToJson(original.config);
  WriteFile(dir.Join("round.json"), json.dump(2));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ParsedArgs reread, ParseDaemonArgs({"--config", dir.Join("round.json")}));
  EXPECT_EQ(ConfigToJson(reread.config), json);
  EXPECT_EQ(reread.config.preload, original.config.preload);
  EXPECT_EQ(reread.config.lease_claim_timeout_seconds, 0.25);
  EXPECT_EQ(reread.config.direct_io, "on");
  EXPECT_TRUE(reread.config.grpc_tcp_admin);
  EXPECT_EQ(reread.config.grpc_tls_client_ca, "/t/ca.pem");
  EXPECT_FALSE(reread.config.huge_pages);
  EXPECT_EQ(json.size(), 41u);  // every DaemonConfig field, so a new one cannot be forgotten silently
}

}  // namespace
}  // namespace weightd
