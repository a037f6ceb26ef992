// The host allocator (Note [Resident memory and large blocks]): large blocks are mapped and given
// back to the operating system, a bounded cache of freed blocks serves the same size again, the
// oldest cached blocks make room for newer ones, small blocks stay with malloc, and tandem's
// counting allocator keeps counting every byte above it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <string>
#include <vector>

#include "../common/sanitizers.h"
#include "tandem/host_allocator.h"
#include "tandem/track/cpu_memory.h"

namespace {

int64_t rss_kb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  return -1;
}

constexpr int64_t kMiB = 1 << 20;

tandem::HostAllocatorOptions cache_of(int64_t mb) {
  tandem::HostAllocatorOptions o;
  o.cache_bytes = static_cast<size_t>(mb * kMiB);
  return o;
}

TEST(HostAllocator, LargeBlocksAreMappedCachedAndGivenBack) {
  tandem::install_host_allocator(cache_of(16));
  ASSERT_TRUE(tandem::host_allocator_installed());
  const auto before = tandem::host_allocator_stats();
  {
    auto t = torch::ones({8 * kMiB / 4});  // 8 MiB
    EXPECT_EQ(t.sum().item<double>(), 8.0 * kMiB / 4);
    const auto mapped = tandem::host_allocator_stats();
    EXPECT_EQ(mapped.maps, before.maps + 1);
    EXPECT_EQ(mapped.mapped_bytes, before.mapped_bytes + 8 * kMiB);
  }
  // Freed into the cache; the same size again takes it back without a new mapping.
  auto cached = tandem::host_allocator_stats();
  EXPECT_EQ(cached.cached_bytes, 8 * kMiB);
  {
    auto t = torch::zeros({8 * kMiB / 4});
    EXPECT_EQ(t.max().item<double>(), 0.0);  // a reused block holds what it is given
    EXPECT_EQ(t.min().item<double>(), 0.0);
    const auto again = tandem::host_allocator_stats();
    EXPECT_EQ(again.maps, cached.maps);
    EXPECT_EQ(again.reuses, cached.reuses + 1);
  }
  // A block larger than the cache goes back to the operating system at once, and so do the
  // cached ones on trim: the process's resident memory falls by them.
  const int64_t rss_before = rss_kb();
  {
    auto big = torch::ones({64 * kMiB / 4});
    // Its pages less the cached 8 MiB block, given back to make room at this new peak.
    EXPECT_GE(rss_kb() - rss_before, 52 * 1024);
  }
  EXPECT_LE(rss_kb() - rss_before, 8 * 1024);
  tandem::trim_host_cache();
  EXPECT_EQ(tandem::host_allocator_stats().cached_bytes, 0);
  // Small blocks are malloc's.
  const auto small_before = tandem::host_allocator_stats();
  auto small = torch::ones({1024});
  EXPECT_EQ(tandem::host_allocator_stats().maps, small_before.maps);
}

TEST(HostAllocator, TheOldestCachedBlocksMakeRoom) {
  tandem::install_host_allocator(cache_of(8));
  tandem::trim_host_cache();
  {
    auto a = torch::empty({2 * kMiB / 4}), b = torch::empty({2 * kMiB / 4});
    auto c = torch::empty({2 * kMiB / 4}), d = torch::empty({2 * kMiB / 4});
  }
  EXPECT_EQ(tandem::host_allocator_stats().cached_bytes, 8 * kMiB);  // four 2 MiB blocks
  // A freed 4 MiB block evicts the two oldest 2 MiB ones, so a phase with other sizes than the
  // last finds its own blocks cached, not the last phase's.
  { auto e = torch::empty({4 * kMiB / 4}); }
  EXPECT_EQ(tandem::host_allocator_stats().cached_bytes, 8 * kMiB);
  const auto s = tandem::host_allocator_stats();
  { auto e = torch::empty({4 * kMiB / 4}); }
  EXPECT_EQ(tandem::host_allocator_stats().reuses, s.reuses + 1);
  EXPECT_EQ(tandem::host_allocator_stats().maps, s.maps);
}

