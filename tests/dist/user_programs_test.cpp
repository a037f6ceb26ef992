// Programs written in LibTorch's usual styles (tests/dist/user_programs_worker.cpp) under every
// layout they can take: N ranks against one process on the global batch (the MNIST convnet with
// typed members and a mapped torch::data data set, the LSTM returning its state), the DCGAN loop
// with BatchNorm and two optimizers against a hand-written allreduce-mean of its gradients, each
// within 1e-5; gradients cleared through the module, a `p.grad().zero_()` loop or the prepared
// optimizer; what cannot take effect refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "../common/launch.h"

using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;
using tandem::testing::max_rel_diff;
using tandem::testing::read_floats;
using tandem::testing::RunResult;

namespace {

const std::string kWorker = USER_PROGRAMS_WORKER;

std::string temp_path(const std::string& name) {
  return tandem::testing::temp_path("user-programs", name);
}

std::vector<std::string> zero(int stage) {
  return {"--use_deepspeed", "--zero_stage", std::to_string(stage)};
}

struct Trained {
  RunResult run;
  std::vector<float> state;
};

// Trainings gathered first and run together: one launch per number of ranks
// (tandem::testing::launch_jobs), then read by name.
class Trainings {
 public:
  void add(const std::string& name, int n, const std::string& mode, std::vector<std::string> flags,
           std::vector<std::string> args, int64_t batch) {
    for (const auto& job : jobs_)
      if (std::get<0>(job) == name) return;  // one training under each name
    std::vector<std::string> all{mode, "--out", temp_path(name + ".bin"), "--batch",
                                 std::to_string(batch)};
    all.insert(all.end(), args.begin(), args.end());
    jobs_.emplace_back(name, n, tandem::testing::Job{all, LaunchOptions().flags(flags).timeout_s(180)});
  }
  void run() { results_ = tandem::testing::launch_jobs_by_size(kWorker, jobs_); }
  Trained get(const std::string& name) const {
    const auto& r = results_.at(name);
    EXPECT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    const auto out = temp_path(name + ".bin");
    auto state = read_floats(out);
    std::remove(out.c_str());
    return {r, state};
  }

 private:
  std::vector<std::tuple<std::string, int, tandem::testing::Job>> jobs_;
  std::map<std::string, RunResult> results_;
};

}  // namespace

