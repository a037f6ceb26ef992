// Tensor-parallel plans without processes: pattern matching, plan errors, and one-rank layers
// (a group of one) that must equal the dense layers they replace.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tandem/comm/process_group.h"
#include "tandem/parallel/tensor_parallel.h"
#include "../common/errors.h"

using namespace tandem::parallel;

namespace {

using tandem::testing::error_of;
using tandem::testing::contains;

struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    emb = register_module("emb", torch::nn::Embedding(8, 4));
    for (int i = 0; i < 2; ++i) {
      up.push_back(register_module("l" + std::to_string(i) + "_up", torch::nn::Linear(4, 6)));
      down.push_back(register_module("l" + std::to_string(i) + "_down", torch::nn::Linear(6, 4)));
    }
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<torch::nn::Linear> up, down;
};
TORCH_MODULE(Tiny);

}  // namespace

TEST(TensorParallelPlan, PatternsMatchWithinOneComponent) {
  EXPECT_TRUE(plan_pattern_matches("h*.attn.qkv", "h0.attn.qkv"));
  EXPECT_TRUE(plan_pattern_matches("h*.attn.qkv", "h11.attn.qkv"));
  EXPECT_TRUE(plan_pattern_matches("h*.fc", "h3.fc"));
  EXPECT_FALSE(plan_pattern_matches("h*.fc", "h3.fc_proj"));
  EXPECT_FALSE(plan_pattern_matches("h*.fc", "h3.mlp.fc"));  // * stops at '.'
  EXPECT_TRUE(plan_pattern_matches("*.*.fc", "h3.mlp.fc"));
  EXPECT_TRUE(plan_pattern_matches("wte", "wte"));
  EXPECT_FALSE(plan_pattern_matches("wte", "wte2"));
  EXPECT_TRUE(plan_pattern_matches("l*_up", "l0_up"));
  EXPECT_TRUE(plan_pattern_matches("*", "head"));
  EXPECT_FALSE(plan_pattern_matches("*", "h0.fc"));
}

TEST(TensorParallelPlan, MatchingListsPathsAndRefusesUnmatchedEntries) {
  const std::vector<std::string> paths{"wte", "h0", "h0.attn", "h0.attn.qkv", "h0.attn.proj",
                                       "h0.fc", "h0.fc_proj", "h1", "h1.attn", "h1.attn.qkv",
                                       "h1.attn.proj", "h1.fc", "h1.fc_proj", "head"};
  TensorParallelPlan plan;
  plan.colwise("h*.attn.qkv", 3).rowwise("h*.attn.proj").colwise("h*.fc").rowwise("h*.fc_proj")
      .vocab("wte");
  auto m = match_plan(plan, paths);
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0], (std::vector<std::string>{"h0.attn.qkv", "h1.attn.qkv"}));
  EXPECT_EQ(m[3], (std::vector<std::string>{"h0.fc_proj", "h1.fc_proj"}));
  EXPECT_EQ(m[4], (std::vector<std::string>{"wte"}));
  EXPECT_EQ(plan.entries[0].parts, 3);
  EXPECT_EQ(plan.entries[1].style, ParallelStyle::kRowwise);

  TensorParallelPlan wrong;
  wrong.colwise("h*.mlp.fc").vocab("embed").colwise("h*.fc");
  const auto e = error_of([&] { match_plan(wrong, paths); });
  EXPECT_TRUE(contains(e, "entries 'h*.mlp.fc' (colwise), 'embed' (vocab) match no module")) << e;
  EXPECT_TRUE(contains(e, "h0.attn.qkv")) << e;  // shows what the paths look like

  TensorParallelPlan twice;
  twice.colwise("h*.fc").rowwise("h0.fc");
  const auto t = error_of([&] { match_plan(twice, paths); });
  EXPECT_TRUE(contains(t, "h0.fc is matched by 'h*.fc' and by 'h0.fc'")) << t;
}

