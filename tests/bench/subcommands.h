// The subcommands of weightd_bench; each prints one JSON document on stdout
// and returns the exit status. tests/bench/bench.py runs them.
#ifndef WEIGHTD_TESTS_BENCH_SUBCOMMANDS_H_
#define WEIGHTD_TESTS_BENCH_SUBCOMMANDS_H_

#include "tests/bench/bench_util.h"

namespace weightd::bench {

int LoadCommand(const Flags& flags);
int ReadMallocCommand(const Flags& flags);
int MemfdFillCommand(const Flags& flags);
int AttachCommand(const Flags& flags);
int SelfMapCommand(const Flags& flags);
int ConcurrentCommand(const Flags& flags);
int HoldCommand(const Flags& flags);
int TouchCommand(const Flags& flags);
int RestartCommand(const Flags& flags);
int MakeCheckpointCommand(const Flags& flags);
int CatalogCommand(const Flags& flags);
int PublishCommand(const Flags& flags);
int ShmCopyCommand(const Flags& flags);
int ReloadCommand(const Flags& flags);
int PublishWatchCommand(const Flags& flags);
int FillFilesCommand(const Flags& flags);
int PeerTransportCommand(const Flags& flags);

}  // namespace weightd::bench

#endif  // WEIGHTD_TESTS_BENCH_SUBCOMMANDS_H_
