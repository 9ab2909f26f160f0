// weightd_bench SUBCOMMAND [--flag value ...]: the measuring half of the
// benchmarks (tests/bench/run.sh drives it and prints the table).
#include <map>
#include <string>

#include "tests/bench/subcommands.h"

int main(int argc, char** argv) {
  using namespace weightd::bench;
  static const std::map<std::string, int (*)(const Flags&)> kCommands = {
      {"load", LoadCommand},           {"read-malloc", ReadMallocCommand},
      {"memfd-fill", MemfdFillCommand},
      {"peer-transport", PeerTransportCommand},
      {"fill-files", FillFilesCommand},
      {"attach", AttachCommand},       {"self-map", SelfMapCommand},
      {"concurrent", ConcurrentCommand}, {"hold", HoldCommand},
      {"restart", RestartCommand},     {"make-checkpoint", MakeCheckpointCommand},
      {"catalog", CatalogCommand},
      {"publish", PublishCommand},     {"shm-copy", ShmCopyCommand},
      {"reload", ReloadCommand},       {"publish-watch", PublishWatchCommand},
      {"touch", TouchCommand},
  };
  auto it = argc > 1 ? kCommands.find(argv[1]) : kCommands.end();
  if (it == kCommands.end()) {
    return Fail("usage: weightd_bench load|read-malloc|memfd-fill|fill-files|peer-transport|attach|self-map|concurrent|hold|restart|make-checkpoint|catalog|publish|shm-copy|reload|publish-watch|touch ...");
  }
  return it->second(Flags(argc - 1, argv + 1));
}
