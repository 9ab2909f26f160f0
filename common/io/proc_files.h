// Reading the kernel's pseudo-files (/proc, /sys). They report a size of 0
// or 4096 whatever they hold, so they are read until end of file, with a
// bound, rather than by their stat size (which Env's ReadSmallFile trusts).
#ifndef WEIGHTD_COMMON_IO_PROC_FILES_H_
#define WEIGHTD_COMMON_IO_PROC_FILES_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

// The whole of `path`, read until end of file. NOT_FOUND when it does not
// exist (errno's text otherwise); INVALID_ARGUMENT when it holds more than
// `max_bytes` bytes. Thread-safe.
absl::StatusOr<std::string> ReadPseudoFile(const std::string& path, uint64_t max_bytes = 1 << 20);

// /proc/meminfo's lines ("MemAvailable:   123 kB", "HugePages_Free: 4"):
// key without the colon -> value, multiplied by 1024 when the unit is kB
// (so bytes), as written otherwise (page counts). Malformed lines are
// skipped. Source: proc(5), /proc/meminfo.
std::map<std::string, uint64_t> ParseMeminfo(absl::string_view text);

// ParseMeminfo(ReadPseudoFile(path))[key], or nullopt when the file cannot
// be read or has no such key.
std::optional<uint64_t> MeminfoValue(absl::string_view key, const std::string& path = "/proc/meminfo");

// /proc/PID/smaps: for each mapping, its start address -> the value of
// `field` ("ShmemPmdMapped", "Rss", ...) in bytes (the file gives kB).
// Mappings without the field are left out. Source: proc(5), /proc/PID/smaps.
std::map<uint64_t, uint64_t> ParseSmapsField(absl::string_view text, absl::string_view field);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_IO_PROC_FILES_H_
