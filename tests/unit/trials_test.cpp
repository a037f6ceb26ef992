// Trials without processes: study files, samplers (TPE against random on a known optimum),
// pruners, the results file, the in-process study on one process, the picture.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include "../common/temp_dir.h"
#include "tandem/trials/plot.h"
#include "tandem/trials/pruner.h"
#include "tandem/trials/study.h"
#include "tandem/trials/sweep.h"

namespace tt = tandem::trials;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

const char* kStudy = R"(
program: /bin/true
args: [--steps, 30, --project_dir, "{trial_dir}", --log_with, jsonl]
launch: {num_processes: 2, cpu: true}
space:
  lr: {type: loguniform, low: 1e-4, high: 1e-1}
  width: {type: categorical, choices: [32, 64], flag: --width}
  layers: {type: int, low: 1, high: 3}
  DROP: {type: uniform, low: 0, high: 0.2, env: DROP}
objective: {metric: eval_loss, mode: min}
trials: 7
sampler: {type: tpe, startup_trials: 3}
pruner: {type: asha, min_resource: 5, reduction_factor: 3}
seed: 4
study_dir: out
)";

tt::TrialRecord trial(int n, tt::Params p, double v, tt::TrialState s = tt::TrialState::kComplete) {
  tt::TrialRecord t;
  t.number = n;
  t.params = std::move(p);
  t.value = v;
  t.state = s;
  return t;
}

}  // namespace

TEST(StudyFile, EveryKeyIsRead) {
  auto c = tt::parse_study(kStudy, "/studies/a.yaml");
  EXPECT_EQ(c.program, "/bin/true");
  EXPECT_EQ(c.args.size(), 6u);
  ASSERT_EQ(c.launch.size(), 2u);
  EXPECT_EQ(c.launch[0], (std::pair<std::string, std::string>{"num_processes", "2"}));
  ASSERT_EQ(c.space.size(), 4u);
  EXPECT_EQ(c.metric, "eval_loss");
  EXPECT_EQ(c.trials, 7);
  EXPECT_EQ(c.sampler.type, "tpe");
  EXPECT_EQ(c.sampler.startup_trials, 3);
  EXPECT_EQ(c.pruner.type, "asha");
  EXPECT_EQ(c.pruner.min_resource, 5);
  EXPECT_EQ(c.pruner.reduction_factor, 3);
  EXPECT_EQ(c.seed, 4u);
  EXPECT_EQ(c.study_dir, "/studies/out");  // relative to the study file
  tt::TrialRecord t;
  t.params = {{"lr", "0.01"}, {"width", "64"}, {"layers", "2"}, {"DROP", "0.1"}};
  std::vector<std::pair<std::string, std::string>> env;
  auto argv = tt::trial_command(c, "/x/tandem", t, "/studies/out/trial_0", &env);
  const std::vector<std::string> want{"/x/tandem", "launch", "--num_processes", "2", "--cpu",
                                      "/bin/true", "--steps", "30", "--project_dir",
                                      "/studies/out/trial_0", "--log_with", "jsonl", "--lr",
                                      "0.01", "--width", "64", "--layers", "2"};
  EXPECT_EQ(argv, want);
  ASSERT_EQ(env.size(), 1u);
  EXPECT_EQ(env[0], (std::pair<std::string, std::string>{"DROP", "0.1"}));
}

