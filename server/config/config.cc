#include "server/config/config.h"

#include <algorithm>
#include <climits>
#include <type_traits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/io/env.h"
#include "common/base/status.h"
#include "server/peer/peer_join.h"
#include "server/load/reader.h"
#include "server/model/model.h"

namespace weightd {
namespace {

using json = nlohmann::json;

// nlohmann/json's messages start "[json.exception.type_error.302] ": the
// rest is the reason.
std::string WithoutJsonPrefix(const std::string& what) {
  if (what.rfind("[json.exception.", 0) != 0) return what;
  size_t end = what.find("] ");
  return end == std::string::npos ? what : what.substr(end + 2);
}

// An integer in [lo, hi]; a fraction, a boolean, a string or a number out of
// range throws (json's own conversion would truncate or wrap it silently).
int64_t CheckedInteger(const json& value, int64_t lo, int64_t hi) {
  bool fits = value.is_number_integer() &&
              (value.is_number_unsigned() ? value.get<uint64_t>() <= static_cast<uint64_t>(hi)
                                          : value.get<int64_t>() >= lo && value.get<int64_t>() <= hi);
  if (!fits) {
    throw json::other_error::create(501, absl::StrCat("must be an integer in [", lo, ", ", hi, "], got ", value.dump()),
                                    &value);
  }
  return value.get<int64_t>();
}

// The one list of config keys: calls f(key, field) for every field of `c`
// (DaemonConfig or const DaemonConfig), in the order --print-config shows.
template <typename Config, typename F>
void ForEachField(Config& c, F&& f) {
  f("socket", c.socket);
  f("fd_socket", c.fd_socket);
  f("grpc_address", c.grpc_address);
  f("grpc_tls_cert", c.grpc_tls_cert);
  f("grpc_tls_key", c.grpc_tls_key);
  f("grpc_tls_client_ca", c.grpc_tls_client_ca);
  f("grpc_tcp_admin", c.grpc_tcp_admin);
  f("model_root", c.model_root);
  f("metrics_address", c.metrics_address);
  f("health_address", c.health_address);
  f("device_backend", c.device_backend);
  f("preload", c.preload);
  f("preload_plans", c.preload_plans);
  f("allowed_gids", c.allowed_gids);
  f("lease_claim_timeout_seconds", c.lease_claim_timeout_seconds);
  f("load_threads", c.load_threads);
  f("direct_io", c.direct_io);
  f("mlock", c.mlock);
  f("huge_pages", c.huge_pages);
  f("fd_socket_max_connections", c.fd_socket_max_connections);
  f("grpc_max_connections", c.grpc_max_connections);
  f("grpc_max_threads", c.grpc_max_threads);
  f("grpc_max_streams_per_connection", c.grpc_max_streams_per_connection);
  f("self_check_interval_seconds", c.self_check_interval_seconds);
  f("grpc_first_bytes_timeout_seconds", c.grpc_first_bytes_timeout_seconds);
  f("max_watchers", c.max_watchers);
  f("watch_queue_events", c.watch_queue_events);
  f("peer_address", c.peer_address);
  f("peers", c.peers);
  f("peer_max_joiners", c.peer_max_joiners);
  f("peer_deadline_seconds", c.peer_deadline_seconds);
  f("peer_lanes", c.peer_lanes);
  f("peer_verify", c.peer_verify);
  f("peer_test_fault", c.peer_test_fault);
  f("peer_helper", c.peer_helper);
  f("peer_helper_user", c.peer_helper_user);
  f("peer_helper_sandbox", c.peer_helper_sandbox);
  f("peer_tls_cert", c.peer_tls_cert);
  f("peer_tls_key", c.peer_tls_key);
  f("peer_tls_ca", c.peer_tls_ca);
  f("peer_tls_server_name", c.peer_tls_server_name);
}

// How a flag's text becomes a field's JSON value, by the field's type.
enum class Kind { kString, kStringList, kMap, kGidList, kNumber, kInt, kBool, kFileOnly };
constexpr Kind KindOf(const std::string&) { return Kind::kString; }
constexpr Kind KindOf(const std::vector<std::string>&) { return Kind::kStringList; }
constexpr Kind KindOf(const std::map<std::string, std::string>&) { return Kind::kMap; }
constexpr Kind KindOf(const std::vector<gid_t>&) { return Kind::kGidList; }
constexpr Kind KindOf(const double&) { return Kind::kNumber; }
constexpr Kind KindOf(const int&) { return Kind::kInt; }
constexpr Kind KindOf(const bool&) { return Kind::kBool; }
constexpr Kind KindOf(const std::map<std::string, PreloadPlan>&) { return Kind::kFileOnly; }

const std::map<std::string, Kind>& Keys() {
  static const auto* keys = [] {
    auto* keys = new std::map<std::string, Kind>;
    const DaemonConfig defaults;
    ForEachField(defaults, [&](const char* key, const auto& field) { (*keys)[key] = KindOf(field); });
    return keys;
  }();
  return *keys;
}

// Turns one flag value into the JSON the config file would hold.
absl::Status AddFlag(json& patch, const std::string& flag, const std::string& key, Kind kind, const std::string& value) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", what, ", got '", value, "'"));
  };
  switch (kind) {
    case Kind::kString: patch[key] = value; break;
    case Kind::kStringList: patch[key].push_back(value); break;
    case Kind::kMap: {
      size_t eq = value.find('=');
      if (eq == std::string::npos || eq == 0) return bad("expected NAME=PATH");
      patch[key][value.substr(0, eq)] = value.substr(eq + 1);
      break;
    }
    case Kind::kGidList: {
      uint32_t gid;
      if (!absl::SimpleAtoi(value, &gid)) return bad("expected a numeric gid");
      patch[key].push_back(gid);
      break;
    }
    case Kind::kNumber: {
      double d;
      if (!absl::SimpleAtod(value, &d)) return bad("expected a number");
      patch[key] = d;
      break;
    }
    case Kind::kInt: {
      int i;
      if (!absl::SimpleAtoi(value, &i)) return bad("expected an integer");
      patch[key] = i;
      break;
    }
    case Kind::kBool:
      if (value != "true" && value != "false") return bad("expected true or false");
      patch[key] = value == "true";
      break;
    case Kind::kFileOnly:
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " is set in the config file only (--config FILE.json)"));
  }
  return absl::OkStatus();
}

