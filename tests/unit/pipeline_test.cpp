// Pipeline schedules run by the simulator (no deadlock, the bubble, in-flight micro-batches), the
// errors for too few micro-batches and indivisible batches, split_sequential, and a one-stage
// Pipeline against plain training.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tandem/comm/process_group.h"
#include "tandem/error.h"
#include "tandem/parallel/pipeline.h"

namespace tp = tandem::parallel;
using tp::PipelineAction;
using tp::ScheduleKind;
using K = PipelineAction::Kind;

namespace {

std::string listing(const std::vector<std::vector<PipelineAction>>& actions) {
  std::string s;
  for (size_t r = 0; r < actions.size(); ++r) {
    s += "stage " + std::to_string(r) + ":";
    for (const auto& a : actions[r]) s += " " + tp::to_string(a);
    s += "\n";
  }
  return s;
}

}  // namespace

// Every (schedule, stages 1-4, micro-batches 1-8): m < p is refused with the advice; the others
// run to completion under rendezvous sends in 3 (m + p - 1) unit steps (a forward 1, a backward
// 2), each stage busy 3m of them, so the bubble is (p - 1) / (m + p - 1) for both schedules; 1F1B holds at most p - s
// micro-batches on stage s (exactly min(p - s, m)), GPipe all m.
TEST(PipelineSchedule, EveryCombinationRunsWithTheExpectedBubble) {
  int ran = 0, refused = 0;
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 8; ++m) {
        const std::string what = tp::to_string(kind) + " p=" + std::to_string(p) +
                                 " m=" + std::to_string(m);
        if (m < p) {
          try {
            tp::pipeline_schedule(kind, p, m);
            ADD_FAILURE() << what << " was not refused";
          } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("use at least " + std::to_string(p) +
                                                 " micro-batches"),
                      std::string::npos)
                << e.what();
            EXPECT_NE(std::string(e.what()).find("mostly idle"), std::string::npos) << e.what();
            ++refused;
          }
          continue;
        }
        const auto actions = tp::pipeline_schedule(kind, p, m);
        ASSERT_EQ(actions.size(), static_cast<size_t>(p)) << what;
        for (int s = 0; s < p; ++s) {
          // m forwards, m backwards, and one transfer per neighbour and micro-batch each way.
          const auto count = [&](K k) {
            return std::count_if(actions[s].begin(), actions[s].end(),
                                 [k](const PipelineAction& a) { return a.kind == k; });
          };
          EXPECT_EQ(count(K::kForward), m) << what;
          EXPECT_EQ(count(K::kBackward), m) << what;
          EXPECT_EQ(count(K::kSendActivation), s < p - 1 ? m : 0) << what;
          EXPECT_EQ(count(K::kRecvActivation), s > 0 ? m : 0) << what;
          EXPECT_EQ(count(K::kSendGradient), s > 0 ? m : 0) << what;
          EXPECT_EQ(count(K::kRecvGradient), s < p - 1 ? m : 0) << what;
        }
        const auto sim = tp::simulate_schedule(actions);
        ASSERT_TRUE(sim.error.empty()) << what << ": " << sim.error << "\n" << listing(actions);
        EXPECT_FALSE(sim.deadlock);
        EXPECT_EQ(sim.time_steps, 3 * (m + p - 1)) << what << "\n" << listing(actions);
        for (int s = 0; s < p; ++s) {
          EXPECT_EQ(sim.busy[s], 3 * m) << what;
          if (kind == ScheduleKind::k1F1B) {
            EXPECT_LE(sim.max_in_flight[s], p - s) << what << " stage " << s;
            EXPECT_EQ(sim.max_in_flight[s], std::min(p - s, m)) << what << " stage " << s;
          } else {
            EXPECT_EQ(sim.max_in_flight[s], m) << what << " stage " << s;
          }
        }
        EXPECT_NEAR(sim.bubble_fraction, double(p - 1) / (m + p - 1), 1e-12) << what;
        ++ran;
      }
    }
  }
  EXPECT_EQ(ran, 2 * (8 + 7 + 6 + 5));
  EXPECT_EQ(refused, 2 * (0 + 1 + 2 + 3));
}

