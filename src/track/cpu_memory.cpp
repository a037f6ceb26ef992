// The counting CPU allocator (see cpu_memory.h).
#include "tandem/track/cpu_memory.h"

#include <atomic>
#include <fstream>
#include <string>
#include <mutex>
#include <unordered_map>

#include "../detail/cpu_allocators.h"

namespace tandem::track {
namespace {

std::atomic<int64_t> g_current{0}, g_peak{0}, g_allocations{0};

// Note [Counted allocations]: the DataPtr handed out has the data pointer as its context (what
// c10::Allocator::raw_allocate, used by oneDNN's kernels, requires), and the original DataPtr
// and size wait in a table keyed by that pointer until release() gives them back.
struct Counted {
  c10::DataPtr original;
  size_t bytes;
};
std::mutex g_mutex;
std::unordered_map<void*, Counted>& table() {
  static auto* t = new std::unordered_map<void*, Counted>();  // never destroyed (frees at exit)
  return *t;
}

void release(void* data) {
  if (!data) return;
  c10::DataPtr original;  // freed through its own deleter, outside the lock
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = table().find(data);
    if (it == table().end()) return;
    g_current.fetch_sub(static_cast<int64_t>(it->second.bytes));
    original = std::move(it->second.original);
    table().erase(it);
  }
}

class CountingAllocator final : public ::tandem::detail::ForwardingAllocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate_bytes(size_t n) const override {
    c10::DataPtr dp = base_.load()->allocate(n);
    void* data = dp.get();
    const auto device = dp.device();
    if (!data) return dp;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      table().emplace(data, Counted{std::move(dp), n});
    }
    const int64_t now = g_current.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
    }
    g_allocations.fetch_add(1);
    return c10::DataPtr(data, data, &release, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  c10::Allocator* base() const override { return base_.load(); }
  void set_base(c10::Allocator* base) override { base_.store(base); }

 private:
  std::atomic<c10::Allocator*> base_;
};

std::once_flag g_once;
std::atomic<bool> g_installed{false};
CountingAllocator* g_counting = nullptr;

}  // namespace

void install_counting_cpu_allocator() {
  std::call_once(g_once, [] {
    // Never destroyed: tensors freed at exit still call back into it.
    g_counting = new CountingAllocator(c10::GetAllocator(c10::DeviceType::CPU));
    c10::SetAllocator(c10::DeviceType::CPU, g_counting, /*priority=*/100);
    ::tandem::detail::top_cpu_allocator().store(g_counting);
    g_installed = true;
  });
}

bool counting_cpu_allocator_installed() { return g_installed.load(); }

CpuMemoryStats cpu_memory_stats() {
  return {g_current.load(), g_peak.load(), g_allocations.load()};
}

void reset_peak_cpu_memory() { g_peak.store(g_current.load()); }

ResidentMemory resident_memory() {
  ResidentMemory m;
  std::ifstream status("/proc/self/status");
  std::string line;
  auto field = [&line](const char* key) -> int64_t {
    const std::string k(key);
    return line.rfind(k, 0) == 0 ? std::stoll(line.substr(k.size())) * 1024 : -1;  // kB
  };
  while (std::getline(status, line)) {
    if (auto v = field("VmRSS:"); v >= 0) m.current_bytes = v;
    if (auto v = field("VmHWM:"); v >= 0) m.peak_bytes = v;
    if (auto v = field("RssFile:"); v >= 0) m.file_bytes = v;
  }
  return m;
}

}  // namespace tandem::track
