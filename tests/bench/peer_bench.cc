// peer-transport --bytes B [--threads T] [--slot-bytes S] [--slots N]
//                [--helper PATH]: the UCX peer transport alone
// (common/peer/peer_transport.h), no daemon: a memfd of B bytes is exported
// through one weightd-peer-helper and read back through another by T
// threads in 16 MiB reads (a load's read blocks) into memory faulted in
// beforehand, so that what is timed is the transport (helpers, UCX, the
// staging copy) and not page creation. UCX_TLS / UCX_NET_DEVICES come from
// the environment (bench.py sets tcp / lo).
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
  uint64_t bytes = static_cast<uint64_t>(flags.GetInt("bytes", 1 << 30));
  int threads = static_cast<int>(flags.GetInt("threads", 2));
  constexpr uint64_t kBlock = 16ull << 20;
  UcxHelperOptions options;
  options.helper_path = flags.Get("helper", DefaultPeerHelperPath());
  options.slot_bytes = static_cast<uint64_t>(flags.GetInt("slot-bytes", static_cast<long>(options.slot_bytes)));
  options.slots = static_cast<uint32_t>(flags.GetInt("slots", options.slots));
  int fd = memfd_create("weightd-bench-peer", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) return Fail("memfd_create/ftruncate");
  std::vector<char> block(1 << 20);
  for (uint64_t at = 0; at < bytes; at += block.size()) {
    std::memset(block.data(), static_cast<int>(at >> 20), block.size());
    (void)!pwrite(fd, block.data(), std::min<uint64_t>(block.size(), bytes - at), static_cast<off_t>(at));
  }
  auto transport = MakeUcxHelperTransport(options);
  if (!transport.ok()) return Fail(transport.status().ToString());
  auto exported = (*transport)->Export({{fd, bytes}}, {});
  if (!exported.ok()) return Fail(exported.status().ToString());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  auto connection = (*transport)->Connect((*exported)->offer(), deadline);
  if (!connection.ok()) return Fail(connection.status().ToString());
  char* dst = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0));
  if (dst == MAP_FAILED) return Fail("mmap");
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  double start = Now();
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      for (uint64_t at; (at = next.fetch_add(kBlock)) < bytes;) {
        uint64_t n = std::min(kBlock, bytes - at);
        if (!(*connection)->Read({{0, at, n, dst + at}}, deadline).ok()) failed = true;
      }
    });
  }
  for (std::thread& w : workers) w.join();
  double seconds = Now() - start;
  if (failed) return Fail("a peer read failed");
  for (uint64_t at = 0; at < bytes; at += 1 << 20) {
    if (dst[at] != static_cast<char>(at >> 20)) return Fail("the bytes read differ from the export's");
  }
  Emit({{"seconds", seconds}, {"bytes", bytes}, {"gbps", bytes / seconds / 1e9}, {"threads", threads},
        {"slot_bytes", options.slot_bytes}, {"slots", options.slots}});
  return 0;
}

}  // namespace weightd::bench