// The official MNIST example's convnet, gradients cleared each of the ways LibTorch programs
// clear them, on 2 and 3 ranks under data parallel and ZeRO 1 and 2: one process on the global
// batch. ZeRO-3 finds nothing it can release in typed members: refused by name with the fixes.
TEST(UserPrograms, TypedMemberConvnetEqualsOneProcessUnderEveryLayout) {
  struct Case {
    int n;
    std::vector<std::string> flags;
    std::string zero_grad;
  };
  const std::vector<Case> cases = {
      {2, {}, "module"},         {2, zero(1), "grad_loop"}, {2, zero(2), "module"},
      {2, zero(2), "grad_loop"}, {3, {}, "grad_loop"},      {3, zero(2), "module"},
  };
  Trainings t;
  std::vector<std::string> names;
  for (const auto& c : cases) {
    const std::string name = "mnist-" + std::to_string(c.n) + "-" +
                             (c.flags.empty() ? "ddp" : "zero" + c.flags.back()) + "-" + c.zero_grad;
    const std::string key = std::to_string(c.n) + "-" + c.zero_grad;
    t.add("ref-" + key, 1, "mnist", {}, {"--zero_grad", c.zero_grad}, 8 * c.n);  // by global batch
    t.add(name, c.n, "mnist", c.flags, {"--zero_grad", c.zero_grad}, 8);
    names.push_back(name);
  }
  // Several ZeRO-2 units (2 KB buckets), reduced at different points of each backward, cleared
  // through the module and through a p.grad().zero_() loop.
  for (const char* route : {"module", "grad_loop"})
    t.add(std::string("mnist-buckets-") + route, 2, "mnist", zero(2),
          {"--zero_grad", route, "--small_buckets"}, 8);
  // Accumulation (2 micro-steps, zero_grad after the step) on 2 ranks.
  auto acc_flags = zero(2);
  acc_flags.insert(acc_flags.end(), {"--gradient_accumulation_steps", "2"});
  t.add("mnist-acc-ref", 1, "mnist", {"--gradient_accumulation_steps", "2"}, {}, 16);
  t.add("mnist-acc", 2, "mnist", acc_flags, {}, 8);
  // bf16 autocast under ZeRO-2 against data parallel in bf16 on the same per-rank batches (the
  // same bf16 kernels: within 1e-5), and against one process on the global batch within bf16's
  // resolution (a batch of another size takes other kernel blocking, so other bf16 roundings:
  // measured 6.7e-4 after 6 steps).
  const std::vector<std::string> bf16{"--mixed_precision", "bf16"};
  auto bf16_zero2 = zero(2);
  bf16_zero2.insert(bf16_zero2.end(), bf16.begin(), bf16.end());
  t.add("mnist-bf16-ref", 1, "mnist", bf16, {"--zero_grad", "module"}, 16);
  t.add("mnist-bf16-ddp", 2, "mnist", bf16, {"--zero_grad", "module"}, 8);
  t.add("mnist-bf16", 2, "mnist", bf16_zero2, {"--zero_grad", "module"}, 8);
  // Declared with TANDEM_MODULE, the whole model is one ZeRO-3 unit (FSDP's root wrap), said
  // in its line, and trains as one process does.
  t.add("mnist-zero3", 2, "mnist", zero(3), {"--zero_grad", "module", "--tandem_module"}, 8);
  t.run();

  std::map<std::string, std::vector<float>> refs;  // one process, by global batch and variant
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    const std::string key = std::to_string(c.n) + "-" + c.zero_grad;
    if (!refs.count(key)) refs[key] = t.get("ref-" + key).state;
    const auto& ref = refs[key];
    auto got = t.get(names[i]);
    ASSERT_FALSE(ref.empty()) << names[i];
    EXPECT_LE(max_rel_diff(got.state, ref), 1e-5) << names[i] << "\n" << got.run.output;
    EXPECT_EQ(count_of(got.run.output, "mnist trained 6 steps"), 1) << got.run.output;
  }
  for (const char* route : {"module", "grad_loop"}) {
    auto got = t.get(std::string("mnist-buckets-") + route);
    EXPECT_LE(max_rel_diff(got.state, refs.at(std::string("2-") + route)), 1e-5)
        << route << "\n" << got.run.output;
  }
  auto ref = t.get("mnist-acc-ref");
  auto got = t.get("mnist-acc");
  EXPECT_LE(max_rel_diff(got.state, ref.state), 1e-5) << got.run.output;
  ref = t.get("mnist-bf16-ref");
  auto ddp_bf16 = t.get("mnist-bf16-ddp");
  got = t.get("mnist-bf16");
  EXPECT_LE(max_rel_diff(got.state, ddp_bf16.state), 1e-5) << got.run.output;
  EXPECT_LE(max_rel_diff(got.state, ref.state), 1.0 / 128) << got.run.output;
  got = t.get("mnist-zero3");
  EXPECT_LE(max_rel_diff(got.state, refs.at("2-module")), 1e-5) << got.run.output;
  EXPECT_EQ(count_of(got.run.output, "zero-3 on model 1 (HookedNet): 1 unit, 8 of 8 parameters "
                                     "sharded (100.0% of the elements)"),
            1)
      << got.run.output;
  // ZeRO-3: refused by name.
  auto r = launch(2, kWorker, {"mnist"}, LaunchOptions().flags(zero(3)).timeout_s(120));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_GE(count_of(r.output, "ZeRO-3 finds no module of model 1 (Net)"), 1) << r.output;
  EXPECT_GE(count_of(r.output, "TANDEM_MODULE(Net)"), 1) << r.output;
  EXPECT_GE(count_of(r.output, "--zero_stage 2"), 1) << r.output;
}

