// Gradient bucket assignment (see buckets.h).
#include "tandem/parallel/buckets.h"

#include <algorithm>
#include <map>

namespace tandem::parallel {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params,
                                                int64_t bucket_cap_bytes,
                                                int64_t first_bucket_cap_bytes) {
  std::vector<std::vector<size_t>> done;
  struct Open {
    std::vector<size_t> members;
    int64_t bytes = 0;
  };
  std::map<int, Open> open;  // one open bucket per group
  for (size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    Open& b = open[p.group];
    b.members.push_back(k);
    b.bytes += p.bytes;
    const int64_t cap_now = done.empty() ? first_bucket_cap_bytes : bucket_cap_bytes;
    if (b.bytes >= cap_now) {
      done.push_back(std::move(b.members));
      b = Open{};
    }
  }
  // Remaining open buckets, in the order of their first member (the one ready first).
  std::vector<std::vector<size_t>> rest;
  for (auto& [g, b] : open)
    if (!b.members.empty()) rest.push_back(std::move(b.members));
  std::sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) { return a[0] > b[0]; });
  for (auto& r : rest) done.push_back(std::move(r));
  return done;
}

}  // namespace tandem::parallel
