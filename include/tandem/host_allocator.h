// The host allocator: large CPU tensor blocks that the operating system sees freed.
//
// Note [Resident memory and large blocks]: glibc's malloc serves a block at or above its mmap
// threshold with mmap and returns it on free, but it raises that threshold to the size of every
// mmapped block freed (up to 32 MiB). After the first large tensor is freed (a dense weight
// replaced by its ZeRO shard, a temporary of the optimizer step), every later block of that size
// comes from the heap, where small allocations split the freed blocks, and what is freed stays
// resident: a ZeRO-3 rank measured 3.3x its tensor bytes above the library's baseline, and
// `prepare` kept every unit's flattening copy. A fixed low threshold gives the memory back but
// costs a page fault for every 4 KiB of every large block, every step (a ZeRO-3 step took twice
// as long).
//
// This allocator serves blocks of at least `threshold` bytes with mmap itself (the pages
// prefaulted in one call, and eligible for transparent huge pages) and returns them to the
// operating system on free, except for a bounded cache of freed blocks that a request of the same
// size takes again, so that a training loop, which asks for the same sizes every step, faults no
// pages after its first. Smaller blocks go to the allocator that was in place.
//
// The cache must not raise the peak: freed blocks of one phase (the gradients of a backward)
// would otherwise sit resident while the next phase (the optimizer step) maps its own, and the
// process's peak would be its live blocks' peak plus a full cache (ZeRO-2 on 4 ranks measured
// 1.16x its formula, ZeRO-3 1.09x). So a miss that would take live and cached blocks together
// past the most they ever held first gives back that much of the cache, the oldest blocks
// first; below that mark the cache keeps all it has. Resident memory then peaks where the live
// blocks peak (ZeRO-2 1.09x with the libraries' pages, 1.04x without; speed unchanged, 18 maps
// per step for ZeRO-3 against 14).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem {

/// The host allocator's settings (AcceleratorOptions::host_allocator_cache_mb, TANDEM_HOST_CACHE_MB).
struct HostAllocatorOptions {
  /// Blocks of at least this many bytes are mapped by the allocator.
  size_t threshold = size_t{1} << 20;
  /// The most bytes of freed blocks kept for reuse; 0 keeps none.
  size_t cache_bytes = size_t{32} << 20;
};

/// What the host allocator has done in this process.
struct HostAllocatorStats {
  int64_t mapped_bytes = 0;   ///< large blocks handed out and not yet freed
  int64_t cached_bytes = 0;   ///< freed large blocks kept for reuse
  int64_t maps = 0;           ///< large blocks mapped anew
  int64_t reuses = 0;         ///< large blocks taken from the cache
  int64_t unmaps = 0;         ///< large blocks given back to the operating system
};

/// Puts the host allocator in front of the CPU allocator (below tandem's counting allocator when
/// that is installed, so that tensor bytes are still counted). Later calls change the settings;
/// blocks allocated before stay with the allocator that made them. The Accelerator installs it.
void install_host_allocator(const HostAllocatorOptions& options = {});
/// Whether install_host_allocator() was called in this process.
bool host_allocator_installed();
/// The counts so far.
HostAllocatorStats host_allocator_stats();
/// Gives every cached block back to the operating system (the Accelerator calls it after
/// `prepare` and `load_state`, whose sizes a training step does not ask for again).
void trim_host_cache();

}  // namespace tandem
