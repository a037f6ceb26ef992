// DistributedSampler (against PyTorch's), bucket assignment and the prepared loaders' logic,
// without processes: a loader can be built for any (rank, world) placement.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>

#include "tandem/data/loader.h"
#include "tandem/data/sampler.h"
#include "tandem/parallel/buckets.h"

using tandem::data::DataLoader;
using tandem::data::DataLoaderOptions;
using tandem::data::DistributedSampler;
using tandem::data::LoaderState;
using tandem::data::SamplerOptions;

namespace {

// The sampler's algorithm written out plainly (PyTorch's DistributedSampler.__iter__), without
// shuffling, to derive expectations independently of the implementation.
std::vector<int64_t> plain_sampler(int64_t size, int64_t n, int64_t rank, bool drop_last) {
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < size; ++i) idx.push_back(i);
  int64_t num_samples = drop_last && size % n ? (size - n) / n + 1 : (size + n - 1) / n;
  if (drop_last && size % n) num_samples = size / n;
  int64_t total = num_samples * n;
  if (!drop_last) {
    std::vector<int64_t> padded = idx;
    while (static_cast<int64_t>(padded.size()) < total)
      padded.push_back(idx[padded.size() % idx.size()]);
    idx = padded;
  } else {
    idx.resize(static_cast<size_t>(total));
  }
  std::vector<int64_t> out;
  for (int64_t i = rank; i < total; i += n) out.push_back(idx[static_cast<size_t>(i)]);
  return out;
}

struct Range : torch::data::datasets::Dataset<Range> {
  explicit Range(int64_t n) : n(n) {}
  torch::data::Example<> get(size_t i) override {
    return {torch::full({2}, static_cast<float>(i)), torch::tensor(static_cast<int64_t>(i))};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(n); }
  int64_t n;
};

tandem::data::detail::Placement place(int64_t rank, int64_t world, bool even = true,
                                   bool split = false) {
  tandem::data::detail::Placement p;
  p.rank = rank;
  p.world = world;
  p.even_batches = even;
  p.split_batches = split;
  return p;
}

// Member `index` of a quorum of `size` replicas (Note [Replica recovery]).
tandem::data::detail::Placement place_replica(int64_t size, int64_t index) {
  auto p = place(0, 1);
  p.replicas = std::make_shared<tandem::data::detail::ReplicaShard>();
  p.replicas->size = size;
  p.replicas->index = index;
  return p;
}

std::vector<std::vector<int64_t>> batches_of(DataLoader<Range>& loader) {
  std::vector<std::vector<int64_t>> out;
  for (auto& b : loader) {
    std::vector<int64_t> ids;
    for (int64_t k = 0; k < b.target.size(0); ++k) ids.push_back(b.target[k].item<int64_t>());
    out.push_back(ids);
  }
  return out;
}

}  // namespace