// Interleaved 1F1B over p = 2-4 ranks with v = 2-3 stages each and m = p, 2p, 3p micro-batches:
// every rank runs each of its stages' forwards and backwards once, in (p - 1) / (v m + p - 1)
// idle share (Megatron's formula: the bubble shrinks by v), deadlock-free under rendezvous sends.
// Micro-batches that are not a multiple of p, and virtual stages under another schedule, are
// refused with the fix.
TEST(PipelineSchedule, InterleavedShrinksTheBubbleByTheVirtualStages) {
  int ran = 0;
  for (int p = 2; p <= 4; ++p)
    for (int v = 2; v <= 3; ++v)
      for (int m = p; m <= 3 * p; m += p) {
        const std::string what =
            "p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m);
        const auto actions = tp::pipeline_schedule(ScheduleKind::kInterleaved1F1B, p, m, v);
        ASSERT_EQ(actions.size(), static_cast<size_t>(p)) << what;
        for (int r = 0; r < p; ++r)
          for (int c = 0; c < v; ++c) {
            const auto count = [&](K k) {
              return std::count_if(actions[r].begin(), actions[r].end(),
                                   [&](const PipelineAction& a) { return a.kind == k && a.chunk == c; });
            };
            const int g = c * p + r;
            EXPECT_EQ(count(K::kForward), m) << what;
            EXPECT_EQ(count(K::kBackward), m) << what;
            EXPECT_EQ(count(K::kSendActivation), g < p * v - 1 ? m : 0) << what << " stage " << g;
            EXPECT_EQ(count(K::kRecvGradient), g < p * v - 1 ? m : 0) << what << " stage " << g;
            EXPECT_EQ(count(K::kRecvActivation), g > 0 ? m : 0) << what << " stage " << g;
          }
        const auto sim = tp::simulate_schedule(actions, v);
        ASSERT_TRUE(sim.error.empty()) << what << ": " << sim.error << "\n" << listing(actions);
        EXPECT_EQ(sim.time_steps, 3 * (v * m + p - 1)) << what << "\n" << listing(actions);
        EXPECT_NEAR(sim.bubble_fraction, double(p - 1) / (v * m + p - 1), 1e-12) << what;
        const auto plain = tp::simulate_schedule(tp::pipeline_schedule(ScheduleKind::k1F1B, p, m));
        EXPECT_LT(sim.bubble_fraction, plain.bubble_fraction) << what;
        ++ran;
      }
  EXPECT_EQ(ran, 3 * 2 * 3);
  try {
    tp::pipeline_schedule(ScheduleKind::kInterleaved1F1B, 4, 6, 2);
    ADD_FAILURE() << "6 micro-batches over 4 ranks were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("not a multiple of 4: use 8 (or 4) micro-batches"),
              std::string::npos) << e.what();
  }
  try {
    tp::pipeline_schedule(ScheduleKind::k1F1B, 2, 4, 2);
    ADD_FAILURE() << "virtual stages under 1F1B were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("use the interleaved_1f1b schedule"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(tp::pipeline_schedule(ScheduleKind::kInterleaved1F1B, 2, 4, 0), std::invalid_argument);
}