absl::Status Apply(const json& doc, absl::string_view where, DaemonConfig& c) {
  if (!doc.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": expected a JSON object"));
  for (auto& [key, value] : doc.items()) {
    if (Keys().count(key) == 0) return absl::InvalidArgumentError(absl::StrCat(where, ": unknown key '", key, "'"));
  }
  std::string current;
  try {
    ForEachField(c, [&](const char* key, auto& field) {
      current = key;
      if (!doc.contains(key)) return;
      const json& value = doc.at(key);
      using Field = std::decay_t<decltype(field)>;
      if constexpr (std::is_same_v<Field, int>) {
        field = static_cast<int>(CheckedInteger(value, INT_MIN, INT_MAX));
      } else if constexpr (std::is_same_v<Field, std::map<std::string, PreloadPlan>>) {
        if (!value.is_object()) throw json::other_error::create(501, "must be an object of plans by preload name", &value);
        field.clear();
        for (auto& [name, plan] : value.items()) {
          current = absl::StrCat(key, "' plan '", name);
          field[name] = plan.template get<PreloadPlan>();
        }
      } else {
        value.get_to(field);
      }
    });
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": key '", current, "': ", WithoutJsonPrefix(e.what())));
  }
  return absl::OkStatus();
}

// The TCP listener: TLS needs a certificate and its key; admin methods need
// mutual TLS (docs/operations.md "Who can do what on each listener").
absl::Status ValidateTcp(const DaemonConfig& c) {
  bool any_tls = !c.grpc_tls_cert.empty() || !c.grpc_tls_key.empty() || !c.grpc_tls_client_ca.empty();
  if (c.grpc_address.empty() && (any_tls || c.grpc_tcp_admin)) {
    return absl::InvalidArgumentError("--grpc-tls-* and --grpc-tcp-admin apply to --grpc-address, which is not set");
  }
  if (c.grpc_tcp_admin && (c.grpc_tls_cert.empty() || c.grpc_tls_key.empty() || c.grpc_tls_client_ca.empty())) {
    return absl::InvalidArgumentError(
        "--grpc-tcp-admin needs mutual TLS on --grpc-address: set --grpc-tls-cert, --grpc-tls-key and "
        "--grpc-tls-client-ca");
  }
  if (c.grpc_tls_cert.empty() != c.grpc_tls_key.empty() || (!c.grpc_tls_client_ca.empty() && c.grpc_tls_cert.empty())) {
    return absl::InvalidArgumentError("TLS on --grpc-address needs both --grpc-tls-cert and --grpc-tls-key");
  }
  return absl::OkStatus();
}

