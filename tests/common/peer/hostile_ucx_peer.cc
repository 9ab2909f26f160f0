// hostile_ucx_peer: a test-only UCX peer that speaks the seed <-> joiner
// active-message protocol of weightd-peer-helper (common/peer/helper_protocol.h)
// and breaks it on purpose, for tests/common/peer/hostile_peer_test.cc. Not
// part of weightd and never installed. UCX reads its configuration from the
// environment (the tests set UCX_TLS=tcp, UCX_NET_DEVICES=lo).
//
//   hostile_ucx_peer seed MODE
//     A seed that answers every well-formed AmRequest wrongly. Prints its
//     worker address as hex (one line) on stdout, then serves until SIGTERM,
//     SIGINT, its parent's death, or 60 s. MODE:
//       unasked-id  the bytes asked for (zeros), under the id + 1000
//       short       n - 1 bytes under the right id
//       bad-header  a 3-byte header, no data
//       error-code  code 15 (absl DATA_LOSS), no data
//
//   hostile_ucx_peer flood ADDRESS_HEX TOKEN_HEX REGION_BYTES
//                    [--requests N] [--piece BYTES] [--disconnect-after R] [--malformed]
//     A joiner that sends N (200000) requests for PIECE-byte (1 MiB, at most
//     the region) pieces of region 0 in turn, as fast as UCX takes them,
//     through a 4 KiB socket receive buffer; it progresses its worker only
//     while 1024 sends wait, so replies are read late. It never fetches a
//     rendezvous reply (the seed's send stays in flight) and drops the
//     others. With --disconnect-after it _exits as soon as R replies have
//     arrived, closing no endpoint: the kernel drops its sockets under the
//     seed's replies in flight. Otherwise, once every request is out, it
//     reads replies until none came for 200 ms, closes its endpoint and
//     exits. --malformed: every other request is one byte short, the others
//     carry 8 bytes of data. Prints `requests=S replies=R rendezvous=V` on
//     stdout. Exit status 0; 2 on a usage or UCX error; 3 when fewer than R
//     replies came within 10 s.
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/peer/helper_protocol.h"

namespace weightd::peer_helper {
namespace {

using Clock = std::chrono::steady_clock;

volatile sig_atomic_t g_stop = 0;

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "hostile_ucx_peer: %s\n", why.c_str());
  _exit(2);
}

void Check(ucs_status_t status, const char* what) {
  if (status != UCS_OK) Die(absl::StrCat(what, ": ", ucs_status_string(status)));
}

ucp_worker_h StartWorker(uint64_t features) {
  ucp_config_t* config = nullptr;
  Check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = features;
  ucp_context_h context = nullptr;
  Check(ucp_init(&params, config, &context), "ucp_init");
  ucp_config_release(config);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  Check(ucp_worker_create(context, &wp, &worker), "ucp_worker_create");
  return worker;  // both live until the process exits
}

void SetHandler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                 UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  p.id = id;
  p.cb = cb;
  p.arg = arg;
  p.flags = UCP_AM_FLAG_WHOLE_MSG;
  Check(ucp_worker_set_am_recv_handler(worker, &p), "ucp_worker_set_am_recv_handler");
}

bool ParseHex(const std::string& hex, std::string* bytes) {
  if (hex.empty() || hex.size() % 2 != 0) return false;
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  *bytes = absl::HexStringToBytes(hex);
  return true;
}

// ---- seed ----

enum class Mode { kUnaskedId, kShort, kBadHeader, kErrorCode };

struct Ask {
  ucp_ep_h ep;
  AmRequest request;
};

// A reply on the wire: UCX needs its header and data until the send completes.
struct Reply {
  AmReply header;
  std::string data;
};

void OnReplySent(void* request, ucs_status_t, void* user_data) {
  delete static_cast<Reply*>(user_data);
  ucp_request_free(request);
}

// Requests are answered outside the callback, as the real seed does.
ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void*, size_t,
                       const ucp_am_recv_param_t* param) {
  if (header_length == sizeof(AmRequest) && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    Ask ask{param->reply_ep, {}};
    std::memcpy(&ask.request, header, sizeof ask.request);
    static_cast<std::deque<Ask>*>(arg)->push_back(ask);
  }
  return UCS_OK;
}