// Zero bubble over p = 1-4 stages and m = p to 12 micro-batches: each micro-batch's input
// gradient (I) and weight gradient (W) run once per stage, I before W; no stage holds more
// micro-batches between F and W than 1F1B does (p - s); the run takes 3m + 2 (p - 1) unit steps
// against 1F1B's 3 (m + p - 1): (p - 1) weight gradients of each stage fill the bubble.
TEST(PipelineSchedule, ZeroBubbleFillsTheBubbleWithWeightGradients) {
  int ran = 0;
  for (int p = 1; p <= 4; ++p)
    for (int m = p; m <= 12; ++m) {
      const std::string what = "p=" + std::to_string(p) + " m=" + std::to_string(m);
      const auto actions = tp::pipeline_schedule(ScheduleKind::kZeroBubble, p, m);
      for (int s = 0; s < p; ++s) {
        const auto count = [&](K k) {
          return std::count_if(actions[s].begin(), actions[s].end(),
                               [k](const PipelineAction& a) { return a.kind == k; });
        };
        EXPECT_EQ(count(K::kForward), m) << what;
        EXPECT_EQ(count(K::kBackward), 0) << what;
        EXPECT_EQ(count(K::kBackwardInput), m) << what;
        EXPECT_EQ(count(K::kBackwardWeight), m) << what;
        EXPECT_EQ(count(K::kSendGradient), s > 0 ? m : 0) << what;
      }
      const auto sim = tp::simulate_schedule(actions);
      ASSERT_TRUE(sim.error.empty()) << what << ": " << sim.error << "\n" << listing(actions);
      EXPECT_EQ(sim.time_steps, 3 * m + 2 * (p - 1)) << what << "\n" << listing(actions);
      for (int s = 0; s < p; ++s) {
        EXPECT_EQ(sim.busy[s], 3 * m) << what;
        EXPECT_LE(sim.max_in_flight[s], p - s) << what << " stage " << s;
      }
      EXPECT_NEAR(sim.bubble_fraction, 2.0 * (p - 1) / (3 * m + 2 * (p - 1)), 1e-12) << what;
      ++ran;
    }
  EXPECT_EQ(ran, 12 + 11 + 10 + 9);
  // A W before its I is found by the simulator.
  auto sim = tp::simulate_schedule({{{K::kForward, 0}, {K::kBackwardWeight, 0}, {K::kBackwardInput, 0}}});
  EXPECT_NE(sim.error.find("before its input gradient"), std::string::npos) << sim.error;
  sim = tp::simulate_schedule({{{K::kForward, 0}, {K::kBackwardInput, 0}}});
  EXPECT_NE(sim.error.find("never runs the weight gradient of micro-batch 0"), std::string::npos)
      << sim.error;
}

// Schedule names as the launcher and config files give them.
TEST(PipelineSchedule, NamesParseAndUnknownOnesAreRefused) {
  EXPECT_EQ(tp::schedule_from_name("GPipe", "x"), ScheduleKind::kGPipe);
  EXPECT_EQ(tp::schedule_from_name("1f1b", "x"), ScheduleKind::k1F1B);
  EXPECT_EQ(tp::schedule_from_name("Interleaved1F1B", "x"), ScheduleKind::kInterleaved1F1B);
  EXPECT_EQ(tp::schedule_from_name("interleaved_1f1b", "x"), ScheduleKind::kInterleaved1F1B);
  EXPECT_EQ(tp::schedule_from_name("zero_bubble", "x"), ScheduleKind::kZeroBubble);
  EXPECT_EQ(tp::schedule_from_name("ZBH1", "x"), ScheduleKind::kZeroBubble);
  try {
    tp::schedule_from_name("ZBVZeroBubble", "--pp_schedule");
    ADD_FAILURE() << "ZBV was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--pp_schedule: unknown pipeline schedule 'ZBVZeroBubble'"),
              std::string::npos) << e.what();
  }
}

// The 1F1B lists of 2 stages and 2 micro-batches, spelled out: stage 0 warms up with one forward;
// stage 1 receives micro-batch 1's activation as soon as it is sent (before its backward of 0).
TEST(PipelineSchedule, OneFOneBOnTwoStages) {
  const auto a = tp::pipeline_schedule(ScheduleKind::k1F1B, 2, 2);
  EXPECT_EQ(listing(a),
            "stage 0: F0 sendA0 F1 sendA1 recvG0 B0 recvG1 B1\n"
            "stage 1: recvA0 F0 recvA1 B0 sendG0 F1 B1 sendG1\n");
}