absl::Status ValidatePeers(const DaemonConfig& c) {
  WEIGHTD_RETURN_IF_ERROR(ValidatePeerList(c.peers, "--peers"));
  if (size_t colon = c.peer_address.rfind(':'); !c.peer_address.empty()) {
    uint32_t port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(c.peer_address.substr(colon + 1), &port) || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("--peer-address must be HOST:PORT (port 0 picks one), got '", c.peer_address, "'"));
    }
  }
  if (c.peer_max_joiners < 1 || c.peer_max_joiners > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--peer-max-joiners must be in [1, 1024], got ", c.peer_max_joiners));
  }
  if (!(c.peer_deadline_seconds > 0 && c.peer_deadline_seconds <= 86400)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peer-deadline-seconds must be in (0, 86400], got ", c.peer_deadline_seconds));
  }
  if (bool any = !c.peer_tls_cert.empty() || !c.peer_tls_key.empty() || !c.peer_tls_ca.empty() ||
                 !c.peer_tls_server_name.empty();
      any && (c.peer_tls_cert.empty() || c.peer_tls_key.empty() || c.peer_tls_ca.empty())) {
    return absl::InvalidArgumentError(
        "mutual TLS between peers needs all of --peer-tls-cert, --peer-tls-key and --peer-tls-ca");
  }
  if (c.peer_helper_user.size() > 32 ||
      !std::all_of(c.peer_helper_user.begin(), c.peer_helper_user.end(), [](char ch) {
        return absl::ascii_isalnum(ch) || ch == '_' || ch == '-' || ch == '.';
      })) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peer-helper-user must be a user name ([A-Za-z0-9._-], at most 32), got '", c.peer_helper_user, "'"));
  }
  if (c.peer_lanes < 0 || c.peer_lanes > static_cast<int>(kMaxPeerLanes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peer-lanes must be in [0, ", kMaxPeerLanes, "] (0: by size and cores), got ", c.peer_lanes));
  }
  if (c.peer_verify != "per-segment" && c.peer_verify != "per-transfer") {
    return absl::InvalidArgumentError(
        absl::StrCat("--peer-verify must be per-segment or per-transfer, got '", c.peer_verify, "'"));
  }
  if (!c.peer_test_fault.empty() && c.peer_test_fault != "corrupt" && c.peer_test_fault != "stall" &&
      c.peer_test_fault != "helper-keeps-mapping" && c.peer_test_fault != "helper-writes-late") {
    return absl::InvalidArgumentError(absl::StrCat("--peer-test-fault must be corrupt, stall, helper-keeps-mapping or "
                                                   "helper-writes-late (tests only), got '", c.peer_test_fault, "'"));
  }
  return absl::OkStatus();
}

