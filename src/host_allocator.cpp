// The host allocator (see host_allocator.h, Note [Resident memory and large blocks]).
#include "tandem/host_allocator.h"

#include <malloc.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "detail/cpu_allocators.h"
#include "detail/sanitizers.h"

#if TANDEM_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace tandem {
namespace {

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

// Note [The host allocator under AddressSanitizer]: ASan checks a tensor's bytes where its own
// malloc hands them out: redzones around each block, and freed blocks held in a quarantine. A
// block this allocator maps is not malloc's, so it does ASan's part itself, with ASan's manual
// poisoning: a poisoned page before and after each block, the tail past the bytes asked for, and
// every freed block while it waits in the cache are unaddressable, and an instrumented access to
// them is reported as a use-after-poison. (A stale pointer into a block that the cache has handed
// out again is not caught, as it is not once ASan's quarantine has recycled a block.) The cost
// that made this worth it: ASan maps every large malloc block anew and faults in its pages 4 KiB
// at a time, every step; a ZeRO test spent 30 s of its 47 s of CPU in the kernel (7.3 million
// page faults), 9 s with this allocator (0.8 million).
#if TANDEM_ASAN
size_t guard_bytes() {
  return page_size();
}
void poison(void* p, size_t bytes) {
  ASAN_POISON_MEMORY_REGION(p, bytes);
}
void unpoison(void* p, size_t bytes) {
  ASAN_UNPOISON_MEMORY_REGION(p, bytes);
}
// Before a mapping goes back: its shadow unpoisoned (what the kernel maps at these addresses next
// is addressable; this ASan does not intercept munmap) and its pages given back too, so that the
// shadow of blocks long gone does not stay resident.
void forget(void* base, size_t mapped) {
  size_t scale = 0, offset = 0;
  __asan_get_shadow_mapping(&scale, &offset);
  char* const at = static_cast<char*>(base);
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(at) >> scale) + offset;
  const uintptr_t end = begin + (mapped >> scale);
  const uintptr_t page = page_size();
  const uintptr_t whole_begin = (begin + page - 1) / page * page, whole_end = end / page * page;
  if (whole_begin >= whole_end) {
    unpoison(base, mapped);
    return;
  }
  // The shadow's whole pages given back (they read as zeros again: unpoisoned), the parts of
  // pages at its ends unpoisoned through ASan.
  madvise(reinterpret_cast<void*>(whole_begin), whole_end - whole_begin, MADV_DONTNEED);
  unpoison(at, (whole_begin - begin) << scale);
  unpoison(at + ((whole_end - begin) << scale), (end - whole_end) << scale);
}
#else
size_t guard_bytes() {
  return 0;
}
void poison(void*, size_t) {}
void unpoison(void*, size_t) {}
void forget(void*, size_t) {}
#endif

struct HostState {
  std::mutex mutex;
  std::unordered_map<void*, size_t> live;  // large blocks handed out: their mapped bytes
  // Freed large blocks kept for reuse, oldest first, and by size (exact: a training step asks
  // for the same sizes again). When a freed block does not fit, the oldest make room: the cache
  // follows the phase of the step that runs now (the gradients' sizes in backward, the
  // optimizer's in the step).
  using Entry = std::pair<size_t, void*>;
  std::list<Entry> order;
  std::multimap<size_t, std::list<Entry>::iterator> by_size;
  size_t cached = 0;