TEST(DistributedSampler, MatchesPyTorchOnEveryRecordedCase) {
  // Recorded once from torch.utils.data.DistributedSampler (PyTorch 1.13) by iterating it for
  // every (size, num_replicas, rank, shuffle, seed, epoch, drop_last) in the table; the test
  // oracle.pytorch_sampler points TANDEM_SAMPLER_CASES at the same table written by the
  // installed PyTorch 2.x (tests/oracle/sampler_cases.py).
  const char* live = std::getenv("TANDEM_SAMPLER_CASES");
  const std::string path = live && *live ? live : TANDEM_TEST_DATA "/pytorch_sampler_cases.json";
  std::ifstream f(path);
  ASSERT_TRUE(f) << "missing " << path;
  auto doc = nlohmann::json::parse(f);
  std::cout << "cases from " << doc["generator"].get<std::string>() << std::endl;
  int checked = 0;
  for (const auto& c : doc["cases"]) {
    for (int64_t r = 0; r < c["num_replicas"].get<int64_t>(); ++r) {
      DistributedSampler s(c["size"].get<int64_t>(), SamplerOptions()
                                                         .num_replicas(c["num_replicas"])
                                                         .rank(r)
                                                         .shuffle(c["shuffle"])
                                                         .seed(c["seed"].get<uint64_t>())
                                                         .drop_last(c["drop_last"]));
      s.set_epoch(c["epoch"]);
      auto expected = c["ranks"][r].get<std::vector<int64_t>>();
      ASSERT_EQ(s.indices(), expected) << c.dump();
      ASSERT_EQ(s.num_samples(), static_cast<int64_t>(expected.size()));
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000);
}

TEST(DistributedSampler, MatchesThePlainAlgorithmWithoutShuffle) {
  for (int64_t size : {1, 5, 10, 11, 12, 13}) {
    for (int64_t n : {1, 2, 3, 4, 7}) {
      for (bool drop : {false, true}) {
        for (int64_t r = 0; r < n; ++r) {
          DistributedSampler s(size, SamplerOptions().num_replicas(n).rank(r).shuffle(false).drop_last(drop));
          EXPECT_EQ(s.indices(), plain_sampler(size, n, r, drop))
              << size << " " << n << " " << r << " " << drop;
        }
      }
    }
  }
  DistributedSampler s(10, SamplerOptions().num_replicas(3).rank(1).shuffle(false));
  EXPECT_EQ(s.indices(), (std::vector<int64_t>{1, 4, 7, 0}));
  EXPECT_EQ(s.padding_mask(), (std::vector<bool>{false, false, false, true}));
}

TEST(DistributedSampler, EpochChangesTheOrderAndEveryRankCoversTheDataOnce) {
  const int64_t n = 3, size = 30;
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t e : {0, 1}) {
    std::multiset<int64_t> all;
    for (int64_t r = 0; r < n; ++r) {
      DistributedSampler s(size, SamplerOptions().num_replicas(n).rank(r).seed(5));
      s.set_epoch(e);
      auto idx = s.indices();
      all.insert(idx.begin(), idx.end());
      if (r == 0) (e == 0 ? epoch0 : epoch1) = idx;
    }
    for (int64_t i = 0; i < size; ++i) EXPECT_EQ(all.count(i), 1u);
  }
  EXPECT_NE(epoch0, epoch1);
}

TEST(DistributedSampler, UnevenWithoutPadding) {
  std::vector<int64_t> sizes;
  for (int64_t r = 0; r < 3; ++r) {
    DistributedSampler s(10, SamplerOptions().num_replicas(3).rank(r).shuffle(false).pad(false));
    sizes.push_back(static_cast<int64_t>(s.indices().size()));
    EXPECT_EQ(s.num_samples(), sizes.back());
  }
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 3, 3}));
}

TEST(Buckets, ReverseOrderUnderTheCapsWithASmallFirstBucket) {
  using tandem::parallel::assign_buckets;
  // 6 parameters of 400 bytes: first cap 500 -> closes after 2 (800 >= 500); cap 1000 -> 3 more.
  std::vector<tandem::parallel::BucketParam> p(6, {400, 0});
  auto b = assign_buckets(p, 1000, 500);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (std::vector<size_t>{5, 4}));
  EXPECT_EQ(b[1], (std::vector<size_t>{3, 2, 1}));
  EXPECT_EQ(b[2], (std::vector<size_t>{0}));
  // A huge parameter closes its bucket alone; dtype groups never mix.
  std::vector<tandem::parallel::BucketParam> q{{100, 0}, {100, 1}, {5000, 0}, {100, 1}};
  auto c = assign_buckets(q, 1000, 1000);
  std::set<size_t> seen;
  for (auto& bucket : c) {
    std::set<int> groups;
    for (size_t i : bucket) {
      groups.insert(q[i].group);
      EXPECT_TRUE(seen.insert(i).second);
    }
    EXPECT_EQ(groups.size(), 1u);
  }
  EXPECT_EQ(seen.size(), q.size());
  EXPECT_EQ(c[0], (std::vector<size_t>{2}));
}

TEST(Loader, ShardsBatchesAndMarksPaddingForEveryRank) {
  // 10 samples, 3 ranks, batch 3: shards of 4 (two padded samples), batches of 3 and 1.
  std::multiset<int64_t> real;
  for (int64_t r = 0; r < 3; ++r) {
    auto state = std::make_shared<LoaderState>();
    DataLoader<Range> loader(Range(10), DataLoaderOptions().batch_size(3), place(r, 3), state);
    EXPECT_EQ(loader.size(), 2);
    auto it = loader.begin();
    ASSERT_TRUE(it != loader.end());
    EXPECT_EQ(state->batch_rows, 3);
    EXPECT_EQ(state->valid_rows, 3);
    EXPECT_FALSE(state->end_of_dataloader);
    for (int64_t k = 0; k < 3; ++k) real.insert(it->target[k].item<int64_t>());
    ++it;
    ASSERT_TRUE(it != loader.end());
    EXPECT_TRUE(state->end_of_dataloader);
    EXPECT_EQ(state->batch_rows, 1);
    EXPECT_EQ(state->valid_rows, r == 0 ? 1 : 0);  // rank 1 and 2 got repeats of 0 and 1
    if (state->valid_rows) real.insert(it->target[0].item<int64_t>());
    ++it;
    EXPECT_FALSE(it != loader.end());
  }
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(real.count(i), 1u) << i;
}