absl::Status ValidatePreloadPlans(const DaemonConfig& c) {
  for (const auto& [name, plan] : c.preload_plans) {
    if (!c.preload.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("preload_plans '", name, "' names no preload entry"));
    }
    if (plan.tp_size < 1 || plan.tp_size > 1024) {
      return absl::InvalidArgumentError(absl::StrCat("preload_plans '", name, "': tp_size must be in [1, 1024]"));
    }
    for (const std::string& rule : plan.tp_rules) {
      if (!ParseTpRule(rule)) {
        return absl::InvalidArgumentError(
            absl::StrCat("preload_plans '", name, "': a tp_rule must be PATTERN:DIM, got '", rule, "'"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Validate(DaemonConfig& c) {
  static const char* kBackends[] = {"auto", "cuda", "cuda-legacy-ipc", "emulated", "none"};
  if (std::find(std::begin(kBackends), std::end(kBackends), c.device_backend) == std::end(kBackends)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device-backend must be auto, cuda, cuda-legacy-ipc, emulated or none, got '", c.device_backend, "'"));
  }
  if (!(c.lease_claim_timeout_seconds > 0 && c.lease_claim_timeout_seconds <= 86400)) {
    return absl::InvalidArgumentError(absl::StrCat("--lease-claim-timeout-seconds must be in (0, 86400], got ",
                                                   c.lease_claim_timeout_seconds));
  }
  if (c.load_threads < 0 || c.load_threads > 256) {
    return absl::InvalidArgumentError(absl::StrCat("--load-threads must be in [0, 256], got ", c.load_threads));
  }
  if (c.fd_socket_max_connections < 1 || c.fd_socket_max_connections > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fd-socket-max-connections must be in [1, 1000000], got ", c.fd_socket_max_connections));
  }
  if (c.grpc_max_connections < 1 || c.grpc_max_connections > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grpc-max-connections must be in [1, 1000000], got ", c.grpc_max_connections));
  }
  if (c.grpc_max_threads < 4 || c.grpc_max_threads > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("--grpc-max-threads must be in [4, 4096], got ", c.grpc_max_threads));
  }
  if (c.grpc_max_streams_per_connection < 1 || c.grpc_max_streams_per_connection > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--grpc-max-streams-per-connection must be in [1, 1024], got ",
                                                   c.grpc_max_streams_per_connection));
  }
  if (c.max_watchers < 1 || c.max_watchers > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("--max-watchers must be in [1, 65536], got ", c.max_watchers));
  }
  if (c.watch_queue_events < 16 || c.watch_queue_events > 1048576) {
    return absl::InvalidArgumentError(
        absl::StrCat("--watch-queue-events must be in [16, 1048576], got ", c.watch_queue_events));
  }
  if (!(c.grpc_first_bytes_timeout_seconds >= 0.1 && c.grpc_first_bytes_timeout_seconds <= 600)) {
    return absl::InvalidArgumentError(absl::StrCat("--grpc-first-bytes-timeout-seconds must be in [0.1, 600], got ",
                                                   c.grpc_first_bytes_timeout_seconds));
  }
  if (!(c.self_check_interval_seconds >= 0.1 && c.self_check_interval_seconds <= 3600)) {
    return absl::InvalidArgumentError(absl::StrCat("--self-check-interval-seconds must be in [0.1, 3600], got ",
                                                   c.self_check_interval_seconds));
  }
  if (!ParseDirectIo(c.direct_io).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--direct-io must be auto, on or off, got '", c.direct_io, "'"));
  }
  WEIGHTD_RETURN_IF_ERROR(ValidatePeers(c));
  WEIGHTD_RETURN_IF_ERROR(ValidatePreloadPlans(c));
  if (c.socket.empty()) return absl::InvalidArgumentError("--socket must not be empty");
  WEIGHTD_RETURN_IF_ERROR(ValidateTcp(c));
  if (c.fd_socket.empty()) {
    std::string stem = absl::EndsWith(c.socket, ".sock") ? c.socket.substr(0, c.socket.size() - 5) : c.socket;
    c.fd_socket = stem + ".fd.sock";
  }
  if (c.fd_socket == c.socket) return absl::InvalidArgumentError("--fd-socket must differ from --socket");
  return absl::OkStatus();
}

}  // namespace

void to_json(json& j, const PreloadPlan& p) {
  j = json{{"host_resident", p.host_resident}, {"include", p.include}, {"exclude", p.exclude},
           {"tp_size", p.tp_size}, {"tp_rules", p.tp_rules}, {"devices", p.devices}, {"numa_copies", p.numa_copies}};
}