// The cache never raises the peak: blocks cached in one phase go back to the operating system
// when live blocks of another grow past the most the allocator ever held, instead of staying
// resident beside them.
TEST(HostAllocator, TheCacheGivesWayToLiveBlocksAtANewPeak) {
  tandem::install_host_allocator(cache_of(16));
  tandem::trim_host_cache();
  {
    auto a = torch::empty({2 * kMiB / 4}), b = torch::empty({2 * kMiB / 4});
    auto c = torch::empty({2 * kMiB / 4}), d = torch::empty({2 * kMiB / 4});
  }
  EXPECT_EQ(tandem::host_allocator_stats().cached_bytes, 8 * kMiB);
  const auto before = tandem::host_allocator_stats();
  const int64_t rss_before = rss_kb();
  {
    // 192 MiB of live 8 MiB blocks: far past anything this process held before.
    std::vector<torch::Tensor> live;
    for (int i = 0; i < 24; ++i) live.push_back(torch::empty({8 * kMiB / 4}));
    const auto during = tandem::host_allocator_stats();
    EXPECT_EQ(during.cached_bytes, 0);
    EXPECT_EQ(during.unmaps, before.unmaps + 4);  // the four cached 2 MiB blocks
    EXPECT_EQ(during.maps, before.maps + 24);
    EXPECT_LE(rss_kb() - rss_before, 192 * 1024 + 2 * 1024);  // the live blocks, no cache beside
  }
  // Below the peak the cache fills again as before.
  EXPECT_EQ(tandem::host_allocator_stats().cached_bytes, 16 * kMiB);
}

TEST(HostAllocator, TheCountingAllocatorCountsAboveIt) {
  tandem::track::install_counting_cpu_allocator();
  tandem::install_host_allocator(cache_of(0));
  const auto counted = tandem::track::cpu_memory_stats().current_bytes;
  const auto maps = tandem::host_allocator_stats().maps;
  {
    auto t = torch::ones({16 * kMiB / 4});
    EXPECT_EQ(tandem::track::cpu_memory_stats().current_bytes, counted + 16 * kMiB);
    EXPECT_EQ(tandem::host_allocator_stats().maps, maps + 1);
    // raw_allocate/raw_deallocate (what oneDNN uses) through the same chain.
    auto* alloc = c10::GetAllocator(c10::DeviceType::CPU);
    void* p = alloc->raw_allocate(4 * kMiB);
    ASSERT_NE(p, nullptr);
    static_cast<char*>(p)[4 * kMiB - 1] = 1;
    alloc->raw_deallocate(p);
    void* q = alloc->raw_allocate(100);
    ASSERT_NE(q, nullptr);
    alloc->raw_deallocate(q);
  }
  EXPECT_EQ(tandem::track::cpu_memory_stats().current_bytes, counted);
  EXPECT_EQ(tandem::host_allocator_stats().cached_bytes, 0);  // cache 0: every block unmapped
}

// Note [The host allocator under AddressSanitizer]: ASan reports an access to the bytes past a
// block's end (the rest of its page, and the guard page after a block that fills its pages), to
// the guard page before it, and to a freed block in the cache; a block handed out again is
// addressable. Each bad access runs in a child process (a death test) that ASan ends.
#if TANDEM_ASAN
TEST(HostAllocatorDeathTest, AddressSanitizerReportsAccessesOutsideALiveBlock) {
  // Forked without exec ("fast"): gtest runs death tests first, while this process has one thread.
  tandem::install_host_allocator(cache_of(16));
  tandem::trim_host_cache();
  constexpr int64_t kRagged = 2 * kMiB + 100;  // bytes: a block whose last page it fills in part
  auto ragged = torch::empty({kRagged / 4});
  volatile char* r = static_cast<char*>(ragged.data_ptr());
  r[0] = 1;
  r[kRagged - 1] = 1;
  EXPECT_DEATH(r[kRagged] = 1, "use-after-poison");
  EXPECT_DEATH(r[kRagged + 1000] = 1, "use-after-poison");
  EXPECT_DEATH(r[-1] = 1, "use-after-poison");
  auto whole = torch::empty({2 * kMiB / 4});  // fills its pages: the guard page follows
  volatile char* w = static_cast<char*>(whole.data_ptr());
  w[2 * kMiB - 1] = 1;
  EXPECT_DEATH(w[2 * kMiB] = 1, "use-after-poison");
  const auto before = tandem::host_allocator_stats();
  whole = torch::Tensor();  // freed into the cache
  EXPECT_EQ(tandem::host_allocator_stats().cached_bytes, before.cached_bytes + 2 * kMiB);
  EXPECT_DEATH(w[0] = 1, "use-after-poison");
  auto again = torch::empty({2 * kMiB / 4});  // the cached block, handed out again
  ASSERT_EQ(again.data_ptr(), static_cast<void*>(const_cast<char*>(w)));
  w[0] = 2;
  w[2 * kMiB - 1] = 2;
  EXPECT_EQ(static_cast<char*>(again.data_ptr())[0], 2);
}
#endif

}  // namespace