  // With the mutex held: the cached block of exactly `bytes`, or nullptr.
  void* take(size_t bytes) {
    auto it = by_size.find(bytes);
    if (it == by_size.end()) return nullptr;
    void* p = it->second->second;
    order.erase(it->second);
    by_size.erase(it);
    cached -= bytes;
    return p;
  }
  // With the mutex held: moves the oldest cached blocks to `evicted` until the cache holds at
  // most `keep` bytes.
  void evict_to(size_t keep, std::vector<Entry>& evicted) {
    while (cached > keep && !order.empty()) {
      const Entry oldest = order.front();
      auto range = by_size.equal_range(oldest.first);
      for (auto it = range.first; it != range.second; ++it)
        if (it->second == order.begin()) {
          by_size.erase(it);
          break;
        }
      order.pop_front();
      cached -= oldest.first;
      evicted.push_back(oldest);
    }
  }
  // With the mutex held: caches `p`, handing back in `evicted` what must be unmapped (the oldest
  // blocks, or `p` itself when it is larger than the whole cache); whether `p` was cached.
  bool put(void* p, size_t bytes, size_t limit, std::vector<Entry>& evicted) {
    if (bytes > limit) {
      evicted.emplace_back(bytes, p);
      return false;
    }
    evict_to(limit - bytes, evicted);
    order.emplace_back(bytes, p);
    by_size.emplace(bytes, std::prev(order.end()));
    cached += bytes;
    return true;
  }
  size_t live_bytes = 0;  // the bytes of `live`
  size_t held_peak = 0;   // the most live_bytes + cached ever reached
  void note_held() { held_peak = std::max(held_peak, live_bytes + cached); }
  std::atomic<size_t> threshold{size_t{1} << 20};
  std::atomic<size_t> cache_limit{size_t{32} << 20};
  std::atomic<c10::Allocator*> base{nullptr};
  std::atomic<int64_t> maps{0}, reuses{0}, unmaps{0};
};