// Note [Replica recovery]: a loader sharded over a quorum of n replicas gives every replica the
// batches DistributedSampler's world of n gives the same rank, padding and drop_last included.
TEST(Loader, ReplicaShardsOfAFixedQuorumAreTheWorldsOfThatSize) {
  for (int64_t size : {200, 203, 5})
    for (int64_t n : {1, 2, 3})
      for (bool drop_last : {false, true})
        for (int64_t me = 0; me < n; ++me) {
          SCOPED_TRACE("size " + std::to_string(size) + " n " + std::to_string(n) + " rank " +
                       std::to_string(me) + (drop_last ? " drop_last" : ""));
          const auto options =
              DataLoaderOptions().batch_size(4).shuffle(true).seed(3).drop_last(drop_last);
          DataLoader<Range> world(Range(size), options, place(me, n), nullptr);
          DataLoader<Range> replica(Range(size), options, place_replica(n, me), nullptr);
          EXPECT_EQ(replica.size(), world.size());
          EXPECT_EQ(batches_of(replica), batches_of(world));
          EXPECT_EQ(batches_of(replica), batches_of(world));  // the next epoch too
        }
}

// A quorum that loses a replica mid-epoch: the survivors cut the rest of the epoch between
// them; the lost replica's batches already drawn are the only samples it took.
TEST(Loader, ReplicaShardsFollowTheQuorumMidEpoch) {
  const auto options = DataLoaderOptions().batch_size(4);
  std::vector<std::shared_ptr<tandem::data::detail::ReplicaShard>> shards;
  std::vector<std::unique_ptr<DataLoader<Range>>> loaders;
  for (int64_t me = 0; me < 3; ++me) {
    auto p = place_replica(3, me);
    shards.push_back(p.replicas);
    loaders.push_back(std::make_unique<DataLoader<Range>>(Range(200), options, p, nullptr));
  }
  std::vector<int64_t> seen;
  auto take = [&seen](const torch::Tensor& target) {
    for (int64_t k = 0; k < target.size(0); ++k) seen.push_back(target[k].item<int64_t>());
  };
  auto a = loaders[0]->begin(), b = loaders[1]->begin(), c = loaders[2]->begin();
  for (int step = 0; step < 2; ++step) {  // two steps on 3 replicas: 24 samples
    take(a->target), take(b->target), take(c->target);
    ++a, ++b, ++c;
  }
  take(a->target), take(b->target);  // the third step's batches were drawn on 3: C's is lost
  shards[0]->size = shards[1]->size = 2;
  shards[1]->index = 1;
  int steps = 0;
  for (++a, ++b; a != loaders[0]->end(); ++a, ++b, ++steps) {
    ASSERT_TRUE(b != loaders[1]->end());
    take(a->target), take(b->target);
  }
  EXPECT_TRUE(b == loaders[1]->end());
  EXPECT_EQ(steps, (200 - 36) / 8 + 1);  // 164 samples left: 20 steps of 8 and one of 4
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> expected;
  for (int64_t k = 0; k < 200; ++k)
    if (k < 24 || k >= 36 || (k - 24) % 3 != 2) expected.push_back(k);
  EXPECT_EQ(seen, expected);  // every sample once, but the 4 of C's lost batch
}

