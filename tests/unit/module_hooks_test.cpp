// Module hooks (tandem/nn/module.h): both ways of calling a typed member run them, in order,
// redirects replace the call, and a module without hooks computes what torch::nn's does.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tandem/nn/module.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/activation_checkpoint.h"
#include "tandem/parallel/tensor_parallel.h"

namespace {

using tandem::nn::TensorFunction;

// A model written as LibTorch users write them: typed members, called directly.
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t width, int64_t hidden)
      : up(register_module("up", tandem::nn::Linear(width, hidden))),
        down(register_module("down", tandem::nn::Linear(hidden, width))) {}
  torch::Tensor forward(torch::Tensor x) { return x + down->forward(torch::gelu(up(x))); }
  tandem::nn::Linear up, down;
};
TANDEM_MODULE(MlpBlock);

struct ScaledImpl : torch::nn::Module {
  ScaledImpl() : fc(register_module("fc", tandem::nn::Linear(3, 3))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, double scale, torch::Tensor y) {
    auto h = fc(x) * scale;
    return {h, h + y};
  }
  tandem::nn::Linear fc;
};
TANDEM_MODULE(Scaled);

struct CountImpl : torch::nn::Module {
  int64_t forward(torch::Tensor x) { return x.numel(); }
};
TANDEM_MODULE(Count);

struct TwoWaysImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x * 2; }
  torch::Tensor forward(torch::Tensor x, torch::Tensor y) { return x * y; }
};
TANDEM_MODULE(TwoWays);

TEST(ModuleHooks, WithoutHooksALayerIsTorchNns) {
  torch::manual_seed(0);
  tandem::nn::Linear mine(4, 3);
  torch::nn::Linear theirs(4, 3);
  {
    torch::NoGradGuard g;
    theirs->weight.copy_(mine->weight);
    theirs->bias.copy_(mine->bias);
  }
  auto x = torch::randn({2, 4});
  EXPECT_TRUE(torch::equal(mine(x), theirs(x)));
  EXPECT_TRUE(torch::equal(mine->forward(x), theirs->forward(x)));
  EXPECT_FALSE(mine->has_hooks());
  EXPECT_EQ(mine->type_name(), "Linear");
  EXPECT_TRUE(mine->standard_layer());
  EXPECT_EQ(mine->named_parameters().size(), 2u);
  std::ostringstream os;
  os << *mine;
  EXPECT_NE(os.str().find("in_features=4"), std::string::npos) << os.str();
}

TEST(ModuleHooks, BothCallsOfATypedMemberRunTheHooks) {
  MlpBlock block(4, 8);
  std::vector<std::string> seen;
  for (auto* name : {"up", "down"})
    tandem::nn::hookable(*block->named_children()[name])
        ->register_forward_pre_hook("log", [&seen, name](const std::vector<at::Tensor>& in) {
          ASSERT_EQ(in.size(), 1u);
          seen.push_back(name);
        });
  block->register_forward_pre_hook("log", [&](const std::vector<at::Tensor>&) { seen.push_back("block"); });
  auto x = torch::randn({2, 4});
  auto a = block(x);
  auto b = block->forward(x);
  EXPECT_EQ(seen, (std::vector<std::string>{"block", "up", "down", "block", "up", "down"}));
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_EQ(block->type_name(), "MlpBlock");
  EXPECT_FALSE(block->standard_layer());
  EXPECT_EQ(tandem::nn::module_type_name(*torch::nn::Linear(2, 2)), "Linear");
  EXPECT_EQ(tandem::nn::module_type_name(*block), "MlpBlock");
}