HostState& host() {
  static auto* s = new HostState();  // never destroyed: tensors freed at exit call back into it
  return *s;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

// A block of `bytes` (a multiple of the page size), between poisoned guard pages under
// AddressSanitizer (Note [The host allocator under AddressSanitizer]).
void* map_block(size_t bytes) {
  const size_t mapped = bytes + 2 * guard_bytes();
  char* base = static_cast<char*>(
      mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) return nullptr;
  void* p = base + guard_bytes();
  poison(base, guard_bytes());  // the block itself is poisoned past its bytes when handed out
  poison(static_cast<char*>(p) + bytes, guard_bytes());
  // Two-megabyte pages where the kernel has them to give (THP "madvise"): 512 times fewer
  // faults and TLB entries for the weights, gradients and optimizer state. Marked before the
  // pages exist, then faulted in one call (MAP_POPULATE's work, after the advice; on a kernel
  // without MADV_POPULATE_WRITE the first touch faults them).
  if (bytes >= (size_t{2} << 20)) madvise(base, mapped, MADV_HUGEPAGE);
  madvise(base, mapped, MADV_POPULATE_WRITE);
  return p;
}

void unmap_block(void* p, size_t bytes) {
  char* base = static_cast<char*>(p) - guard_bytes();
  const size_t mapped = bytes + 2 * guard_bytes();
  forget(base, mapped);
  munmap(base, mapped);
  host().unmaps.fetch_add(1);
}

// Frees a block this allocator handed out: a large one to the cache or the operating system,
// a small one (raw_deallocate) to the base allocator.
void release(void* data) {
  if (!data) return;
  auto& h = host();
  bool large = false;
  std::vector<HostState::Entry> evicted;
  {
    std::lock_guard<std::mutex> lock(h.mutex);
    auto it = h.live.find(data);
    if (it != h.live.end()) {
      large = true;
      const size_t bytes = it->second;
      h.live.erase(it);
      h.live_bytes -= bytes;
      // A cached block is unaddressable until it is handed out again (one about to be unmapped
      // is left as it is). Under the mutex: a request may take it the moment it is cached.
      if (h.put(data, bytes, h.cache_limit.load(), evicted)) poison(data, bytes);
    }
  }
  if (!large) {
    if (auto* base = h.base.load()) base->raw_deleter()(data);
    return;
  }
  for (const auto& [bytes, p] : evicted) unmap_block(p, bytes);
}

class HostAllocator final : public compat::Allocator {
 public:
  c10::DataPtr allocate_bytes(size_t n) const override {
    auto& h = host();
    if (n < h.threshold.load()) return h.base.load()->allocate(n);
    const size_t bytes = (n + page_size() - 1) / page_size() * page_size();
    void* p = nullptr;
    std::vector<HostState::Entry> evicted;
    {
      std::lock_guard<std::mutex> lock(h.mutex);
      p = h.take(bytes);
      if (!p) {
        // A miss maps a new block. Where live and cached blocks with it would pass the most this
        // allocator ever held, the oldest cached blocks go back first: the cache never raises
        // the process's peak above what its live blocks reach (Note [Resident memory and large
        // blocks]), and below that peak it keeps all it has.
        const size_t after = h.live_bytes + h.cached + bytes;
        if (after > h.held_peak) {
          const size_t over = after - h.held_peak;
          h.evict_to(h.cached > over ? h.cached - over : 0, evicted);
        }
      }
    }
    for (const auto& [size, block] : evicted) unmap_block(block, size);
    const bool reused = p != nullptr;
    if (reused) h.reuses.fetch_add(1);
    if (!p) {
      p = map_block(bytes);
      if (!p) return h.base.load()->allocate(n);  // no mapping to be had: malloc's turn
      h.maps.fetch_add(1);
    }
    {
      std::lock_guard<std::mutex> lock(h.mutex);
      h.live.emplace(p, bytes);
      h.live_bytes += bytes;
      h.note_held();
    }
    // Under AddressSanitizer the bytes asked for are addressable and the rest of the block is not
    // (a cached block was poisoned whole when it was freed; a fresh one's shadow is clear, and
    // left untouched, not resident).
    poison(static_cast<char*>(p) + n, bytes - n);
    if (reused) unpoison(p, n);
    // The context is the data pointer, as c10::Allocator::raw_allocate requires.
    return c10::DataPtr(p, p, &release, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
};

std::once_flag g_once;
std::atomic<bool> g_installed{false};

}  // namespace

void install_host_allocator(const HostAllocatorOptions& options) {
  auto& h = host();
  h.threshold.store(std::max(options.threshold, page_size()));
  h.cache_limit.store(options.cache_bytes);
  std::call_once(g_once, [&h] {
    static auto* allocator = new HostAllocator();
    if (auto* top = detail::top_cpu_allocator().load()) {
      // Below the counting allocator, which keeps counting every tensor byte.
      h.base.store(top->base());
      top->set_base(allocator);
    } else {
      h.base.store(c10::GetAllocator(c10::DeviceType::CPU));
      c10::SetAllocator(c10::DeviceType::CPU, allocator, /*priority=*/100);
    }
    g_installed = true;
  });
  if (options.cache_bytes == 0) trim_host_cache();
}

bool host_allocator_installed() { return g_installed.load(); }

HostAllocatorStats host_allocator_stats() {
  auto& h = host();
  HostAllocatorStats s;
  {
    std::lock_guard<std::mutex> lock(h.mutex);
    s.cached_bytes = static_cast<int64_t>(h.cached);
    s.mapped_bytes = static_cast<int64_t>(h.live_bytes);
  }
  s.maps = h.maps.load();
  s.reuses = h.reuses.load();
  s.unmaps = h.unmaps.load();
  return s;
}

void trim_host_cache() {
  auto& h = host();
  std::list<HostState::Entry> cache;
  {
    std::lock_guard<std::mutex> lock(h.mutex);
    cache.swap(h.order);
    h.by_size.clear();
    h.cached = 0;
  }
  for (const auto& [bytes, p] : cache) unmap_block(p, bytes);
  // Small blocks live in malloc's heap, where a freed block between live ones stays resident;
  // malloc_trim hands such free pages back (a model built or flattened block by block frees
  // many of them among the small tensors it keeps).
  malloc_trim(0);
}

}  // namespace tandem