// zero_grad() before the forward inside an accumulation window discards the earlier micro-steps:
// said once, naming the fix.
TEST(UserPrograms, ZeroGradInsideAnAccumulationWindowIsSaid) {
  const auto flags = LaunchOptions().flags({"--gradient_accumulation_steps", "2"}).timeout_s(120);
  const auto r = tandem::testing::launch_jobs(
      2, kWorker,
      {{{"mnist", "--zero_grad", "before", "--batch", "4"}, flags},
       {{"mnist", "--zero_grad", "after", "--batch", "4"}, flags}});
  EXPECT_EQ(r[0].exit_code, 0) << r[0].output;
  EXPECT_EQ(count_of(r[0].output, "zero_grad: this call clears the gradients of 1 earlier micro-step"),
            2)
      << r[0].output;
  EXPECT_GE(count_of(r[0].output, "Call zero_grad() after step()"), 2) << r[0].output;
  // After the step (the README's place): nothing said.
  EXPECT_EQ(r[1].exit_code, 0) << r[1].output;
  EXPECT_EQ(count_of(r[1].output, "zero_grad: this call clears"), 0) << r[1].output;
}

// An LSTM language model returning its state (carried across batches), through
// split_between_processes: N ranks equal one process on all the rows.
TEST(UserPrograms, LstmReturningItsStateEqualsOneProcess) {
  Trainings t;
  t.add("lstm-ref", 1, "lstm", {}, {}, 8);
  t.add("lstm-ref3", 1, "lstm", {}, {}, 6);
  const std::vector<std::vector<std::string>> layouts{{}, zero(1), zero(2)};
  auto name_of = [](const std::vector<std::string>& flags) {
    return "lstm-2-" + (flags.empty() ? std::string("ddp") : "zero" + flags.back());
  };
  for (const auto& flags : layouts) t.add(name_of(flags), 2, "lstm", flags, {}, 4);
  t.add("lstm-3-ddp", 3, "lstm", {}, {}, 2);
  t.run();
  auto ref = t.get("lstm-ref");
  ASSERT_FALSE(ref.state.empty());
  for (const auto& flags : layouts) {
    auto got = t.get(name_of(flags));
    EXPECT_LE(max_rel_diff(got.state, ref.state), 1e-5) << name_of(flags) << "\n" << got.run.output;
  }
  auto ref3 = t.get("lstm-ref3");
  auto got3 = t.get("lstm-3-ddp");
  EXPECT_LE(max_rel_diff(got3.state, ref3.state), 1e-5) << got3.run.output;
}

// LibTorch's DCGAN loop (BatchNorm in both models, two Adam optimizers, zero_grad() through each
// module, the generator's backward after the discriminator's step): equal to a hand-written
// allreduce-mean of the gradients on the same per-rank batches, parameters and BatchNorm
// statistics; the step count is one per iteration, not one per optimizer.
TEST(UserPrograms, GanWithBatchNormEqualsHandWrittenDataParallel) {
  const std::vector<std::pair<int, std::vector<std::string>>> layouts{
      {2, {}}, {3, {}}, {2, zero(1)}, {2, zero(2)}};
  auto name_of = [](int n, const std::vector<std::string>& flags) {
    return "gan-" + std::to_string(n) + "-" +
           (flags.empty() ? std::string("ddp") : "zero" + flags.back());
  };
  Trainings t;
  for (const auto& [n, flags] : layouts)
    t.add(name_of(n, flags), n, "gan", flags,
          {"--ref_out", temp_path(name_of(n, flags) + "-ref.bin")}, 8);
  t.run();
  for (const auto& [n, flags] : layouts) {
    const std::string name = name_of(n, flags);
    auto got = t.get(name);
    const auto ref = read_floats(temp_path(name + "-ref.bin"));
    ASSERT_FALSE(ref.empty()) << name << "\n" << got.run.output;
    EXPECT_LE(max_rel_diff(got.state, ref), 1e-5) << name << "\n" << got.run.output;
    EXPECT_EQ(count_of(got.run.output, "gan trained 6 steps"), 1) << got.run.output;
  }
}

