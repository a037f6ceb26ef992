// Activation checkpointing in one process: gradients bitwise equal to the plain model (dropout,
// autocast, nesting, inputs without gradients, several outputs, the example GPT), the random
// number restore shown to matter, the engine's callbacks in a recompute, ZeRO-3-style gathering
// around the recompute, in-place wrapping and the environment switch.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "../common/drop_block.h"
#include "../../examples/common/gpt.h"
#include "tandem/config/run_config.h"
#include "tandem/error.h"
#include "tandem/nn/module.h"
#include "tandem/parallel/activation_checkpoint.h"
#include "tandem/parallel/sharded.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/precision/autocast.h"

using tandem::parallel::checkpoint;
using tandem::parallel::Checkpointed;
using tandem::parallel::CheckpointedImpl;
using tandem::parallel::CheckpointOptions;

namespace {

constexpr int64_t kWidth = tandem::testing::kDropWidth;

using tandem::testing::DropBlock;
using tandem::testing::DropBlockImpl;

DropBlock block() { return DropBlock(); }

// B blocks of Linear, ReLU, Dropout(0.5), built from one seed.
torch::nn::Sequential model(int blocks, uint64_t seed = 7) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  for (int i = 0; i < blocks; ++i) m->push_back(block());
  m->push_back(torch::nn::Linear(kWidth, 1));
  return m;
}

std::vector<std::string> names(torch::nn::Module& m) {
  std::vector<std::string> n;
  for (const auto& kv : m.named_parameters()) n.push_back(kv.key());
  return n;
}

// Every parameter's gradient (in named order) and the input's, after a seeded forward/backward.
struct Grads {
  std::vector<torch::Tensor> params;
  torch::Tensor input;
  torch::Tensor after;  // a draw from the CPU generator after backward
};

Grads run(torch::nn::Module& m, const std::function<torch::Tensor(torch::Tensor)>& forward,
          bool input_grad = true, uint64_t seed = 11) {
  torch::manual_seed(123);
  auto x = torch::randn({8, kWidth});
  if (input_grad) x.requires_grad_(true);
  torch::manual_seed(seed);
  auto loss = forward(x).pow(2).sum();
  loss.backward();
  Grads g;
  for (const auto& kv : m.named_parameters())
    g.params.push_back(kv.value().grad().defined() ? kv.value().grad().clone() : torch::Tensor());
  if (input_grad) g.input = x.grad().clone();
  g.after = torch::rand({4});
  return g;
}

void expect_bitwise(const Grads& a, const Grads& b) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    ASSERT_TRUE(a.params[i].defined() && b.params[i].defined()) << "parameter " << i;
    EXPECT_TRUE(torch::equal(a.params[i], b.params[i]))
        << "parameter " << i << ": max |diff| "
        << (a.params[i] - b.params[i]).abs().max().item<double>();
  }
  if (a.input.defined() || b.input.defined()) {
    EXPECT_TRUE(torch::equal(a.input, b.input));
  }
  // The generator after backward is where the plain run left it: the recompute's draws were undone.
  EXPECT_TRUE(torch::equal(a.after, b.after));
}

}  // namespace

TEST(ActivationCheckpoint, DropoutBlocksBitwiseEqualAndNamesUnchanged) {
  auto plain = model(4);
  auto ckpt = model(4);
  const auto before = names(*ckpt);
  auto made = tandem::parallel::checkpoint_sequential_entries(ckpt);
  EXPECT_EQ(made.size(), 5u);
  EXPECT_EQ(names(*ckpt), before);  // state dicts unchanged
  EXPECT_NE(std::dynamic_pointer_cast<CheckpointedImpl>(ckpt->children()[0]), nullptr);
  auto a = run(*plain, [&](torch::Tensor x) { return plain->forward(x); });
  auto b = run(*ckpt, [&](torch::Tensor x) { return ckpt->forward(x); });
  expect_bitwise(a, b);
  // Dropout did act (half of the activations zeroed), so equal gradients needed equal masks.
  torch::manual_seed(1);
  auto h = plain[0]->as<DropBlockImpl>()->forward(torch::randn({64, kWidth}).abs());
  EXPECT_GT((h == 0).sum().item<int64_t>(), 64 * kWidth / 4);
}

