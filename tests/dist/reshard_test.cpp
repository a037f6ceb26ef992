// Note [Resharding a checkpoint]: a run stopped after 2 of 5 steps (mid-epoch) under one layout
// and resumed under another ends equal to one uninterrupted dense run (the Sequential GPT with
// AdamW, a shuffled loader of 12 samples per step over all data-parallel ranks), within 1e-5 of
// each tensor's scale; the layout change is said in one line at load, and load_state's result
// says what it restored.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "../common/launch.h"
#include "../common/subprocess.h"

using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;

namespace {

const std::string kWorker = RESHARD_WORKER;

struct Layout {
  int processes;
  std::vector<std::string> flags;
};

// The largest value of every "check <name> <value>" line of the output.
std::map<std::string, double> worst_checks(const std::string& output) {
  std::map<std::string, double> worst;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("[rank ", 0) == 0) line = line.substr(line.find("] ") + 2);
    if (line.rfind("check ", 0) != 0) continue;
    const auto last = line.rfind(' ');
    const auto name = line.substr(6, last - 6);
    worst[name] = std::max(worst[name], std::stod(line.substr(last + 1)));
  }
  return worst;
}

// A layout change: saved after step 2 on `from` (named `saved_on` in the resumed run's line),
// resumed on `to` (`resumed_on`) for steps 2-4.
struct Change {
  std::string name;
  Layout from, to;
  std::string saved_on, resumed_on;
};

// Every change's two runs, as jobs of launches by size (tandem::testing::launch_jobs_by_size):
// first the saving runs (one per distinct `from`), then the resuming ones; each resumed run is
// checked against the dense run.
void expect_resumes_equal_dense(const std::vector<Change>& changes) {
  const auto root = tandem::testing::temp_path("reshard", "ckpts");
  std::system(("rm -rf " + root + " && mkdir -p " + root).c_str());
  std::map<std::string, std::string> dir_of;  // the saving run's directory, by saved_on
  std::vector<std::tuple<std::string, int, tandem::testing::Job>> saves, resumes;
  for (const auto& c : changes) {
    if (!dir_of.count(c.saved_on)) {
      const std::string dir = root + "/" + std::to_string(dir_of.size());
      dir_of[c.saved_on] = dir;
      saves.emplace_back(c.saved_on, c.from.processes,
                         tandem::testing::Job{{"--steps", "5", "--stop", "2", "--save_dir", dir},
                                              LaunchOptions().flags(c.from.flags).timeout_s(180)});
    }
    resumes.emplace_back(c.name, c.to.processes,
                         tandem::testing::Job{{"--steps", "5", "--load_dir", dir_of[c.saved_on]},
                                              LaunchOptions().flags(c.to.flags).timeout_s(180)});
  }
  auto saved = tandem::testing::launch_jobs_by_size(kWorker, saves);
  for (const auto& c : changes) {
    const auto& r = saved[c.saved_on];
    EXPECT_EQ(r.exit_code, 0) << c.saved_on << "\n" << r.output;
    EXPECT_EQ(count_of(r.output, "saved at step 2"), c.from.processes) << r.output;
  }
  auto resumed = tandem::testing::launch_jobs_by_size(kWorker, resumes);
  for (const auto& c : changes) {
    SCOPED_TRACE(c.name);
    const auto& r = resumed[c.name];
    EXPECT_EQ(r.exit_code, 0) << r.output;
    // The loaders continue at sample 24 of the epoch on the new data-parallel size.
    EXPECT_EQ(count_of(r.output, "resumed at step 2 from " + c.saved_on + " resharded 1 loaders 1"),
              c.to.processes)
        << r.output;
    EXPECT_EQ(count_of(r.output, "was saved on " + c.saved_on + "; resuming on " + c.resumed_on), 1)
        << r.output;
    auto worst = worst_checks(r.output);
    for (int s = 2; s < 5; ++s) {
      const std::string key = "resumed_loss_step" + std::to_string(s);
      ASSERT_TRUE(worst.count(key)) << r.output;
      EXPECT_LT(worst.at(key), 1e-5) << r.output;
    }
    ASSERT_TRUE(worst.count("resumed_params")) << r.output;
    EXPECT_LT(worst.at("resumed_params"), 1e-5) << r.output;
    std::cout << c.saved_on << " -> " << c.resumed_on << ": parameters within "
              << worst.at("resumed_params") << " of the dense run" << std::endl;
    EXPECT_EQ(count_of(r.output, "is not the dense model's"), 0) << r.output;
  }
  std::system(("rm -rf " + root).c_str());
}