TEST(TensorParallelPlan, ParallelizeOnOneRankEqualsTheDenseModelAndRefusesBadEntries) {
  torch::manual_seed(3);
  Tiny dense;
  Tiny model;
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < dense->parameters().size(); ++i)
      model->parameters()[i].copy_(dense->parameters()[i]);
  }
  TensorParallelPlan plan;
  plan.vocab("emb").colwise("l*_up").rowwise("l*_down");
  auto one = tandem::ProcessGroup::single();
  auto weight_before = model->emb->weight;
  parallelize_module(*model, one, plan);
  // The planned children are tensor-parallel layers holding this rank's shards as new tensors
  // (Note [Dense tensors after parallelize]); the dense tensor the model's member still holds
  // shares the shard's memory and refuses gradients.
  ASSERT_TRUE(planned_child(*model, "l0_up") != nullptr);
  ASSERT_TRUE(planned_child(*model, "l1_down") != nullptr);
  EXPECT_EQ(planned_child(*model, "nothing"), nullptr);
  auto emb = std::dynamic_pointer_cast<VocabParallelEmbeddingImpl>(planned_child(*model, "emb"));
  ASSERT_TRUE(emb != nullptr);
  EXPECT_NE(emb->weight.unsafeGetTensorImpl(), weight_before.unsafeGetTensorImpl());
  EXPECT_EQ(emb->weight.data_ptr(), weight_before.data_ptr());
  EXPECT_EQ(model->named_parameters()["emb.weight"].unsafeGetTensorImpl(),
            emb->weight.unsafeGetTensorImpl());
  {
    auto stale = model->emb->forward(torch::randint(0, 8, {2})).sum();  // the replaced module
    const auto e = error_of<std::exception>([&] { stale.backward(); });
    EXPECT_TRUE(contains(e, "a gradient reached the original tensor of emb.weight")) << e;
    EXPECT_TRUE(contains(e, "planned_child")) << e;
  }
  EXPECT_EQ(model->named_parameters().size(), dense->named_parameters().size());

  auto ids = torch::randint(0, 8, {3, 5});
  auto x = dense->emb(ids);
  auto y = emb->forward(ids);
  for (int i = 0; i < 2; ++i) {
    x = dense->down[static_cast<size_t>(i)](torch::relu(dense->up[static_cast<size_t>(i)](x)));
    y = planned_child(*model, "l" + std::to_string(i) + "_down")
            ->forward(torch::relu(planned_child(*model, "l" + std::to_string(i) + "_up")->forward(y)));
  }
  EXPECT_TRUE(torch::equal(x, y));

  Tiny other;
  // A vocab entry on a Linear (it has a bias).
  TensorParallelPlan vocab_on_linear;
  vocab_on_linear.vocab("l0_up");
  const auto e = error_of([&] { parallelize_module(*other, one, vocab_on_linear); });
  EXPECT_TRUE(contains(e, "l0_up")) << e;
  EXPECT_TRUE(contains(e, "an embedding has no bias")) << e;
  TensorParallelPlan unmatched;
  unmatched.colwise("h*.fc");
  EXPECT_TRUE(contains(error_of([&] { parallelize_module(*other, one, unmatched); }),
                       "'h*.fc' (colwise) match no module"));
  EXPECT_TRUE(contains(error_of([&] { parallelize_module(*other, nullptr, plan); }),
                       "group is null"));
}

namespace {

// A per-token scale whose parameter may be a tensor another module holds.
struct ScaleImpl : torch::nn::Module {
  explicit ScaleImpl(torch::Tensor w) : weight(register_parameter("weight", std::move(w))) {}
  torch::Tensor weight;
};
TORCH_MODULE(Scale);

struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
    up = register_module("up", torch::nn::Linear(4, 4));
    scale = register_module("scale", Scale(up->bias));  // tied to up's bias
  }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear up{nullptr};
  Scale scale{nullptr};
};
TORCH_MODULE(Normed);

}  // namespace