TEST(ActivationCheckpoint, WithoutRngRestoreTheGradientsDiffer) {
  auto plain = model(4);
  auto ckpt = model(4);
  tandem::parallel::checkpoint_sequential_entries(ckpt, CheckpointOptions().preserve_rng_state(false));
  auto a = run(*plain, [&](torch::Tensor x) { return plain->forward(x); });
  auto b = run(*ckpt, [&](torch::Tensor x) { return ckpt->forward(x); });
  ASSERT_EQ(a.params.size(), b.params.size());
  int differ = 0;
  for (size_t i = 0; i < a.params.size(); ++i) differ += torch::equal(a.params[i], b.params[i]) ? 0 : 1;
  // The recompute drew other dropout masks: most gradients are wrong.
  EXPECT_GE(differ, static_cast<int>(a.params.size()) / 2) << differ << " of " << a.params.size();
}

// A block whose dropout draws from a tensor-parallel rank's own stream (TensorParallelRng), as
// sequence-parallel dropout does.
struct StreamDropBlockImpl : torch::nn::Module {
  explicit StreamDropBlockImpl(tandem::parallel::TensorParallelRng* rng)
      : fc(register_module("fc", torch::nn::Linear(kWidth, kWidth))), rng(rng) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = fc(x);
    auto scope = rng->scope();
    return torch::dropout(h, 0.5, is_training()).relu();
  }
  torch::nn::Linear fc;
  tandem::parallel::TensorParallelRng* rng;
};
TORCH_MODULE(StreamDropBlock);

// Gradients of 3 such blocks (checkpointed or not), and a draw from the stream afterwards.
std::pair<Grads, torch::Tensor> stream_run(bool checkpointed, bool registered) {
  tandem::parallel::TensorParallelRng rng(/*seed=*/5, /*tp_rank=*/1);
  if (!registered) tandem::parallel::unregister_random_stream(&rng);
  torch::manual_seed(7);
  torch::nn::Sequential m;
  for (int i = 0; i < 3; ++i) m->push_back(StreamDropBlock(&rng));
  if (checkpointed) tandem::parallel::checkpoint_sequential_entries(m);
  auto g = run(*m, [&](torch::Tensor x) { return m->forward(x); });
  auto scope = rng.scope();
  return {g, torch::rand({4})};
}

TEST(ActivationCheckpoint, TensorParallelStreamRecomputesTheSameMasks) {
  auto [a, a_stream] = stream_run(false, true);
  auto [b, b_stream] = stream_run(true, true);
  expect_bitwise(a, b);
  // The stream, too, is where the plain run left it.
  EXPECT_TRUE(torch::equal(a_stream, b_stream));
  // A stream checkpoint() does not know of recomputes with other masks.
  auto [c, c_stream] = stream_run(true, false);
  int differ = 0;
  for (size_t i = 0; i < a.params.size(); ++i) differ += torch::equal(a.params[i], c.params[i]) ? 0 : 1;
  EXPECT_GE(differ, static_cast<int>(a.params.size()) / 2) << differ << " of " << a.params.size();
}

TEST(ActivationCheckpoint, AutocastBf16OnCpuBitwiseEqual) {
  auto plain = model(3);
  auto ckpt = model(3);
  tandem::parallel::checkpoint_sequential_entries(ckpt);
  auto under_autocast = [](torch::nn::Sequential& m) {
    return [&m](torch::Tensor x) {
      tandem::precision::AutocastGuard bf16(c10::kCPU, c10::kBFloat16);
      auto y = m->forward(x);
      EXPECT_EQ(y.scalar_type(), c10::kBFloat16);  // the Linear layers did run in bf16
      return y.to(torch::kFloat);
    };
  };
  auto a = run(*plain, under_autocast(plain));
  // Backward runs outside the autocast region: the recompute must switch autocast on again.
  EXPECT_FALSE(tandem::precision::AutocastGuard::is_enabled(c10::kCPU));
  auto b = run(*ckpt, under_autocast(ckpt));
  expect_bitwise(a, b);
}

