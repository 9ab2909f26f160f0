// How much host memory this process may still allocate: the smaller of the
// node's MemAvailable and, for every memory cgroup level above the process,
// its limit minus its working set. Inside a container /proc/meminfo shows
// the host, not the container's limit, so the cgroup is what the OOM killer
// enforces (the shipped Kubernetes manifests set a memory limit).
//
// Sources: proc(5) (/proc/meminfo MemAvailable, /proc/self/cgroup,
// /proc/self/mountinfo); the kernel's cgroup-v2.rst (memory.max, "max" =
// no limit; memory.current; memory.stat inactive_file) and cgroup-v1
// memory.rst (memory.limit_in_bytes, memory.usage_in_bytes, memory.stat
// total_inactive_file; a limit >= 2^62 means none). The working set is usage
// minus inactive file pages, the rule the kubelet uses for eviction: clean
// page cache (a checkpoint just read) is reclaimed before anything is
// OOM-killed, so it is not counted as used. memory.high (v2) throttles
// rather than kills and is not counted.
#ifndef WEIGHTD_COMMON_IO_HOST_MEMORY_H_
#define WEIGHTD_COMMON_IO_HOST_MEMORY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace weightd {

// Where the kernel's files are read from; tests point these into a fake tree.
struct HostMemoryPaths {
  std::string meminfo = "/proc/meminfo";
  std::string self_cgroup = "/proc/self/cgroup";
  std::string self_mountinfo = "/proc/self/mountinfo";
  std::string sys_root;  // put before every mount point from mountinfo ("" on a real system)
};

// One memory cgroup directory the process is charged to, innermost first.
struct MemoryCgroup {
  int version = 2;      // 1 or 2
  std::string dir;      // e.g. /sys/fs/cgroup/kubepods.slice/pod.../container...
};

// The memory cgroup directories from the process's own cgroup up to the
// root of its hierarchy (v2, else v1's memory controller), innermost first;
// empty when the process is in no memory cgroup that this mount namespace
// can see. Errors only when /proc/self/cgroup or mountinfo cannot be read.
absl::StatusOr<std::vector<MemoryCgroup>> FindMemoryCgroups(const HostMemoryPaths& paths = {});

struct HostMemoryBudget {
  uint64_t available = 0;  // bytes this process may still allocate
  // What bounded it, for messages: "MemAvailable" or
  // "cgroup v1 /sys/fs/cgroup/memory/x: limit 100663296, working set 5193728".
  std::string source;
};

// The budget described at the top of this file. A cgroup level whose files
// are missing or unreadable is skipped (it cannot be enforced on us without
// them); NOT_FOUND only when MemAvailable itself cannot be read.
// Thread-safe.
absl::StatusOr<HostMemoryBudget> ReadHostMemoryBudget(const HostMemoryPaths& paths = {});

}  // namespace weightd

#endif  // WEIGHTD_COMMON_IO_HOST_MEMORY_H_