void from_json(const json& j, PreloadPlan& p) {
  if (!j.is_object()) throw json::type_error::create(302, "a preload plan must be an object", &j);
  auto strings = [](const json& value, const std::string& key) {
    if (!value.is_array() || !std::all_of(value.begin(), value.end(), [](const json& v) { return v.is_string(); })) {
      throw json::other_error::create(501, "key '" + key + "' must be a list of strings", &value);
    }
    return value.get<std::vector<std::string>>();
  };
  for (auto& [key, value] : j.items()) {
    if (key == "host_resident") p.host_resident = strings(value, key);
    else if (key == "include") p.include = strings(value, key);
    else if (key == "exclude") p.exclude = strings(value, key);
    else if (key == "tp_rules") p.tp_rules = strings(value, key);
    else if (key == "devices") p.devices = strings(value, key);
    else if (key == "tp_size") p.tp_size = static_cast<uint32_t>(CheckedInteger(value, 1, 1024));
    else if (key == "numa_copies") {
      if (!value.is_boolean()) throw json::other_error::create(501, "key 'numa_copies' must be true or false", &value);
      p.numa_copies = value.get<bool>();
    } else {
      throw json::other_error::create(501, "unknown preload plan key '" + key + "'", &j);
    }
  }
}

std::string DaemonUsage() {
  return "usage: weightd --socket PATH --model-root DIR [--model-root DIR ...] [--metrics-address HOST:PORT]\n"
         "               [--health-address HOST:PORT] [--device-backend auto|cuda|cuda-legacy-ipc|emulated|none]\n"
         "               [--config FILE.json] [--preload NAME=PATH ...] [--fd-socket PATH] [--grpc-address HOST:PORT]\n"
         "               [--grpc-tls-cert PEM --grpc-tls-key PEM [--grpc-tls-client-ca PEM [--grpc-tcp-admin true]]]\n"
         "               [--allowed-gids GID ...] [--lease-claim-timeout-seconds S] [--load-threads N]\n"
         "               [--direct-io auto|on|off] [--mlock true|false] [--huge-pages true|false]\n"
         "               [--fd-socket-max-connections N] [--grpc-max-connections N] [--grpc-max-threads N]\n"
         "               [--grpc-max-streams-per-connection N] [--grpc-first-bytes-timeout-seconds S]\n"
         "               [--self-check-interval-seconds S] [--max-watchers N] [--watch-queue-events N]\n"
         "               [--peer-address HOST:PORT] [--peers HOST:PORT ...] [--peer-max-joiners N]\n"
         "               [--peer-deadline-seconds S] [--peer-helper PATH] [--peer-helper-user USER]\n"
         "               [--peer-helper-sandbox true|false] [--peer-lanes N]\n"
         "               [--peer-verify per-segment|per-transfer]\n"
         "               [--peer-tls-cert PEM --peer-tls-key PEM --peer-tls-ca PEM [--peer-tls-server-name NAME]]\n"
         "               [--print-config] [--version]\n";
}

absl::StatusOr<ParsedArgs> ParseDaemonArgs(const std::vector<std::string>& argv) {
  ParsedArgs parsed;
  json patch = json::object();
  std::string config_file;
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      parsed.help = true;
      continue;
    }
    if (arg == "--print-config") {
      parsed.print_config = true;
      continue;
    }
    if (arg == "--version") {
      parsed.version = true;
      continue;
    }
    if (!absl::StartsWith(arg, "--")) return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    std::string name = arg.substr(2), value;
    size_t eq = name.find('=');
    bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argv.size()) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
    }
    if (name == "config") {
      config_file = value;
      continue;
    }
    std::string key = name;
    std::replace(key.begin(), key.end(), '-', '_');
    if (key == "allowed_gid") key = "allowed_gids";
    if (key == "peer") key = "peers";
    auto kind = Keys().find(key);
    if (kind == Keys().end()) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    WEIGHTD_RETURN_IF_ERROR(AddFlag(patch, name, key, kind->second, value));
  }
  if (!config_file.empty()) {
    WEIGHTD_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(*Env::Default(), config_file, 1 << 20));
    json doc;
    try {
      doc = json::parse(text);
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(config_file, ": not valid JSON: ", e.what()));
    }
    WEIGHTD_RETURN_IF_ERROR(Apply(doc, config_file, parsed.config));
  }
  // Flags win: list-valued flags replace the file's list rather than extend it.
  WEIGHTD_RETURN_IF_ERROR(Apply(patch, "flags", parsed.config));
  WEIGHTD_RETURN_IF_ERROR(Validate(parsed.config));
  return parsed;
}

json ConfigToJson(const DaemonConfig& c) {
  json out = json::object();
  ForEachField(c, [&](const char* key, const auto& field) { out[key] = field; });
  return out;
}

}  // namespace weightd