// A quorum that grows mid-epoch (a replica joins at sample 16 of 203): the rest of the epoch is
// cut for 3, every member takes as many batches (none empty), and every sample is taken.
TEST(Loader, ReplicaShardsOfAJoinerMeetTheOthersToTheEnd) {
  const auto options = DataLoaderOptions().batch_size(4).shuffle(true).seed(9);
  std::vector<std::shared_ptr<tandem::data::detail::ReplicaShard>> shards;
  std::vector<std::unique_ptr<DataLoader<Range>>> loaders;
  for (int64_t me = 0; me < 3; ++me) {
    auto p = place_replica(2, me);
    shards.push_back(p.replicas);
    loaders.push_back(std::make_unique<DataLoader<Range>>(Range(203), options, p, nullptr));
  }
  std::set<int64_t> seen;
  std::vector<int> batches(3, 0);
  auto take = [&](int who, const torch::Tensor& target) {
    EXPECT_GT(target.size(0), 0);
    ++batches[static_cast<size_t>(who)];
    for (int64_t k = 0; k < target.size(0); ++k) seen.insert(target[k].item<int64_t>());
  };
  auto a = loaders[0]->begin(), b = loaders[1]->begin();
  take(0, a->target), take(1, b->target);
  shards[0]->at_boundary = [&](int64_t, int64_t consumed) {
    if (consumed != 16) return;  // the second step's boundary: the joiner comes in
    for (auto& s : shards) s->size = 3;
    shards[2]->start = std::make_pair(int64_t{0}, consumed);
  };
  ++a, ++b;
  take(0, a->target), take(1, b->target);
  ++a, ++b;  // drawn on 3
  auto c = loaders[2]->begin();
  for (; a != loaders[0]->end(); ++a, ++b, ++c) {
    ASSERT_TRUE(b != loaders[1]->end());
    ASSERT_TRUE(c != loaders[2]->end());
    take(0, a->target), take(1, b->target), take(2, c->target);
  }
  EXPECT_TRUE(b == loaders[1]->end());
  EXPECT_TRUE(c == loaders[2]->end());
  EXPECT_EQ(batches[0], batches[1]);
  EXPECT_EQ(batches[2], batches[0] - 2);
  EXPECT_EQ(seen.size(), 203u);  // every sample, the padding repeating a few
}

TEST(Loader, SkipFirstBatchesResumesMidEpochInTheSameOrder) {
  auto state = std::make_shared<LoaderState>();
  DataLoader<Range> full(Range(50), DataLoaderOptions().batch_size(4).shuffle(true).seed(3),
                         place(1, 2), state);
  DataLoader<Range> resumed(Range(50), DataLoaderOptions().batch_size(4).shuffle(true).seed(3),
                            place(1, 2), state);
  full.set_epoch(2);
  resumed.set_epoch(2);
  auto all = batches_of(full);
  resumed.skip_first_batches(3);
  auto rest = batches_of(resumed);
  ASSERT_EQ(rest.size() + 3, all.size());
  for (size_t k = 0; k < rest.size(); ++k) EXPECT_EQ(rest[k], all[k + 3]);
  // The next pass is a new epoch with a new order and no skipping.
  EXPECT_EQ(resumed.epoch(), 3);
  EXPECT_EQ(batches_of(resumed).size(), all.size());
}

TEST(Loader, SplitBatchesDropLastAndPrefetchOff) {
  auto state = std::make_shared<LoaderState>();
  DataLoader<Range> split(Range(20), DataLoaderOptions().batch_size(8), place(0, 4, true, true), state);
  EXPECT_EQ(split.batch_size(), 2);
  auto make_bad = [&] {
    DataLoader<Range> bad(Range(20), DataLoaderOptions().batch_size(6), place(0, 4, true, true),
                          state);
  };
  EXPECT_THROW(make_bad(), std::invalid_argument);
  DataLoader<Range> drop(Range(10), DataLoaderOptions().batch_size(4).drop_last(true).prefetch(0),
                         place(0, 1), state);
  auto b = batches_of(drop);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[1], (std::vector<int64_t>{4, 5, 6, 7}));
}

TEST(Loader, ProducerErrorsReachTheTrainingLoop) {
  struct Bad : torch::data::datasets::Dataset<Bad> {
    torch::data::Example<> get(size_t i) override {
      if (i == 5) throw std::runtime_error("sample 5 is corrupt");
      return {torch::zeros({1}), torch::zeros({})};
    }
    torch::optional<size_t> size() const override { return 8; }
  };
  DataLoader<Bad> loader(Bad(), DataLoaderOptions().batch_size(2), place(0, 1),
                         std::make_shared<LoaderState>());
  try {
    for (auto& b : loader) (void)b;
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "sample 5 is corrupt");
  }
}