void Answer(Mode mode, const Ask& ask) {
  auto* reply = new Reply{{ask.request.id, 0, 0}, {}};
  size_t header_bytes = sizeof reply->header;
  const uint64_t n = std::min<uint64_t>(ask.request.n, kMaxPieceBytes);
  switch (mode) {
    case Mode::kUnaskedId:
      reply->header.id += 1000;
      reply->data.assign(n, '\0');
      break;
    case Mode::kShort:
      reply->data.assign(n > 0 ? n - 1 : 0, '\0');
      break;
    case Mode::kBadHeader:
      header_bytes = 3;
      break;
    case Mode::kErrorCode:
      reply->header.code = 15;  // absl::StatusCode::kDataLoss
      break;
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &OnReplySent;
  param.user_data = reply;
  ucs_status_ptr_t sp =
      ucp_am_send_nbx(ask.ep, kAmReply, &reply->header, header_bytes, reply->data.data(), reply->data.size(), &param);
  if (!UCS_PTR_IS_PTR(sp)) delete reply;  // sent at once, or that joiner is gone
}

int RunSeed(Mode mode) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  ucp_worker_h worker = StartWorker(UCP_FEATURE_AM | UCP_FEATURE_WAKEUP);
  std::deque<Ask> asks;
  SetHandler(worker, kAmRequest, &OnRequest, &asks);
  ucp_address_t* address = nullptr;
  size_t length = 0;
  Check(ucp_worker_get_address(worker, &address, &length), "ucp_worker_get_address");
  std::printf("%s\n", absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(address), length)).c_str());
  std::fflush(stdout);
  ucp_worker_release_address(worker, address);
  int efd = -1;
  Check(ucp_worker_get_efd(worker, &efd), "ucp_worker_get_efd");
  const Clock::time_point until = Clock::now() + std::chrono::seconds(60);
  while (g_stop == 0 && Clock::now() < until) {
    while (ucp_worker_progress(worker) != 0) {
    }
    for (; !asks.empty(); asks.pop_front()) Answer(mode, asks.front());
    if (ucp_worker_arm(worker) == UCS_ERR_BUSY) continue;
    pollfd p{efd, POLLIN, 0};
    poll(&p, 1, 100);
  }
  return 0;
}

// ---- flood ----

struct FloodOptions {
  uint64_t requests = 200000;
  uint64_t piece = 1 << 20;
  uint64_t disconnect_after = 0;
  bool malformed = false;
};

struct Flood {
  FloodOptions options;
  uint64_t requests = 0;
  uint64_t waiting = 0;  // sends UCX has not completed
  uint64_t replies = 0;
  uint64_t rendezvous = 0;
  bool failed = false;
};

void Report(const Flood& f) {
  std::printf("requests=%llu replies=%llu rendezvous=%llu\n", static_cast<unsigned long long>(f.requests),
              static_cast<unsigned long long>(f.replies), static_cast<unsigned long long>(f.rendezvous));
  std::fflush(stdout);
}

ucs_status_t OnReply(void* arg, const void*, size_t, void*, size_t, const ucp_am_recv_param_t* param) {
  auto& f = *static_cast<Flood*>(arg);
  ++f.replies;
  if (f.options.disconnect_after != 0 && f.replies >= f.options.disconnect_after) {
    Report(f);
    _exit(0);  // no ucp_ep_close: the seed learns from its sockets
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    ++f.rendezvous;
    return UCS_INPROGRESS;  // kept, never fetched: the seed's send stays in flight
  }
  return UCS_OK;
}

void OnRequestSent(void* request, ucs_status_t, void* user_data) {
  --static_cast<Flood*>(user_data)->waiting;
  ucp_request_free(request);
}

void OnEndpointError(void* arg, ucp_ep_h, ucs_status_t) { static_cast<Flood*>(arg)->failed = true; }

ucp_ep_h ConnectTo(ucp_worker_h worker, const std::string& address, Flood& flood) {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(address.data());
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &OnEndpointError;
  p.err_handler.arg = &flood;
  ucp_ep_h ep = nullptr;
  Check(ucp_ep_create(worker, &p, &ep), "ucp_ep_create");
  return ep;
}

// Sends `r` (which must outlive the send); --malformed: every other one
// one byte short, the others with 8 bytes of data.
bool Send(ucp_ep_h ep, const AmRequest& r, Flood& flood) {
  static const char kJunk[8] = {};
  const bool odd = r.id % 2 != 0;
  const size_t header_bytes = flood.options.malformed && !odd ? sizeof r - 1 : sizeof r;
  const size_t data_bytes = flood.options.malformed && odd ? sizeof kJunk : 0;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &OnRequestSent;
  param.user_data = &flood;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, kAmRequest, &r, header_bytes, kJunk, data_bytes, &param);
  if (UCS_PTR_IS_ERR(sp)) return false;  // the seed is gone
  ++flood.requests;
  if (sp != nullptr) ++flood.waiting;
  return true;
}