const Layout kDp2Tp2{4, {"--tp_size", "2"}};
const Layout kDp4{4, {}};
const Layout kTp2{2, {"--tp_size", "2"}};
const Layout kZero3On3{3, {"--use_deepspeed", "--zero_stage", "3"}};
const Layout kPp2{2, {"--pp_size", "2"}};
const Layout kDp2{2, {}};
const Layout kZero2On4{4, {"--use_deepspeed", "--zero_stage", "2"}};
const Layout kPp2Tp2{4, {"--pp_size", "2", "--tp_size", "2"}};
const Layout kZero3Tp2{4, {"--tp_size", "2", "--use_deepspeed", "--zero_stage", "3"}};
const Layout kZero1On2{2, {"--use_deepspeed", "--zero_stage", "1"}};

}  // namespace

// Interleaved stages: rank 0 holds the embedding and block 1, rank 1 block 0 and the head; the
// checkpoint records the stages per rank beside the mesh, so that a pipeline of one stage per
// rank (same mesh, other entries per rank) reshards it as it would another mesh; and on data
// parallel. Sharded on a mesh (each tp rank's shards cut again over its data-parallel pair) into
// another ZeRO stage without tensor parallel, and a ZeRO checkpoint onto a pipeline of
// tensor-parallel stages.
TEST(Reshard, EveryLayoutChangeResumesEqualToTheDenseRun) {
  const Layout interleaved{2, {"--pp_size", "2", "--pp_schedule", "interleaved_1f1b",
                               "--pp_virtual_stages", "2"}};
  const Layout zero_bubble{2, {"--pp_size", "2", "--pp_schedule", "zero_bubble"}};
  const std::string interleaved_on = "pp 2 (2 processes, ddp, 2 pipeline stages per rank)";
  expect_resumes_equal_dense(
      {{"dp x tp -> dp", kDp2Tp2, kDp4, "dp 2 x tp 2 (4 processes, ddp)",
        "dp 4 (4 processes, ddp)"},
       {"tp -> zero-3 on 3", kTp2, kZero3On3, "tp 2 (2 processes, ddp)",
        "dp 3 (3 processes, zero-3)"},
       {"interleaved -> zero bubble", interleaved, zero_bubble, interleaved_on,
        "pp 2 (2 processes, ddp)"},
       {"interleaved -> dp", interleaved, kDp2, interleaved_on, "dp 2 (2 processes, ddp)"},
       {"pp -> dp", kPp2, kDp2, "pp 2 (2 processes, ddp)", "dp 2 (2 processes, ddp)"},
       {"zero-2 -> tp", kZero2On4, kTp2, "dp 4 (4 processes, zero-2)", "tp 2 (2 processes, ddp)"},
       {"pp x tp -> dp x tp", kPp2Tp2, kDp2Tp2, "pp 2 x tp 2 (4 processes, ddp)",
        "dp 2 x tp 2 (4 processes, ddp)"},
       {"zero-3 x tp -> zero-1", kZero3Tp2, kZero1On2, "dp 2 x tp 2 (4 processes, zero-3)",
        "dp 2 (2 processes, zero-1)"},
       {"zero-1 -> pp x tp", kZero1On2, kPp2Tp2, "dp 2 (2 processes, zero-1)",
        "pp 2 x tp 2 (4 processes, ddp)"}});
}