TEST(ModuleHooks, WrappersRunByOrderAndARedirectReplacesTheCall) {
  tandem::nn::Linear fc(3, 3);
  std::vector<int> trace;
  auto wrapper = [&trace](int id) {
    return [&trace, id](const std::vector<at::Tensor>& in, const TensorFunction& next) {
      trace.push_back(id);
      auto out = next(in);
      trace.push_back(-id);
      return out;
    };
  };
  fc->hooks().add("b", 200, wrapper(2));
  fc->hooks().add("a", 100, wrapper(1));
  fc->hooks().add("c", 200, wrapper(3));
  auto x = torch::randn({1, 3});
  auto y = fc(x);
  EXPECT_EQ(trace, (std::vector<int>{1, 2, 3, -3, -2, -1}));
  EXPECT_TRUE(torch::allclose(y, torch::nn::functional::linear(x, fc->weight, fc->bias)));
  // A second wrapper of the same name replaces the first.
  fc->hooks().add("a", 100, wrapper(7));
  trace.clear();
  fc(x);
  EXPECT_EQ(trace, (std::vector<int>{7, 2, 3, -3, -2, -7}));
  auto twice = std::make_shared<torch::nn::Module>();
  fc->hooks().redirect(twice, [](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{in[0] * 2};
  }, "twice");
  EXPECT_TRUE(torch::equal(fc(x), x * 2));
  EXPECT_EQ(fc->hooks().names(),
            (std::vector<std::string>{"a", "b", "c", "redirect: twice"}));
  EXPECT_EQ(fc->hooks().redirected_to(), twice);
  EXPECT_TRUE(fc->hooks().remove("b"));
  EXPECT_FALSE(fc->hooks().remove("b"));
  torch::nn::Sequential holder;
  holder->push_back("fc", fc);
  auto described = tandem::nn::describe_hooks(*holder);
  ASSERT_EQ(described.size(), 1u);
  EXPECT_EQ(described[0].first, "fc");
  EXPECT_EQ(described[0].second.size(), 3u);
}

TEST(ModuleHooks, OtherArgumentsAreHeldAndTuplesComeBack) {
  Scaled m;
  std::vector<size_t> counts;
  m->register_forward_hook("count", [&](const std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    counts = {in.size(), out.size()};
    out[1] = out[1] + 1;  // a post-hook may change the outputs
  });
  auto x = torch::randn({2, 3}), y = torch::randn({2, 3});
  auto [h, s] = m->forward(x, 0.5, y);
  EXPECT_EQ(counts, (std::vector<size_t>{2, 2}));
  EXPECT_TRUE(torch::allclose(h, m->fc->forward(x) * 0.5));
  EXPECT_TRUE(torch::allclose(s, h + y + 1));
  EXPECT_TRUE(m->tensor_forward());  // the double is held, the tuple seen
  EXPECT_FALSE(Count()->tensor_forward());
}

TEST(ModuleHooks, AHookedCallOfAForwardReturningNoTensorsIsRefused) {
  Count c;
  EXPECT_EQ(c(torch::ones({2, 2})), 4);  // without hooks: the forward as it is
  c->register_forward_pre_hook("x", [](const std::vector<at::Tensor>&) {});
  try {
    c(torch::ones({2, 2}));
    FAIL() << "expected a refusal";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("Count"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("return tensors"), std::string::npos) << e.what();
  }
}

TEST(ModuleHooks, OverloadedForwardsAreHookedToo) {
  TwoWays m;
  int calls = 0;
  m->register_forward_pre_hook("n", [&](const std::vector<at::Tensor>&) { ++calls; });
  auto x = torch::full({2}, 3.0), y = torch::full({2}, 4.0);
  EXPECT_TRUE(torch::equal(m->forward(x), x * 2));
  EXPECT_TRUE(torch::equal(m->forward(x, y), x * y));
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(m->type_name(), "TwoWays");
}