TEST(ActivationCheckpoint, AutocastCacheDoesNotLoseAWeightsGradient) {
  // The same leaf weight inside a checkpointed region and after it, in one autocast region
  // (mm casts the leaf itself, which autocast caches; Linear casts a transposed view, which it
  // does not). A cast cached while the region ran without gradients would carry no backward.
  torch::manual_seed(3);
  auto w = torch::randn({kWidth, kWidth}, torch::requires_grad());
  auto x = torch::randn({4, kWidth});
  auto grad_of = [&](bool ckpt) {
    w.mutable_grad() = torch::Tensor();
    tandem::precision::AutocastGuard bf16(c10::kCPU, c10::kBFloat16);
    auto f = [&](const torch::Tensor& t) { return torch::mm(t, w).relu(); };
    auto h = ckpt ? checkpoint(f, x) : f(x);
    auto y = torch::mm(h, w);
    EXPECT_EQ(y.scalar_type(), c10::kBFloat16);
    EXPECT_TRUE(y.requires_grad());
    y.to(torch::kFloat).pow(2).sum().backward();
    return w.grad().clone();
  };
  auto a = grad_of(false), b = grad_of(true);
  // Not bitwise: without checkpointing both uses share one cached bf16 copy, whose backward sums
  // their gradients in bf16 before the cast to fp32; with it, each use casts on its own and the
  // two gradients are summed in fp32. Both are the gradient of both uses, to bf16's precision.
  const double diff = (a - b).abs().max().item<double>(), scale = a.abs().max().item<double>();
  std::cout << "shared weight under bf16 autocast: max |diff| " << diff << " of max |grad| "
            << scale << std::endl;
  EXPECT_LE(diff, 1e-2 * scale);
}

TEST(ActivationCheckpoint, NestedCheckpoints) {
  auto plain = model(4);
  auto ckpt = model(4);
  // Two outer regions of two blocks each, every block checkpointed again inside.
  tandem::parallel::checkpoint_sequential_entries(ckpt);
  auto forward = [&](torch::Tensor x) {
    for (int half = 0; half < 2; ++half)
      x = checkpoint(
          [&, half](const torch::Tensor& in) {
            // A region runs again before its nested backward starts: the depth counts backwards.
            EXPECT_EQ(tandem::parallel::checkpoint_recompute_depth(), 0);
            auto h = in;
            for (int k = 0; k < 2; ++k) h = ckpt[static_cast<size_t>(2 * half + k)]->as<CheckpointedImpl>()->forward(h);
            return h;
          },
          x);
    return ckpt[4]->as<CheckpointedImpl>()->forward(x);  // the head is wrapped too
  };
  auto a = run(*plain, [&](torch::Tensor x) { return plain->forward(x); });
  auto b = run(*ckpt, forward);
  expect_bitwise(a, b);
}

// in_checkpoint_recompute: false in the region's first run, true when it runs again in the
// backward (what a module that counts its forwards, as an MoE router its tokens, reads).
TEST(ActivationCheckpoint, RecomputeIsToldApartFromTheFirstRun) {
  auto m = model(1);
  std::vector<bool> seen;
  auto x = torch::randn({4, kWidth}, torch::requires_grad());
  auto y = checkpoint(
      [&](const torch::Tensor& in) {
        seen.push_back(tandem::parallel::in_checkpoint_recompute());
        return m->forward(in);
      },
      x);
  EXPECT_FALSE(tandem::parallel::in_checkpoint_recompute());
  y.sum().backward();
  EXPECT_EQ(seen, (std::vector<bool>{false, true}));
  EXPECT_FALSE(tandem::parallel::in_checkpoint_recompute());
}

TEST(ActivationCheckpoint, InputsThatDoNotRequireGrad) {
  auto plain = model(3);
  auto ckpt = model(3);
  tandem::parallel::checkpoint_sequential_entries(ckpt);
  // The first block's input is data: the parameters inside still get their gradients.
  auto a = run(*plain, [&](torch::Tensor x) { return plain->forward(x); }, /*input_grad=*/false);
  auto b = run(*ckpt, [&](torch::Tensor x) { return ckpt->forward(x); }, /*input_grad=*/false);
  expect_bitwise(a, b);

  // Two inputs, one with a gradient and one without: only the first gets one.
  torch::manual_seed(5);
  auto u = torch::randn({3, 4}, torch::requires_grad());
  auto v = torch::randn({3, 4});
  auto outs = checkpoint(
      [](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{in[0] * in[1].exp()}; },
      {u, v});
  outs[0].sum().backward();
  EXPECT_TRUE(torch::equal(u.grad(), v.exp()));
  EXPECT_FALSE(v.grad().defined());

  // Gradients disabled: a plain call, nothing recorded.
  torch::NoGradGuard no_grad;
  auto w = torch::randn({2}, torch::requires_grad());
  auto y = checkpoint([](const torch::Tensor& t) { return t * 2; }, w);
  EXPECT_FALSE(y.requires_grad());
}