TEST(StudyFile, MistakesAreRefusedByName) {
  std::string base = kStudy;
  auto text = [&](const std::string& from, const std::string& to) {
    std::string s = base;
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  auto with = [&](const std::string& from, const std::string& to) {
    return error_of([&] { tt::parse_study(text(from, to)); });
  };
  EXPECT_NE(error_of([&] { tt::parse_study(base + "trails: 3\n"); }).find("unknown key `trails`"), std::string::npos);
  EXPECT_NE(with("flag: --width", "flg: --width").find("space.width.flg"), std::string::npos);
  EXPECT_NE(with("metric: eval_loss, ", "").find("objective.metric"), std::string::npos);
  EXPECT_NE(with("loguniform, low: 1e-4", "loguniform, low: 0").find("low > 0"), std::string::npos);
  EXPECT_NE(with("type: int", "type: integr").find("expected uniform, loguniform, int or categorical"), std::string::npos);
  EXPECT_NE(with("\"{trial_dir}\"", "here").find("{trial_dir}"), std::string::npos);
  EXPECT_NE(with("mode: min", "mode: down").find("expected min or max"), std::string::npos);
  EXPECT_NE(with("type: tpe", "type: bayes").find("expected grid, random or tpe"), std::string::npos);
  EXPECT_NE(with("type: asha", "type: hyperband").find("expected none, median or asha"), std::string::npos);
  EXPECT_NE(with("type: tpe, startup_trials: 3", "type: grid").find("give it `choices`"), std::string::npos);
  EXPECT_NE(with("program: /bin/true", "").find("`program` is missing"), std::string::npos);
  EXPECT_EQ(error_of([&] { tt::parse_study(text("program: /bin/true", ""), "", false); }), "")
      << "in-process studies need no program";
}

TEST(Samplers, GridVisitsEveryPointOnceThenStops) {
  std::vector<tt::ParamSpec> space(2);
  space[0].name = "a", space[0].type = tt::ParamType::kInt, space[0].low = 1, space[0].high = 3;
  space[1].name = "b", space[1].type = tt::ParamType::kUniform, space[1].low = 0, space[1].high = 1,
  space[1].choices = {"0.25", "0.75"};
  EXPECT_EQ(tt::grid_size(space), 6);
  std::vector<tt::TrialRecord> history;
  std::set<tt::Params> seen;
  for (int n = 0; n < 6; ++n) {
    auto p = tt::sample({"grid"}, space, history, tt::Direction::kMinimize, 3, n);
    ASSERT_TRUE(p);
    EXPECT_TRUE(seen.insert(*p).second);
    history.push_back(trial(n, *p, 0, tt::TrialState::kRunning));
  }
  EXPECT_FALSE(tt::sample({"grid"}, space, history, tt::Direction::kMinimize, 3, 6));
  // Another seed, another order over the same points.
  auto first3 = *tt::sample({"grid"}, space, {}, tt::Direction::kMinimize, 3, 0);
  bool differs = false;
  for (uint64_t s = 4; s < 10; ++s)
    differs |= *tt::sample({"grid"}, space, {}, tt::Direction::kMinimize, s, 0) != first3;
  EXPECT_TRUE(differs);
}

TEST(Samplers, RandomStaysInRangeReachesBothEndsAndRepeatsBySeed) {
  auto c = tt::parse_study(kStudy);
  std::set<std::string> layers, widths;
  for (int n = 0; n < 200; ++n) {
    auto p = *tt::sample({"random"}, c.space, {}, c.direction, 1, n);
    double lr = std::stod(p["lr"]);
    EXPECT_GE(lr, 1e-4);
    EXPECT_LE(lr, 1e-1);
    double d = std::stod(p["DROP"]);
    EXPECT_GE(d, 0);
    EXPECT_LE(d, 0.2);
    layers.insert(p["layers"]);
    widths.insert(p["width"]);
    EXPECT_EQ(p, *tt::sample({"random"}, c.space, {}, c.direction, 1, n));
  }
  EXPECT_EQ(layers, (std::set<std::string>{"1", "2", "3"}));
  EXPECT_EQ(widths, (std::set<std::string>{"32", "64"}));
  // Log-uniform: about a third of the draws in each decade.
  int low_decade = 0;
  for (int n = 0; n < 300; ++n)
    low_decade += std::stod((*tt::sample({"random"}, c.space, {}, c.direction, 9, n))["lr"]) < 1e-3;
  EXPECT_GT(low_decade, 60);
  EXPECT_LT(low_decade, 140);
}

// A synthetic objective with its optimum known: x = 1.3, lr = 1e-2, k = 7, c = "b" give 0.
double synthetic(const tt::Params& p) {
  const double x = std::stod(p.at("x")), lr = std::stod(p.at("lr"));
  const double k = std::stod(p.at("k"));
  return (x - 1.3) * (x - 1.3) + std::pow(std::log10(lr) + 2, 2) + 0.05 * (k - 7) * (k - 7) +
         (p.at("c") == "b" ? 0.0 : 1.0);
}

TEST(Samplers, TpeBeatsRandomOnAKnownOptimum) {
  std::vector<tt::ParamSpec> space(4);
  space[0] = {"x", tt::ParamType::kUniform, -5, 5, {}, "", ""};
  space[1] = {"lr", tt::ParamType::kLogUniform, 1e-5, 1, {}, "", ""};
  space[2] = {"k", tt::ParamType::kInt, 1, 20, {}, "", ""};
  space[3] = {"c", tt::ParamType::kCategorical, 0, 0, {"a", "b", "c", "d"}, "", ""};
  constexpr int kSeeds = 20, kTrials = 60;
  std::vector<double> best_tpe, best_random;
  int tpe_wins = 0;
  for (int seed = 0; seed < kSeeds; ++seed) {
    double best[2] = {INFINITY, INFINITY};
    for (int which = 0; which < 2; ++which) {
      std::vector<tt::TrialRecord> history;
      tt::SamplerOptions o;
      o.type = which == 0 ? "tpe" : "random";
      for (int n = 0; n < kTrials; ++n) {
        auto p = *tt::sample(o, space, history, tt::Direction::kMinimize, static_cast<uint64_t>(seed), n);
        double v = synthetic(p);
        best[which] = std::min(best[which], v);
        history.push_back(trial(n, p, v));
      }
    }
    best_tpe.push_back(best[0]);
    best_random.push_back(best[1]);
    tpe_wins += best[0] < best[1];
  }
  std::sort(best_tpe.begin(), best_tpe.end());
  std::sort(best_random.begin(), best_random.end());
  const double med_tpe = best_tpe[kSeeds / 2], med_random = best_random[kSeeds / 2];
  std::cout << "best of " << kTrials << " trials over " << kSeeds << " seeds: TPE median " << med_tpe
            << ", random median " << med_random << ", TPE better in " << tpe_wins << "\n";
  // The margin: TPE's median best at most half of random's, and TPE better in 14 of 20 seeds.
  EXPECT_LT(med_tpe, 0.5 * med_random);
  EXPECT_GE(tpe_wins, 14);
}

TEST(Samplers, TpeMaximizesToo) {
  std::vector<tt::ParamSpec> space{{"x", tt::ParamType::kUniform, 0, 10, {}, "", ""}};
  std::vector<tt::TrialRecord> history;
  tt::SamplerOptions o;
  o.startup_trials = 5;
  double best = -INFINITY;
  for (int n = 0; n < 30; ++n) {
    auto p = *tt::sample(o, space, history, tt::Direction::kMaximize, 2, n);
    double v = -std::pow(std::stod(p["x"]) - 8, 2);
    best = std::max(best, v);
    history.push_back(trial(n, p, v));
  }
  EXPECT_GT(best, -0.25) << "within 0.5 of the maximum at x = 8";
}

TEST(Pruners, MedianStopsTheTrialBehindTheMedianAfterWarmupAndStartup) {
  tt::PrunerOptions o;
  o.type = "median";
  o.startup_trials = 3;
  o.warmup_steps = 2;
  std::vector<tt::TrialRecord> done;
  for (int n = 0; n < 3; ++n) {
    auto t = trial(n, {}, 1.0 + n);
    for (int s = 1; s <= 5; ++s) t.intermediate.emplace_back(s, 10.0 - s + n);  // step 3: 7, 8, 9
    done.push_back(t);
  }
  tt::TrialRecord cur;
  cur.number = 3;
  cur.intermediate = {{1, 20}};
  EXPECT_FALSE(tt::should_prune(o, tt::Direction::kMinimize, cur, done)) << "warm-up: step 1 < 2";
  cur.intermediate.emplace_back(3, 8.5);
  EXPECT_TRUE(tt::should_prune(o, tt::Direction::kMinimize, cur, done)) << "best 8.5 > median 8";
  cur.intermediate.back().second = 7.5;
  EXPECT_FALSE(tt::should_prune(o, tt::Direction::kMinimize, cur, done));
  tt::TrialRecord up;
  up.number = 4;
  up.intermediate = {{3, 7.5}};
  EXPECT_TRUE(tt::should_prune(o, tt::Direction::kMaximize, up, done)) << "maximizing: 7.5 < 8";
  up.intermediate = {{3, 8.5}};
  EXPECT_FALSE(tt::should_prune(o, tt::Direction::kMaximize, up, done));
  std::vector<tt::TrialRecord> two(done.begin(), done.begin() + 2);
  cur.intermediate.back().second = 100;
  EXPECT_FALSE(tt::should_prune(o, tt::Direction::kMinimize, cur, two)) << "startup: 2 of 3";
  cur.intermediate.back().first = 50;  // no other trial reported at step 50
  EXPECT_FALSE(tt::should_prune(o, tt::Direction::kMinimize, cur, done));
}

TEST(Pruners, AshaKeepsTheBestFractionAtEachRung) {
  tt::PrunerOptions o;
  o.type = "asha";
  o.min_resource = 2;
  o.reduction_factor = 2;  // rungs at steps 2, 4, 8, ...
  std::vector<tt::TrialRecord> others;
  for (int n = 0; n < 3; ++n) {
    auto t = trial(n, {}, 0);
    t.intermediate = {{1, 9}, {2, 5.0 + n}, {3, 4}, {4, 3.0 + n}};  // rung 2: 5, 6, 7
    others.push_back(t);
  }
  tt::TrialRecord cur;
  cur.number = 3;
  cur.intermediate = {{1, 100}};
  EXPECT_FALSE(tt::should_prune(o, tt::Direction::kMinimize, cur, others)) << "no rung yet";
  cur.intermediate.emplace_back(2, 5.5);  // 4 values at rung 2, best 2 go on: 5, 5.5
  EXPECT_FALSE(tt::should_prune(o, tt::Direction::kMinimize, cur, others));
  cur.intermediate.back().second = 6.5;
  EXPECT_TRUE(tt::should_prune(o, tt::Direction::kMinimize, cur, others));
  cur.intermediate.back().second = 5.5;
  cur.intermediate.emplace_back(3, 0.0);
  EXPECT_FALSE(tt::should_prune(o, tt::Direction::kMinimize, cur, others)) << "between rungs";
  // A report that jumps past rung 4 is judged there.
  cur.intermediate.emplace_back(6, 4.5);  // rung 4: 3, 4, 5 and 4.5: best 2 are 3, 4
  EXPECT_TRUE(tt::should_prune(o, tt::Direction::kMinimize, cur, others));
  tt::TrialRecord first;
  first.intermediate = {{2, 1e9}};
  EXPECT_FALSE(tt::should_prune(o, tt::Direction::kMinimize, first, {})) << "alone at a rung";
}

TEST(Results, AppendOnlyResumableAndBoundToItsStudy) {
  tandem::testing::TempDir dir;
  auto c = tt::parse_study(kStudy);
  c.study_dir = dir.str() + "/s";
  {
    tt::ResultsLog log(c);
    auto a = trial(0, {{"lr", "0.01"}, {"width", "32"}, {"layers", "1"}, {"DROP", "0"}}, 2.5);
    a.intermediate = {{5, 3.0}, {10, 2.5}};
    log.record_start(a);
    log.record_end(a);
    auto b = trial(1, {{"lr", "0.02"}, {"width", "64"}, {"layers", "2"}, {"DROP", "0.1"}}, 0);
    log.record_start(b);  // and then the sweep was killed
  }
  { std::ofstream(c.study_dir + "/trials.jsonl", std::ios::app) << "{\"event\": \"end\", \"tri"; }
  tt::ResultsLog log(c);
  ASSERT_EQ(log.finished().size(), 1u);
  EXPECT_EQ(log.finished()[0].intermediate.size(), 2u);
  EXPECT_EQ(*log.finished()[0].value, 2.5);
  ASSERT_EQ(log.unfinished().size(), 1u);
  EXPECT_EQ(log.unfinished()[0].params.at("width"), "64");
  EXPECT_EQ(log.next_number(), 2);
  auto other = c;
  other.space[0].high = 0.5;
  EXPECT_NE(error_of([&] { tt::ResultsLog l(other); }).find("another `space`"), std::string::npos);
  auto more = c;
  more.trials = 50;  // more trials is the same study
  EXPECT_EQ(error_of([&] { tt::ResultsLog l(more); }), "");
}

TEST(InProcessStudy, AsksTellsPrunesAndResumes) {
  tandem::testing::TempDir dir;
  auto c = tt::parse_study(R"(
space:
  x: {type: uniform, low: -3, high: 3}
objective: {metric: f, mode: min}
trials: 6
sampler: random
pruner: {type: median, startup_trials: 2}
)", "", false);
  c.study_dir = dir.str() + "/s";
  int asked = 0;
  {
    tt::Study study(c);
    while (auto t = study.ask()) {
      const double x = t->real("x");
      EXPECT_THROW(t->integer("x"), std::invalid_argument);
      EXPECT_THROW(t->real("y"), std::invalid_argument);
      double v = 0;
      for (int s = 1; s <= 4; ++s) {
        v = x * x + 4.0 / s;
        if (t->report(s, v)) break;
      }
      study.tell(*t, v);
      if (++asked == 4) break;  // stop halfway, as a killed run would
    }
  }
  tt::Study again(c);
  EXPECT_EQ(again.trials().size(), 4u);
  std::set<int> numbers;
  while (auto t = again.ask()) {
    numbers.insert(t->number());
    again.tell(*t, t->real("x") * t->real("x"));
  }
  EXPECT_EQ(numbers, (std::set<int>{4, 5}));
  EXPECT_EQ(again.trials().size(), 6u);
  auto best = again.best();
  ASSERT_TRUE(best);
  for (const auto& t : again.trials())
    if (t.state == tt::TrialState::kComplete) {
      EXPECT_LE(*best->value, *t.value);
    }
}

TEST(Plot, ValidPngWithTheDots) {
  // The encoder: signature, chunk CRCs, and stored blocks that hold every row.
  std::vector<uint8_t> px(3 * 70000, 7);  // more than one stored block
  const std::string png = tt::encode_png(1000, 70, px);
  ASSERT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  auto be32 = [&](size_t at) {
    return (uint32_t(uint8_t(png[at])) << 24) | (uint32_t(uint8_t(png[at + 1])) << 16) |
           (uint32_t(uint8_t(png[at + 2])) << 8) | uint32_t(uint8_t(png[at + 3]));
  };
  EXPECT_EQ(png.substr(12, 4), "IHDR");
  EXPECT_EQ(be32(16), 1000u);
  EXPECT_EQ(be32(20), 70u);
  size_t at = 8;
  std::vector<std::string> types;
  std::string idat;
  while (at < png.size()) {
    const uint32_t n = be32(at);
    types.push_back(png.substr(at + 4, 4));
    if (types.back() == "IDAT") idat = png.substr(at + 8, n);
    at += 12 + n;
  }
  EXPECT_EQ(at, png.size());
  EXPECT_EQ(types, (std::vector<std::string>{"IHDR", "IDAT", "IEND"}));
  size_t raw = 0, z = 2;
  while (z < idat.size() - 4) {
    const bool last = idat[z] & 1;
    const size_t n = uint8_t(idat[z + 1]) | (size_t(uint8_t(idat[z + 2])) << 8);
    raw += n;
    z += 5 + n;
    if (last) break;
  }
  EXPECT_EQ(raw, 70u * (1 + 3000));

  tandem::testing::TempDir dir;
  std::vector<tt::ParamSpec> space{{"lr", tt::ParamType::kLogUniform, 1e-4, 1, {}, "", ""},
                                   {"w", tt::ParamType::kCategorical, 0, 0, {"32", "64"}, "", ""}};
  std::vector<tt::TrialRecord> ts{trial(0, {{"lr", "0.001"}, {"w", "32"}}, 2.0),
                                  trial(1, {{"lr", "0.1"}, {"w", "64"}}, 3.0, tt::TrialState::kPruned)};
  tt::write_study_plot(dir.str() + "/p.png", ts, space, tt::Direction::kMinimize, "loss");
  std::ifstream in(dir.str() + "/p.png", std::ios::binary);
  std::string file((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(file.substr(0, 8), png.substr(0, 8));
  // Blue (complete) and orange (pruned) pixels are in it: stored blocks keep the raw bytes.
  EXPECT_NE(file.find(std::string("\x1f\x77\xb4", 3)), std::string::npos);
  EXPECT_NE(file.find(std::string("\xff\x7f\x0e", 3)), std::string::npos);
}

TEST(Table, MarksTheBest) {
  std::vector<tt::ParamSpec> space{{"lr", tt::ParamType::kLogUniform, 1e-4, 1, {}, "", ""}};
  auto text = tt::format_trials_table({trial(0, {{"lr", "0.1"}}, 2.0), trial(1, {{"lr", "0.01"}}, 1.0)},
                                      space, tt::Direction::kMinimize, "loss");
  EXPECT_NE(text.find("1 *"), std::string::npos) << text;
  EXPECT_EQ(text.find("0 *"), std::string::npos) << text;
}