// Progresses `worker` until the request `sp` completes or `until`.
void Wait(ucp_worker_h worker, ucs_status_ptr_t sp, Clock::time_point until) {
  if (!UCS_PTR_IS_PTR(sp)) return;
  while (ucp_request_check_status(sp) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker);
  ucp_request_free(sp);
}

// Every request reaches the seed; what it answers is read until it has
// been quiet for 200 ms; then the endpoint is closed.
void Drain(ucp_worker_h worker, ucp_ep_h ep, Flood& flood, Clock::time_point until) {
  const ucp_request_param_t none{};
  Wait(worker, ucp_ep_flush_nbx(ep, &none), until);
  for (uint64_t seen = ~0ull; seen != flood.replies && Clock::now() < until;) {
    seen = flood.replies;
    for (auto quiet = Clock::now() + std::chrono::milliseconds(200); Clock::now() < quiet;) ucp_worker_progress(worker);
  }
  Wait(worker, ucp_ep_close_nbx(ep, &none), until);
}

[[noreturn]] void RunFlood(const std::string& address, const std::string& token, uint64_t region_bytes,
                           const FloodOptions& options) {
  Flood flood{options};
  // A small receive buffer: the seed's replies back up on its side while
  // requests still flow (its own sockets are sized by UCX as usual).
  setenv("UCX_TCP_RCVBUF", "4k", 1);
  ucp_worker_h worker = StartWorker(UCP_FEATURE_AM);
  SetHandler(worker, kAmReply, &OnReply, &flood);
  ucp_ep_h ep = ConnectTo(worker, address, flood);
  const uint64_t piece = std::min(options.piece, region_bytes);
  std::vector<AmRequest> asks(options.requests);
  const Clock::time_point until = Clock::now() + std::chrono::seconds(10);
  auto progress_while = [&](auto busy) {
    while (busy() && !flood.failed && Clock::now() < until) ucp_worker_progress(worker);
  };
  for (uint64_t i = 0; i < asks.size() && !flood.failed && Clock::now() < until; ++i) {
    AmRequest& r = asks[i];
    std::memcpy(r.token, token.data(), kTokenBytes);
    r.id = i + 1;
    r.offset = i % (region_bytes / piece) * piece;
    r.n = piece;
    if (!Send(ep, r, flood)) break;
    progress_while([&] { return flood.waiting >= 1024; });
  }
  progress_while([&] { return flood.waiting > 0 || flood.replies < options.disconnect_after; });
  if (options.disconnect_after == 0) Drain(worker, ep, flood, until);
  Report(flood);
  _exit(flood.replies < options.disconnect_after ? 3 : 0);
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  struct sigaction sa {};
  sa.sa_handler = [](int) { g_stop = 1; };
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  if (args.size() == 2 && args[0] == "seed") {
    if (args[1] == "unasked-id") return RunSeed(Mode::kUnaskedId);
    if (args[1] == "short") return RunSeed(Mode::kShort);
    if (args[1] == "bad-header") return RunSeed(Mode::kBadHeader);
    if (args[1] == "error-code") return RunSeed(Mode::kErrorCode);
  }
  std::string address, token;
  uint64_t region_bytes = 0;
  FloodOptions options;
  bool ok = args.size() >= 4 && args[0] == "flood" && ParseHex(args[1], &address) && ParseHex(args[2], &token) &&
            token.size() == kTokenBytes && absl::SimpleAtoi(args[3], &region_bytes) && region_bytes > 0;
  for (size_t i = 4; ok && i < args.size(); ++i) {
    uint64_t* value = args[i] == "--requests"           ? &options.requests
                      : args[i] == "--piece"            ? &options.piece
                      : args[i] == "--disconnect-after" ? &options.disconnect_after
                                                        : nullptr;
    if (args[i] == "--malformed") {
      options.malformed = true;
    } else {
      ok = value != nullptr && ++i < args.size() && absl::SimpleAtoi(args[i], value);
    }
  }
  if (!ok || options.piece == 0) {
    Die("usage: hostile_ucx_peer seed unasked-id|short|bad-header|error-code\n"
        "       hostile_ucx_peer flood ADDRESS_HEX TOKEN_HEX REGION_BYTES [--requests N] [--piece BYTES] "
        "[--disconnect-after R] [--malformed]");
  }
  RunFlood(address, token, region_bytes, options);
}

}  // namespace
}  // namespace weightd::peer_helper

int main(int argc, char** argv) { return weightd::peer_helper::Main(argc, argv); }
