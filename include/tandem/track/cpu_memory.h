// Exact CPU tensor memory: a counting allocator in front of LibTorch's CPU allocator, for
// memory tests, benchmarks and `memory_stats`-style reports on the CPU (what
// torch.cuda.max_memory_allocated is on a GPU).
#pragma once

#include <cstdint>

namespace tandem::track {

/// Bytes of CPU tensor storage allocated since the counting allocator was installed.
struct CpuMemoryStats {
  int64_t current_bytes = 0;  ///< allocated and not yet freed
  int64_t peak_bytes = 0;     ///< the most current_bytes has been (since the last reset)
  int64_t allocations = 0;    ///< number of allocations
};

/// Puts the counting allocator in front of the CPU allocator in use. Only storage allocated
/// afterwards is counted, so install it first (before building the model). Idempotent.
///
/// Example:
///   tandem::track::install_counting_cpu_allocator();
///   auto model = Net();  // counted from here on
///   ...
///   std::cout << tandem::track::cpu_memory_stats().peak_bytes << "\n";
void install_counting_cpu_allocator();
/// Whether install_counting_cpu_allocator() was called in this process.
bool counting_cpu_allocator_installed();
/// The counts so far (all zero before install).
CpuMemoryStats cpu_memory_stats();
/// Starts a new peak from the current bytes.
void reset_peak_cpu_memory();

/// What the operating system sees of this process (/proc/self/status): resident memory now
/// (VmRSS), its peak since the process started (VmHWM), and the part of it now that maps files
/// (RssFile: the libraries' code and data pages, which grow as their functions are first run),
/// in bytes; -1 where the system does not say (not Linux).
struct ResidentMemory {
  int64_t current_bytes = -1;
  int64_t peak_bytes = -1;
  int64_t file_bytes = -1;
};
ResidentMemory resident_memory();

}  // namespace tandem::track