TEST(StreamLoader, RanksTakeEveryNthBatchAndStopTogether) {
  // A stream of 11 examples, 3 ranks, batch 2: rounds of 6; the second round has 5 (one pad).
  std::vector<std::vector<int64_t>> per_rank(3);
  std::vector<int64_t> valid_total(3, 0);
  for (int64_t r = 0; r < 3; ++r) {
    auto state = std::make_shared<LoaderState>();
    auto make = [] {
      auto i = std::make_shared<int64_t>(0);
      return std::function<std::optional<torch::Tensor>()>([i]() -> std::optional<torch::Tensor> {
        if (*i >= 11) return std::nullopt;
        return torch::tensor(static_cast<float>((*i)++));
      });
    };
    tandem::data::StreamLoader<torch::Tensor> loader(make, DataLoaderOptions().batch_size(2),
                                                      place(r, 3), state);
    int batches = 0;
    for (auto& b : loader) {
      ++batches;
      for (int64_t k = 0; k < state->valid_rows; ++k)
        per_rank[r].push_back(static_cast<int64_t>(b[k].item<float>()));
      valid_total[r] += state->valid_rows;
      EXPECT_EQ(state->end_of_dataloader, batches == 2);
    }
    EXPECT_EQ(batches, 2);
  }
  EXPECT_EQ(per_rank[0], (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(per_rank[1], (std::vector<int64_t>{2, 3, 8, 9}));
  EXPECT_EQ(per_rank[2], (std::vector<int64_t>{4, 5, 10}));
}

// LibTorch's own data sets as LibTorch programs write them: a Dataset mapped through a per-example
// transform and Stack (the collation), one mapped through a per-example transform only (the
// loader collates), and a TensorDataset (examples without targets). Each batch holds the rows
// the sampler gave this rank, transformed as LibTorch's own loader transforms them.
TEST(Loader, LibTorchMapDatasetsAndExampleTypes) {
  namespace datasets = torch::data::datasets;
  namespace transforms = torch::data::transforms;
  using torch::data::Example;
  // The data: sample i is a 1x2x2 image of i with target i (Normalize works on [C, H, W]).
  struct Pairs : datasets::Dataset<Pairs> {
    Example<> get(size_t i) override {
      return {torch::full({1, 2, 2}, static_cast<float>(i)),
              torch::tensor(static_cast<int64_t>(i))};
    }
    torch::optional<size_t> size() const override { return 10; }
  };
  const auto normalize = transforms::Normalize<>(1.0, 2.0);  // (x - 1) / 2
  for (int64_t r = 0; r < 2; ++r) {
    auto stacked = Pairs().map(normalize).map(transforms::Stack<>());
    DataLoader<decltype(stacked)> a(stacked, DataLoaderOptions().batch_size(3), place(r, 2),
                                    std::make_shared<LoaderState>());
    auto per_example = Pairs().map(normalize);
    DataLoader<decltype(per_example)> b(per_example, DataLoaderOptions().batch_size(3),
                                        place(r, 2), std::make_shared<LoaderState>());
    auto ib = b.begin();
    int64_t batches = 0;
    for (auto& batch : a) {
      ASSERT_TRUE(ib != b.end());
      EXPECT_EQ(batch.data.sizes(), (std::vector<int64_t>{batch.target.size(0), 1, 2, 2}));
      // Rank r's samples are r, r + 2, ...: data (i - 1) / 2 for target i.
      EXPECT_TRUE(torch::allclose(batch.data.flatten(1).select(1, 3),
                                  (batch.target.to(torch::kFloat) - 1) / 2));
      EXPECT_EQ(batch.target[0].item<int64_t>() % 2, r);
      EXPECT_TRUE(torch::equal(batch.data, ib->data));
      EXPECT_TRUE(torch::equal(batch.target, ib->target));
      ++ib;
      ++batches;
    }
    EXPECT_EQ(batches, 2);  // 5 samples per rank in batches of 3
  }
  // A data set that stacks its own batches takes no collate function: refused by name.
  auto stacked = Pairs().map(transforms::Stack<>());
  try {
    DataLoader<decltype(stacked)> c(
        stacked, DataLoaderOptions().batch_size(3), place(0, 1), std::make_shared<LoaderState>(),
        [](std::vector<Example<>>& items) { return items.front(); });
    ADD_FAILURE() << "a collate function with Stack was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("makes its own batches"), std::string::npos) << e.what();
  }
  // Examples without targets (TensorDataset): collated by data alone.
  auto tensors = datasets::TensorDataset(torch::arange(6).view({6, 1}));
  DataLoader<datasets::TensorDataset> d(tensors, DataLoaderOptions().batch_size(4), place(1, 2),
                                        std::make_shared<LoaderState>());
  auto it = d.begin();
  ASSERT_TRUE(it != d.end());
  EXPECT_TRUE(torch::equal(it->data.view({-1}), torch::tensor({1, 3, 5})));
}