TEST(ActivationCheckpoint, MultipleOutputs) {
  torch::manual_seed(9);
  torch::nn::Linear fc(kWidth, 2 * kWidth);
  torch::nn::Dropout drop(0.5);
  auto fn = [&](const std::vector<torch::Tensor>& in) {
    auto h = drop(fc(in[0]));
    auto parts = h.chunk(2, 1);
    // Three outputs: two halves and an integer one (no gradient).
    return std::vector<torch::Tensor>{parts[0], parts[1].tanh(), h.argmax(1)};
  };
  auto grads = [&](bool ckpt, bool use_second) {
    fc->zero_grad();
    torch::manual_seed(21);
    auto x = torch::randn({5, kWidth}, torch::requires_grad());
    torch::manual_seed(22);
    auto outs = ckpt ? checkpoint(fn, {x}) : fn({x});
    EXPECT_EQ(outs.size(), 3u);
    EXPECT_FALSE(outs[2].requires_grad());
    auto loss = outs[0].pow(2).sum();
    if (use_second) loss = loss + (outs[1] * 3).sum();
    loss.backward();
    return std::vector<torch::Tensor>{fc->weight.grad().clone(), fc->bias.grad().clone(),
                                      x.grad().clone()};
  };
  for (bool second : {true, false}) {  // false: an output without a gradient
    auto a = grads(false, second), b = grads(true, second);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i << " use_second " << second;
  }
}