TEST(ModuleHooks, ASequentialTakesHookableModulesAndRunsTheirHooks) {
  torch::manual_seed(1);
  torch::nn::Sequential seq(MlpBlock(4, 8), tandem::nn::Linear(4, 2));
  int calls = 0;
  for (const auto& m : seq->children())
    tandem::nn::hookable(*m)->register_forward_pre_hook("n", [&](const std::vector<at::Tensor>&) { ++calls; });
  auto y = seq->forward(torch::randn({3, 4}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(calls, 2);
}

// A wrapper that keeps `next` and runs it in the backward (activation checkpointing): the
// gradients equal those of the plain call.
TEST(ModuleHooks, AWrapperMayRunTheRestAgainInTheBackward) {
  torch::manual_seed(2);
  MlpBlock plain(4, 8), wrapped(4, 8);
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < plain->parameters().size(); ++i)
      wrapped->parameters()[i].copy_(plain->parameters()[i]);
  }
  int runs = 0;
  wrapped->hooks().add("checkpoint", tandem::nn::order::kCheckpoint,
                       [&runs](const std::vector<at::Tensor>& in, const TensorFunction& next) {
                         return tandem::parallel::checkpoint(
                             [&runs, next](const std::vector<at::Tensor>& x) {
                               ++runs;
                               return next(x);
                             },
                             in);
                       });
  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto x2 = x.detach().clone().requires_grad_();
  plain(x).pow(2).sum().backward();
  wrapped(x2).pow(2).sum().backward();
  EXPECT_EQ(runs, 2);  // the forward, and the recompute
  for (size_t i = 0; i < plain->parameters().size(); ++i)
    EXPECT_TRUE(torch::allclose(plain->parameters()[i].grad(), wrapped->parameters()[i].grad()));
  EXPECT_TRUE(torch::allclose(x.grad(), x2.grad()));
}

struct DropMlpImpl : torch::nn::Module {
  DropMlpImpl()
      : up(register_module("up", tandem::nn::Linear(4, 8))),
        drop(register_module("drop", tandem::nn::Dropout(0.5))),
        down(register_module("down", tandem::nn::Linear(8, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return down(drop->forward(up(x))); }
  tandem::nn::Linear up;
  tandem::nn::Dropout drop;
  tandem::nn::Linear down;
};
TANDEM_MODULE(DropMlp);

// Tensor parallel redirects the typed members' calls to the planned layers, and a rank_random
// entry makes the dropout draw from the tp rank's stream while the default stream is untouched.
TEST(ModuleHooks, APlanRedirectsTypedMembersAndGivesDropoutTheRankStream) {
  torch::manual_seed(3);
  DropMlp m;
  auto old_up = m->up;
  tandem::parallel::TensorParallelPlan plan;
  plan.colwise("up").rowwise("down").rank_random("drop", 7);
  tandem::parallel::parallelize_module(*m, tandem::ProcessGroup::single(), plan);
  auto planned = std::dynamic_pointer_cast<tandem::parallel::ColumnParallelLinearImpl>(
      m->named_children()["up"]);
  ASSERT_NE(planned, nullptr);
  EXPECT_EQ(old_up->hooks().redirected_to(), planned);
  auto names = tandem::nn::describe_hooks(*m);
  ASSERT_EQ(names.size(), 1u);  // drop: the planned layers replaced up and down among the children
  EXPECT_EQ(names[0].first, "drop");
  EXPECT_EQ(names[0].second, (std::vector<std::string>{"tensor-parallel rank stream"}));
  auto x = torch::randn({3, 4});
  auto h = planned->forward(x);
  EXPECT_TRUE(torch::allclose(m->up(x), h));  // the typed member computes the planned layer
  // The dropout mask: the rank stream's, not the default one's.
  const auto before = torch::randn({1});
  torch::manual_seed(9);
  tandem::parallel::TensorParallelRng expected_stream(7, 0);
  torch::Tensor expected;
  {
    auto scope = expected_stream.scope();
    expected = torch::dropout(h, 0.5, true);
  }
  torch::manual_seed(9);
  auto got = m->drop(h);
  EXPECT_TRUE(torch::equal(got, expected));
  auto next_default = torch::randn({4});
  torch::manual_seed(9);
  EXPECT_TRUE(torch::equal(next_default, torch::randn({4})));  // the default stream did not move
  (void)before;
  // A torch::nn::Dropout cannot take the stream: refused, naming the hookable holder.
  torch::nn::Sequential plain(torch::nn::Linear(4, 4), torch::nn::Dropout(0.5));
  tandem::parallel::TensorParallelPlan bad;
  bad.rank_random("1", 7);
  try {
    tandem::parallel::parallelize_module(*plain, tandem::ProcessGroup::single(), bad);
    FAIL() << "expected a refusal";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tandem::nn::Dropout"), std::string::npos) << e.what();
  }
}

}  // namespace
