// peer-transport --bytes B [--lanes L] [--senders K] [--segments S] [--piece-bytes P]
//                [--pieces N] [--helper PATH]: the UCX peer transport
// alone (common/peer/peer_transport.h), no daemon: a memfd of B bytes is
// exported through K weightd-peer-helpers (senders; default L, as a seed
// answers a joiner of L lanes) and received, as a joiner
// receives, straight into S size-sealed destination memfds (a load's host
// segments) by L lanes of helpers, each destination released once its
// bytes are in; `lanes + 1` threads drive the reads. The destinations'
// pages are allocated beforehand (fallocate), so that what is timed is the
// transport (helpers, UCX, one copy from the socket, the helpers' page
// table faults) and not page creation. UCX_TLS / UCX_NET_DEVICES come from
// the environment (bench.py sets tcp / lo).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "common/peer/peer_transport.h"
#include "tests/bench/subcommands.h"

namespace weightd::bench {

int PeerTransportCommand(const Flags& flags) {
  const uint64_t bytes = static_cast<uint64_t>(flags.GetInt("bytes", 1 << 30));
  const uint32_t lanes = static_cast<uint32_t>(flags.GetInt("lanes", 1));
  PeerExportOptions export_options;
  export_options.senders = static_cast<uint32_t>(flags.GetInt("senders", lanes));
  const uint64_t segments =
      static_cast<uint64_t>(flags.GetInt("segments", static_cast<long>(std::max<uint64_t>(1, bytes >> 27))));
  UcxHelperOptions options;
  options.helper_path = flags.Get("helper", DefaultPeerHelperPath());
  options.piece_bytes = static_cast<uint64_t>(flags.GetInt("piece-bytes", static_cast<long>(options.piece_bytes)));
  options.pieces = static_cast<uint32_t>(flags.GetInt("pieces", options.pieces));
  int fd = memfd_create("weightd-bench-peer", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) return Fail("memfd_create/ftruncate");
  std::vector<char> block(1 << 20);
  for (uint64_t at = 0; at < bytes; at += block.size()) {
    std::memset(block.data(), static_cast<int>(at >> 20), block.size());
    (void)!pwrite(fd, block.data(), std::min<uint64_t>(block.size(), bytes - at), static_cast<off_t>(at));
  }
  const uint64_t per = (bytes + segments - 1) / segments;
  PeerConnectOptions connect;
  connect.lanes = lanes;
  std::vector<int> dst;
  for (uint64_t s = 0; s < segments; ++s) {
    uint64_t n = std::min(per, bytes - std::min(bytes, s * per));
    int d = memfd_create("weightd-bench-peer-dst", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (d < 0 || ftruncate(d, static_cast<off_t>(n)) != 0 || (n > 0 && fallocate(d, 0, 0, static_cast<off_t>(n)) != 0) ||
        fcntl(d, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
      return Fail("destination memfd");
    }
    dst.push_back(d);
    connect.destinations.push_back({d, n});
  }
  auto transport = MakeUcxHelperTransport(options);
  if (!transport.ok()) return Fail(transport.status().ToString());
  auto exported = (*transport)->Export({{fd, bytes}}, export_options);
  if (!exported.ok()) return Fail(exported.status().ToString());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  double start = Now();  // connecting the lanes (starting their helpers) counts: a transfer pays it
  auto connection = (*transport)->Connect((*exported)->offer(), deadline, connect);
  if (!connection.ok()) return Fail(connection.status().ToString());
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<std::thread> workers;
  for (uint32_t t = 0; t < lanes + 1; ++t) {
    workers.emplace_back([&] {
      for (uint64_t s; (s = next.fetch_add(1)) < segments;) {
        uint64_t n = connect.destinations[s].size;
        uint32_t i = static_cast<uint32_t>(s);
        if (n > 0 && !(*connection)->Read({{0, s * per, n, i, 0}}, deadline).ok()) failed = true;
        if (!(*connection)->Release(i, deadline).ok()) failed = true;
      }
    });
  }
  for (std::thread& w : workers) w.join();
  connection->reset();
  double seconds = Now() - start;
  if (failed) return Fail("a peer read failed");
  for (uint64_t s = 0; s < segments; ++s) {
    char c;
    for (uint64_t at = 0; at < connect.destinations[s].size; at += 1 << 20) {
      if (pread(dst[s], &c, 1, static_cast<off_t>(at)) != 1 || c != static_cast<char>((s * per + at) >> 20)) {
        return Fail("the bytes received differ from the export's");
      }
    }
    close(dst[s]);
  }
  Emit({{"seconds", seconds}, {"bytes", bytes}, {"gbps", bytes / seconds / 1e9}, {"lanes", lanes}, {"senders", export_options.senders},
        {"segments", segments}, {"piece_bytes", options.piece_bytes}, {"pieces", options.pieces}});
  return 0;
}

}  // namespace weightd::bench