// Accelerate's split_between_processes: 7 rows on 3 ranks are 3, 2, 2 in rank order; padded, every
// rank has 3, the short ones repeating their last row; a list likewise.
TEST(UserPrograms, SplitBetweenProcessesAsAccelerate) {
  auto r = launch(3, kWorker, {"split"}, LaunchOptions().timeout_s(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"split plain rank 0: 0 1 2\n", "split plain rank 1: 3 4\n",
                           "split plain rank 2: 5 6\n", "split padded rank 0: 0 1 2\n",
                           "split padded rank 1: 3 4 4\n", "split padded rank 2: 5 6 6\n",
                           "split list rank 1: d e e\n"})
    EXPECT_EQ(count_of(r.output, line), 1) << line << "\n" << r.output;
}

// Note [Trainable parameters are fixed at prepare]: a parameter made to train after prepare is
// refused at the optimizer step under data parallel and ZeRO-2 (before, the replicas drifted
// apart, or it never trained), and trains on one process as LibTorch does; one frozen after
// prepare is named as such under data parallel (before: "received no gradient ... set
// requires_grad(false)"). LBFGS steps through the prepared optimizer with its closure and
// equals one process; under ZeRO it is refused at prepare. Note [Schedulers step with the
// optimizer]: a scheduler stepped on every micro-batch under accumulation is said once. Note
// [Replaced parameter storage]: torch::save and torch::load into the prepared model mid-run
// (LibTorch's load replaces each parameter's storage) trains on bitwise as without them under
// data parallel (before: "received no gradient" for every parameter), and is refused under
// ZeRO-2, whose parameters are views of its flat storage.
TEST(UserPrograms, ParametersMadeTrainableAfterPrepareLbfgsAndSchedulersAreHandled) {
  using Run = std::tuple<std::string, int, tandem::testing::Job>;
  // LBFGS with its strong Wolfe line search for 1 step (5 iterations, each evaluating the loss
  // as often as the line search asks): the sums' rounding moves it 6e-8 of the largest element
  // from one process on both builds; later steps carry it forward and the line search can branch
  // on it (1e-4 after 2 steps under ASan). Handed each rank's own loss, the ranks evaluate it a
  // different number of times and the run fails; gradients of the wrong ranks move whole steps.
  auto job = [](const std::string& idiom, const std::string& out, std::vector<std::string> flags,
                bool may_fail) {
    std::vector<std::string> args{"mlp", "--idiom", idiom, "--out", out};
    if (idiom == "lbfgs") args.insert(args.end(), {"--steps", "1"});
    tandem::testing::Job j{args, LaunchOptions().flags(std::move(flags)).timeout_s(120)};
    j.may_fail = may_fail;
    return j;
  };
  const auto one = temp_path("lbfgs-one.bin"), two = temp_path("lbfgs-two.bin");
  const auto plain = temp_path("mlp-plain.bin"), loaded = temp_path("mlp-loaded.bin");
  const auto clip_one = temp_path("clip-one.bin"), clip_two = temp_path("clip-two.bin");
  auto r = tandem::testing::launch_jobs_by_size(
      kWorker, std::vector<Run>{
                   {"lbfgs one", 1, job("lbfgs", one, {}, false)},
                   {"unfreeze one", 1, job("unfreeze", "", {}, false)},
                   {"lbfgs", 2, job("lbfgs", two, {}, false)},
                   {"steplr", 2, job("steplr", "", {"--gradient_accumulation_steps", "2"}, false)},
                   {"unfreeze ddp", 2, job("unfreeze", "", {}, true)},
                   {"unfreeze zero-2", 2, job("unfreeze", "", zero(2), true)},
                   {"freeze ddp", 2, job("freeze_after", "", {}, true)},
                   {"lbfgs zero-2", 2, job("lbfgs", "", zero(2), true)},
                   {"plain", 2, job("none", plain, {}, false)},
                   {"torch_load", 2, job("torch_load", loaded, {}, false)},
                   {"torch_load zero-2", 2, job("torch_load", loaded + ".z", zero(2), true)},
                   {"torch_load zero-3", 2, job("torch_load", loaded + ".z3", zero(3), true)},
                   {"clip_user one", 1, job("clip_user", clip_one, {}, false)},
                   {"clip_user", 2, job("clip_user", clip_two, {}, false)},
                   {"clip_user zero-2", 2, job("clip_user", "", zero(2), true)}});
  for (const std::string name : {"lbfgs one", "unfreeze one", "lbfgs", "steplr", "plain",
                                 "torch_load", "clip_user one", "clip_user"})
    EXPECT_EQ(r[name].exit_code, 0) << name << ": " << r[name].output;
  EXPECT_EQ(count_of(r["lbfgs"].output, "mlp trained 1 steps"), 1) << r["lbfgs"].output;
  const auto a = read_floats(one), b = read_floats(two);
  ASSERT_EQ(a.size(), 8u * 4 + 8 + 8 + 1);
  // The largest |x - y| over two dumps of one size, and the largest |x|.
  auto difference = [](const std::vector<float>& x, const std::vector<float>& y) {
    double most = 0, largest = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      most = std::max(most, std::fabs(double(x[i]) - y[i]));
      largest = std::max(largest, std::fabs(double(x[i])));
    }
    return std::make_pair(most, largest);
  };
  {
    const auto [most, largest] = difference(a, b);
    EXPECT_LE(most, 1e-5 * largest);
  }
  EXPECT_EQ(count_of(r["steplr"].output, "stepped 2 times in one optimizer step"), 1)
      << r["steplr"].output;
  auto refused = [&](const std::string& name, const std::string& words) {
    EXPECT_GT(r[name].exit_code, 0) << name << ": " << r[name].output;
    EXPECT_GE(count_of(r[name].output, words), 2) << name << ": " << words << "\n"
                                                  << r[name].output;  // every rank
  };
  refused("unfreeze ddp", "require gradients now but did not when acc.prepare(model) ran: "
                          "fc1.weight, fc1.bias");
  refused("unfreeze zero-2", "require gradients now but did not when acc.prepare(model) ran");
  refused("freeze ddp", "were frozen (requires_grad false) after acc.prepare(model): fc1.weight");
  refused("lbfgs zero-2", "torch::optim::LBFGS under zero-2");
  refused("torch_load zero-2", "was replaced after acc.prepare(model) (torch::load into the "
                               "prepared model");
  // Under ZeRO-3 the parameters hold no values between uses: torch::save would write a file
  // without the weights (Note [Saving a sharded model]).
  refused("torch_load zero-3",
          "torch::save of Mlp: its parameters fc1.weight, fc1.bias, "
          "fc2.weight, fc2.bias hold no values here");
  refused("torch_load zero-3", "acc.save_model(model, dir)");
  // LibTorch's clip_grad_norm_ after the backward: under data parallel each rank clips the
  // averaged gradients, as one process clips its own (the same steps); under ZeRO-2 the gradients
  // live in shards and its item() on them is named (Note [Reading a sharded gradient]).
  {
    const auto c1 = read_floats(clip_one), c2 = read_floats(clip_two),
               unclipped = read_floats(plain);
    ASSERT_EQ(c1.size(), a.size());
    ASSERT_EQ(c2.size(), a.size());
    ASSERT_EQ(unclipped.size(), a.size());
    const auto [most, largest] = difference(c1, c2);
    const double moved = difference(c2, unclipped).first;
    EXPECT_LE(most, 1e-6 * largest);
    EXPECT_GT(moved, 1e-3 * largest);  // the clipping took effect
  }
  refused("clip_user zero-2", "Tensor::item() on a meta tensor");
  refused("clip_user zero-2", "call acc.clip_grad_norm_(model->parameters(), max_norm)");
  const auto p = read_floats(plain), l = read_floats(loaded);
  ASSERT_EQ(p.size(), a.size());
  EXPECT_EQ(p, l);
  for (const auto& f : {one, two, plain, loaded, clip_one, clip_two}) std::remove(f.c_str());
}