TEST(TensorParallelPlan, SequenceParallelEntriesKeepNormsAndFlagTheLinearLayers) {
  TensorParallelPlan plan;
  plan.sequence_parallel("ln").colwise_from_sequence("up", 2).rowwise_to_sequence("down");
  ASSERT_EQ(plan.entries.size(), 3u);
  EXPECT_EQ(plan.entries[0].style, ParallelStyle::kSequenceParallel);
  EXPECT_TRUE(plan.entries[1].sequence_parallel);
  EXPECT_EQ(plan.entries[1].style, ParallelStyle::kColwise);
  EXPECT_EQ(plan.entries[1].parts, 2);
  EXPECT_TRUE(plan.entries[2].sequence_parallel);
  EXPECT_EQ(plan.entries[2].style, ParallelStyle::kRowwise);
  EXPECT_FALSE(TensorParallelPlan().colwise("up").entries[0].sequence_parallel);

  auto one = tandem::ProcessGroup::single();
  Normed model;
  auto ln = model->ln.ptr();
  TensorParallelPlan good;
  good.sequence_parallel("ln").colwise_from_sequence("up");
  parallelize_module(*model, one, good);
  // The norm stays the module the model built (not a tensor-parallel layer, whose parameters
  // clipping would count as split); the linear layer takes its input from the sequence.
  EXPECT_EQ(planned_child(*model, "ln"), nullptr);
  EXPECT_EQ(model->named_children()["ln"].get(), ln.get());
  auto up = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(planned_child(*model, "up"));
  ASSERT_TRUE(up != nullptr);
  EXPECT_TRUE(up->options.sequence_parallel());
  auto x = torch::randn({2, 6, 4});
  EXPECT_TRUE(torch::equal(up->forward(x), model->up(x)));  // one rank: the dense layer

  // A parameter tied between a split layer and a sequence-parallel module, in either order.
  TensorParallelPlan split_first, summed_first, vocab_sp;
  split_first.colwise("up").sequence_parallel("scale");
  summed_first.sequence_parallel("scale").colwise("up");
  const auto e1 = error_of([&] { parallelize_module(*Normed(), one, split_first); });
  EXPECT_TRUE(contains(e1, "scale")) << e1;
  EXPECT_TRUE(contains(e1, "is split by another plan entry")) << e1;
  const auto e2 = error_of([&] { parallelize_module(*Normed(), one, summed_first); });
  EXPECT_TRUE(contains(e2, "up shares a parameter with a sequence-parallel module")) << e2;
  // Sequence parallel is for colwise and rowwise entries.
  PlanEntry entry;
  entry.pattern = "emb";
  entry.style = ParallelStyle::kVocab;
  entry.sequence_parallel = true;
  vocab_sp.add(entry);
  const auto e3 = error_of([&] { parallelize_module(*Tiny(), one, vocab_sp); });
  EXPECT_TRUE(contains(e3, "sequence_parallel applies to colwise and rowwise entries")) << e3;
}

TEST(TensorParallelRegions, OneRankSequenceScatterIsTheIdentity) {
  auto x = torch::randn({2, 3, 4});
  EXPECT_TRUE(torch::equal(scatter_to_sequence_region(x, tandem::ProcessGroup::single()), x));
  EXPECT_TRUE(contains(error_of([&] { scatter_to_sequence_region(x, nullptr); }),
                       "scatter_to_sequence_region: the process group is null"));
}

TEST(TensorParallelPlan, OneRankCrossEntropyEqualsPyTorchsWithIgnoredTargets) {
  torch::manual_seed(5);
  auto logits = torch::randn({4, 6, 10}, torch::requires_grad());
  auto target = torch::randint(0, 10, {4, 6});
  target.index_put_({0, 1}, -100);
  target.index_put_({2, 3}, -100);
  auto mine = vocab_parallel_cross_entropy(logits, target, tandem::ProcessGroup::single());
  auto theirs = torch::nn::functional::cross_entropy(logits.view({-1, 10}), target.view({-1}));
  EXPECT_LT((mine - theirs).abs().item<double>(), 1e-6);
  auto g1 = torch::autograd::grad({mine}, {logits})[0];
  auto g2 = torch::autograd::grad({theirs}, {logits})[0];
  EXPECT_LT((g1 - g2).abs().max().item<double>(), 1e-7);
  EXPECT_EQ(g1[0][1].abs().sum().item<double>(), 0.0);  // ignored: no gradient
  auto none = vocab_parallel_cross_entropy(logits, target, tandem::ProcessGroup::single(),
                                           VocabParallelCrossEntropyOptions().reduction("none"));
  EXPECT_EQ(none.sizes(), (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(none[2][3].item<double>(), 0.0);
  EXPECT_TRUE(contains(error_of([&] {
                         vocab_parallel_cross_entropy(logits, target.view({-1}),
                                                      tandem::ProcessGroup::single());
                       }),
                       "targets of shape"));
}

TEST(TensorParallelRngTest, ScopeSwapsToAPerRankStreamAndBack) {
  torch::manual_seed(42);
  auto shared_first = torch::rand({4});
  torch::manual_seed(42);
  TensorParallelRng rng0(42, 0), rng1(42, 1);
  at::Tensor a0, a1, b0;
  {
    auto s = rng0.scope();
    a0 = torch::rand({4});
  }
  {
    auto s = rng1.scope();
    a1 = torch::rand({4});
  }
  // The default stream was not advanced by the scopes.
  EXPECT_TRUE(torch::equal(torch::rand({4}), shared_first));
  // Ranks draw differently; a rank's stream continues where it stopped.
  EXPECT_FALSE(torch::equal(a0, a1));
  {
    auto s = rng0.scope();
    b0 = torch::rand({4});
  }
  EXPECT_FALSE(torch::equal(a0, b0));
  // The stream is seed + 2718 + rank.
  torch::manual_seed(42 + 2718 + 1);
  EXPECT_TRUE(torch::equal(torch::rand({4}), a1));
}