TEST(ActivationCheckpoint, ExampleGptBitwiseEqual) {
  examples::GPTConfig c;
  c.layers = 2;
  c.width = 32;
  c.heads = 2;
  c.context = 16;
  torch::manual_seed(4);
  examples::GPT plain(c);
  torch::manual_seed(4);
  examples::GPT ckpt(c);
  torch::manual_seed(5);
  auto idx = torch::randint(0, c.vocab, {2, c.context});
  auto targets = torch::randint(0, c.vocab, {2, c.context});
  plain->loss_per_sample(idx, targets).mean().backward();
  // The same forward with every block checkpointed.
  auto pos = torch::arange(c.context, torch::kLong);
  auto x = ckpt->wte(idx) + ckpt->wpe(pos);
  for (auto& b : ckpt->blocks) x = checkpoint([b](const torch::Tensor& t) mutable { return b(t); }, x);
  auto logits = ckpt->head(ckpt->ln_f(x));
  torch::nn::functional::cross_entropy(logits.view({-1, c.vocab}), targets.view({-1}),
                                       torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
      .view({2, c.context})
      .mean(1)
      .mean()
      .backward();
  auto pa = plain->named_parameters(), pb = ckpt->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(torch::equal(pa[i].value().grad(), pb[i].value().grad())) << pa[i].key();

  // apply_activation_checkpointing reaches the blocks the GPT calls from its own forward (they
  // are declared with TANDEM_MODULE): a forward hook on each, the same gradients again.
  torch::manual_seed(4);
  examples::GPT hooked(c);
  auto made = tandem::parallel::apply_activation_checkpointing(
      *hooked, [](const std::string&, torch::nn::Module& m) {
        return tandem::nn::module_type_name(m) == "Block";
      });
  EXPECT_TRUE(made.empty());  // no wrapper: hooks
  const auto described = tandem::nn::describe_hooks(*hooked);
  ASSERT_EQ(described.size(), 2u);
  EXPECT_EQ(described[0].first, "h0");
  EXPECT_EQ(described[0].second, (std::vector<std::string>{"activation checkpoint"}));
  hooked->loss_per_sample(idx, targets).mean().backward();
  auto pc = hooked->named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(torch::equal(pa[i].value().grad(), pc[i].value().grad())) << pa[i].key();
}

// Note [Callbacks in a recompute]: what the engine does, and what queue_backward_callback does.
TEST(ActivationCheckpoint, CallbacksQueuedInARecomputeRunAtTheOuterBackwardsEnd) {
  torch::manual_seed(2);
  auto w = torch::randn({4}, torch::requires_grad());  // used inside the region
  auto v = torch::randn({4}, torch::requires_grad());  // used before it: its gradient comes last
  bool engine_saw_v = true, ours_saw_v = false, engine_ran = false, ours_ran = false;
  int depth_in_hook = -1;
  w.register_hook([&](torch::Tensor g) {
    depth_in_hook = tandem::parallel::checkpoint_recompute_depth();
    torch::autograd::Engine::get_default_engine().queue_callback([&] {
      engine_ran = true;
      engine_saw_v = v.grad().defined();
    });
    tandem::parallel::queue_backward_callback([&] {
      ours_ran = true;
      ours_saw_v = v.grad().defined();
    });
    return g;
  });
  auto h = v * 2;
  auto y = checkpoint([&](const torch::Tensor& t) { return (t * w).sin(); }, h);
  y.sum().backward();
  EXPECT_EQ(depth_in_hook, 1);
  ASSERT_TRUE(engine_ran);
  ASSERT_TRUE(ours_ran);
  // The engine runs a callback at the end of the graph task it was queued in: the nested one,
  // before the outer backward reached v.
  EXPECT_FALSE(engine_saw_v);
  // Held back and queued on the outer graph task: runs after every gradient is in.
  EXPECT_TRUE(ours_saw_v);
  EXPECT_EQ(tandem::parallel::checkpoint_recompute_depth(), 0);
}

TEST(ActivationCheckpoint, GradIsRefused) {
  auto w = torch::randn({3}, torch::requires_grad());
  auto y = checkpoint([](const torch::Tensor& t) { return t.sin(); }, w);
  EXPECT_THROW(torch::autograd::grad({y.sum()}, {w}), tandem::Refused);
}

namespace {

// ZeRO-3's gather/free around a Sharded module, simulated: a freed unit's parameters hold NaN
// (any computation that used them would poison the gradients), a gathered one its values.
struct NanHooks : tandem::parallel::detail::ShardedHooks {
  // The bytes change behind autograd's back (no version bump), as ZeRO-3 swaps storage.
  std::vector<torch::Tensor> params, stash;
  bool gathered = true;
  int forwards = 0, frees = 0, backwards = 0;
  void gather() {
    if (!gathered)
      for (size_t i = 0; i < params.size(); ++i)
        std::memcpy(params[i].data_ptr<float>(), stash[i].data_ptr<float>(),
                    static_cast<size_t>(params[i].numel()) * sizeof(float));
    gathered = true;
  }
  void before_forward() override {
    ++forwards;
    gather();
  }
  void after_forward() override {
    ++frees;
    stash.clear();
    for (auto& p : params) {
      stash.push_back(p.detach().clone());
      std::fill_n(p.data_ptr<float>(), p.numel(), std::numeric_limits<float>::quiet_NaN());
    }
    gathered = false;
  }
  void before_backward() override {
    ++backwards;
    gather();
  }
};

}  // namespace

TEST(ActivationCheckpoint, ComposesWithShardedUnitsInBothNestings) {
  for (int nesting = 0; nesting < 2; ++nesting) {
    auto plain = model(3);
    auto ref = run(*plain, [&](torch::Tensor x) { return plain->forward(x); });
    auto m = model(3);
    std::vector<std::shared_ptr<NanHooks>> hooks;
    torch::nn::Sequential wrapped;
    const auto before = names(*m);
    for (size_t i = 0; i < m->size(); ++i) {
      auto entry = std::dynamic_pointer_cast<DropBlockImpl>(m->ptr(i));
      auto h = std::make_shared<NanHooks>();
      if (entry == nullptr) {  // the head stays as it is
        wrapped->push_back(std::to_string(i),
                           torch::nn::Linear(std::dynamic_pointer_cast<torch::nn::LinearImpl>(m->ptr(i))));
        continue;
      }
      DropBlock e(entry);
      for (auto& p : e->parameters()) h->params.push_back(p);
      if (nesting == 0) {  // Sharded(Checkpointed(block))
        tandem::parallel::Sharded s{Checkpointed(e)};
        s->set_hooks(h);
        wrapped->push_back(std::to_string(i), s);
      } else {  // Checkpointed(Sharded(block))
        tandem::parallel::Sharded s(e);
        s->set_hooks(h);
        wrapped->push_back(std::to_string(i), Checkpointed(s));
      }
      hooks.push_back(h);
    }
    EXPECT_EQ(names(*wrapped), before);
    auto got = run(*wrapped, [&](torch::Tensor x) { return wrapped->forward(x); });
    expect_bitwise(ref, got);  // no NaN reached a gradient: every use saw gathered parameters
    for (auto& h : hooks) {
      // Sharded(Checkpointed): one forward, regathered once for the backward (which recomputes).
      // Checkpointed(Sharded): the recompute is a second forward (gather, free), then the
      // recomputed output's hook gathers for the backward.
      EXPECT_EQ(h->forwards, nesting == 0 ? 1 : 2) << "nesting " << nesting;
      EXPECT_EQ(h->frees, nesting == 0 ? 1 : 2) << "nesting " << nesting;
      EXPECT_EQ(h->backwards, 1) << "nesting " << nesting;
    }
  }
}

TEST(ActivationCheckpoint, ApplyWrapsMatchingSequentialEntriesAtAnyDepth) {
  struct NetImpl : torch::nn::Module {
    NetImpl() {
      torch::manual_seed(1);
      body = register_module("body", torch::nn::Sequential(block(), block(), torch::nn::ReLU()));
      head = register_module("head", torch::nn::Linear(kWidth, 1));
    }
    torch::Tensor forward(torch::Tensor x) { return head(body->forward(x)); }
    torch::nn::Sequential body{nullptr};
    torch::nn::Linear head{nullptr};
  };
  auto net = std::make_shared<NetImpl>();
  const auto before = names(*net);
  std::vector<std::string> seen;
  auto made = tandem::parallel::apply_activation_checkpointing(
      *net, [&](const std::string& name, torch::nn::Module& m) {
        seen.push_back(name);
        return !m.parameters().empty() && name != "body" && name != "head";
      });
  EXPECT_EQ(made.size(), 2u);  // body.0 and body.1; not the ReLU
  EXPECT_EQ(names(*net), before);
  EXPECT_NE(std::find(seen.begin(), seen.end(), "body.1"), seen.end());
  EXPECT_NE(std::dynamic_pointer_cast<CheckpointedImpl>(net->body->ptr(0)), nullptr);
  EXPECT_EQ(std::dynamic_pointer_cast<CheckpointedImpl>(net->body->ptr(2)), nullptr);
  // Applying again leaves the Checkpointed entries alone: only the ReLU entry is wrapped.
  EXPECT_EQ(tandem::parallel::apply_activation_checkpointing(
                *net, [](const std::string& name, torch::nn::Module&) { return name.rfind("body.", 0) == 0; })
                .size(),
            1u);
  auto y = net->forward(torch::randn({2, kWidth}));
  y.sum().backward();
  EXPECT_TRUE(net->body->parameters()[0].grad().defined());
  // A match that cannot be reached (the head, a torch::nn::Linear member) is refused, even when
  // other matches were wrapped: it would stay unchecked without a word.
  try {
    tandem::parallel::apply_activation_checkpointing(
        *net, [](const std::string&, torch::nn::Module& m) { return !m.parameters().empty(); });
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("matches body, head"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("TANDEM_MODULE"), std::string::npos) << e.what();
  }
}

TEST(ActivationCheckpoint, EnvironmentSwitch) {
  using tandem::config::activation_checkpointing_from_env;
  EXPECT_FALSE(activation_checkpointing_from_env(tandem::EnvMap{}));
  EXPECT_TRUE(activation_checkpointing_from_env({{"TANDEM_ACTIVATION_CHECKPOINTING", "true"}}));
  EXPECT_TRUE(activation_checkpointing_from_env({{"TANDEM_ACTIVATION_CHECKPOINTING", "1"}}));
  EXPECT_FALSE(activation_checkpointing_from_env({{"TANDEM_ACTIVATION_CHECKPOINTING", "False"}}));
  // FSDP runs export every fsdp_config key as TANDEM_FSDP_<KEY>.
  EXPECT_TRUE(activation_checkpointing_from_env({{"TANDEM_FSDP_ACTIVATION_CHECKPOINTING", "true"}}));
  try {
    activation_checkpointing_from_env({{"TANDEM_ACTIVATION_CHECKPOINTING", "maybe"}});
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("TANDEM_ACTIVATION_CHECKPOINTING"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("got 'maybe', expected true or false"), std::string::npos);
  }
}