// The simulator is strict: it finds cycles of waiting ranks (including one that buffered sends
// would survive but rendezvous sends do not), data used before it arrived, and missing work.
TEST(PipelineSchedule, SimulatorFindsDeadlocksAndInvalidOrders) {
  // Stage 0 waits for a gradient before sending the activation that stage 1 waits for.
  auto sim = tp::simulate_schedule({{{K::kForward, 0}, {K::kRecvGradient, 0}, {K::kSendActivation, 0}, {K::kBackward, 0}},
                                    {{K::kRecvActivation, 0}, {K::kForward, 0}, {K::kBackward, 0}, {K::kSendGradient, 0}}});
  EXPECT_TRUE(sim.deadlock);
  EXPECT_NE(sim.error.find("stage 0 at recvG0"), std::string::npos) << sim.error;
  // Stage 1 receives micro-batch 1 first while stage 0 sends micro-batch 0 first: with rendezvous
  // sends (tags keep them apart) both wait forever.
  sim = tp::simulate_schedule(
      {{{K::kForward, 0}, {K::kForward, 1}, {K::kSendActivation, 0}, {K::kSendActivation, 1},
        {K::kRecvGradient, 0}, {K::kRecvGradient, 1}, {K::kBackward, 0}, {K::kBackward, 1}},
       {{K::kRecvActivation, 1}, {K::kRecvActivation, 0}, {K::kForward, 0}, {K::kForward, 1},
        {K::kBackward, 0}, {K::kBackward, 1}, {K::kSendGradient, 0}, {K::kSendGradient, 1}}});
  EXPECT_TRUE(sim.deadlock) << sim.error;
  // A forward before its activation arrived.
  sim = tp::simulate_schedule({{{K::kForward, 0}, {K::kSendActivation, 0}, {K::kRecvGradient, 0}, {K::kBackward, 0}},
                               {{K::kForward, 0}, {K::kRecvActivation, 0}, {K::kBackward, 0}, {K::kSendGradient, 0}}});
  EXPECT_FALSE(sim.deadlock);
  EXPECT_NE(sim.error.find("not received"), std::string::npos) << sim.error;
  // A stage that skips a backward.
  sim = tp::simulate_schedule({{{K::kForward, 0}, {K::kForward, 1}, {K::kBackward, 0}}});
  EXPECT_NE(sim.error.find("never runs the backward of micro-batch 1"), std::string::npos)
      << sim.error;
}

TEST(SplitSequential, BalancedByChildrenSharingTheModules) {
  torch::nn::Sequential model(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 5),
                              torch::nn::Tanh(), torch::nn::Linear(5, 2));
  auto a = tp::split_sequential(model, 2, 0), b = tp::split_sequential(model, 2, 1);
  ASSERT_EQ(a->size(), 2u);
  ASSERT_EQ(b->size(), 3u);
  EXPECT_EQ(a->ptr(0).get(), model->ptr(0).get());  // the same objects, not copies
  EXPECT_EQ(b->ptr(2).get(), model->ptr(4).get());
  EXPECT_EQ(b->named_parameters().keys(), (std::vector<std::string>{"2.weight", "2.bias",
                                                                    "4.weight", "4.bias"}));
  auto x = torch::randn({6, 3});
  EXPECT_TRUE(b->forward(a->forward(x)).equal(model->forward(x)));
  // Four stages of five children: 1, 1, 1, 2.
  std::vector<size_t> sizes;
  for (int s = 0; s < 4; ++s) sizes.push_back(tp::split_sequential(model, 4, s)->size());
  EXPECT_EQ(sizes, (std::vector<size_t>{1, 1, 1, 2}));
  // Explicit boundaries.
  EXPECT_EQ(tp::split_sequential(model, std::vector<int64_t>{0, 4}, 0)->size(), 4u);
  EXPECT_EQ(tp::split_sequential(model, std::vector<int64_t>{0, 4}, 1)->ptr(0).get(),
            model->ptr(4).get());
  EXPECT_THROW(tp::split_sequential(model, 6, 0), std::invalid_argument);
  try {
    tp::split_sequential(model, std::vector<int64_t>{0, 3, 3}, 0);
    ADD_FAILURE() << "equal boundaries were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("strictly ascending"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tp::split_sequential(model, std::vector<int64_t>{1, 3}, 0), std::invalid_argument);
  EXPECT_THROW(tp::split_sequential(model, 2, 2), std::invalid_argument);
}

