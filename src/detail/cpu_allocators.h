// Where tandem's CPU allocators meet (Note [Resident memory and large blocks]): the counting
// allocator (track/cpu_memory.h) sits on top of LibTorch's CPU allocator when installed, the
// host allocator (host_allocator.h) below it. They find each other here, below both, so that
// neither layer includes the other.
#pragma once

#include <atomic>

#include "compat/allocator.h"

namespace tandem::detail {

/// An allocator that forwards to another one, which can be replaced while it runs.
class ForwardingAllocator : public compat::Allocator {
 public:
  virtual c10::Allocator* base() const = 0;
  virtual void set_base(c10::Allocator* base) = 0;
};

/// The forwarding allocator installed on top of LibTorch's CPU allocator (the counting
/// allocator), or nullptr: an allocator installed later goes below it.
inline std::atomic<ForwardingAllocator*>& top_cpu_allocator() {
  static std::atomic<ForwardingAllocator*> top{nullptr};
  return top;
}

}  // namespace tandem::detail