// One stage (a group of one process): the micro-batched step equals plain training on the
// batch, and a batch that the micro-batches do not divide is refused, saying so.
TEST(Pipeline, OneStageEqualsPlainTrainingAndRefusesIndivisibleBatches) {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 2));
  auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  auto mse = [](const at::Tensor& y, const at::Tensor& t) { return torch::mse_loss(y, t); };
  tp::Pipeline pipe(model, tandem::ProcessGroup::single(), mse,
                    tp::PipelineOptions().schedule(ScheduleKind::kGPipe).microbatches(4));
  auto x = torch::randn({12, 4}), y = torch::randn({12, 2});
  const double loss = pipe.step(x, y);
  auto ref_loss = torch::mse_loss(reference->forward(x), y);
  ref_loss.backward();
  EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-6 * std::abs(ref_loss.item<double>()));
  auto got = model->parameters(), want = reference->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(torch::allclose(got[i].grad(), want[i].grad(), 1e-5, 1e-7)) << i;
  try {
    pipe.step(torch::randn({10, 4}), torch::randn({10, 2}));
    ADD_FAILURE() << "a batch of 10 was split into 4 micro-batches";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("batch of 10 rows does not split into 4 micro-batches"),
              std::string::npos)
        << e.what();
  }
}

// Note [Pipeline checkpoint names]: the names are for the Accelerator's checkpoints; a Pipeline
// built directly writes none and refuses them rather than ignore them.
TEST(Pipeline, CheckpointNamesOutsideTheAcceleratorAreRefused) {
  torch::nn::Sequential model(torch::nn::Linear(4, 2));
  auto mse = [](const at::Tensor& y, const at::Tensor& t) { return torch::mse_loss(y, t); };
  try {
    tp::Pipeline pipe(model, tandem::ProcessGroup::single(), mse,
                      tp::PipelineOptions().checkpoint_names(
                          [](const std::string& n) { return "model." + n; }));
    ADD_FAILURE() << "checkpoint_names taken by a Pipeline that writes no checkpoint";
  } catch (const tandem::Refused& e) {
    EXPECT_NE(std::string(e.what()).find("build it with acc.prepare_pipeline"), std::string::npos)
        << e.what();
  }
}

// The zero-bubble split on one stage: the weight pass accumulates through the parameters' own
// accumulators, as backward() does: a Linear used twice (Module::parameters() lists its tensors
// twice) gets its gradient once, summed over both uses and the micro-batches, and a parameter's
// hook runs. Equal to the 1F1B pipeline bitwise, and to plain training.
TEST(Pipeline, ZeroBubbleOnOneStageEqualsBackwardWithSharedLayersAndHooks) {
  auto mse = [](const at::Tensor& y, const at::Tensor& t) { return torch::mse_loss(y, t); };
  std::vector<std::vector<at::Tensor>> grads;
  std::vector<int> hook_calls;
  for (auto kind : {ScheduleKind::k1F1B, ScheduleKind::kZeroBubble}) {
    torch::manual_seed(5);
    torch::nn::Linear shared(6, 6);
    torch::nn::Sequential model(shared, torch::nn::Tanh(), shared);
    ASSERT_EQ(model->parameters().size(), 4u);  // the shared weight and bias listed twice
    int calls = 0;
    shared->weight.register_hook([&calls](const at::Tensor& g) {
      ++calls;
      return g;
    });
    tp::Pipeline pipe(model, tandem::ProcessGroup::single(), mse,
                      tp::PipelineOptions().schedule(kind).microbatches(3));
    torch::manual_seed(6);
    auto x = torch::randn({9, 6}), y = torch::randn({9, 6});
    pipe.step(x, y);
    grads.push_back({shared->weight.grad().clone(), shared->bias.grad().clone()});
    hook_calls.push_back(calls);
    // Plain training on the whole batch.
    torch::manual_seed(5);
    torch::nn::Linear ref(6, 6);
    torch::nn::Sequential plain(ref, torch::nn::Tanh(), ref);
    torch::mse_loss(plain->forward(x), y).backward();
    EXPECT_TRUE(torch::allclose(shared->weight.grad(), ref->weight.grad(), 1e-5, 1e-7))
        << tp::to_string(kind);
    EXPECT_TRUE(torch::allclose(shared->bias.grad(), ref->bias.grad(), 1e-5, 1e-7))
        << tp::to_string(kind);
  }
  EXPECT_TRUE(grads[0][0].equal(grads[1][0]));
  EXPECT_TRUE(grads[0][1].equal(grads[1][1]));
  EXPECT_EQ(hook_calls[0], 3);  // once per micro-batch
  EXPECT_EQ(hook_calls[1], 3);
}
