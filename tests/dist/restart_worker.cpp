// A rank of the restart test: trains a tiny linear model by data-parallel SGD (gradients
// averaged with an allreduce every step), keeps its own state file, and with a crash step set,
// rank 1 exits with code 1 at that step on the first attempt (TANDEM_RESTART_COUNT=0, or torchrun's
// TORCHELASTIC_RESTART_COUNT). After `tandem launch --max_restarts` (or torchrun's) starts every
// rank again, they resume from their state files.
//
// Usage: restart_worker STATE_DIR STEPS [CRASH_STEP]
// Prints "final <step> <w0> <w1> <w2> <w3>" with the weights as hexadecimal floats (exact).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "tandem/comm/process_group.h"

namespace {

constexpr int kDim = 4;
constexpr int kBatch = 8;
constexpr double kLr = 0.05;

// The state file holds the last two (step, weights) pairs: when a rank dies, its peers may have
// saved one step more or less than it did, and both sides must find the step they agree on.
struct Saved {
  int step = 0;
  double w[kDim] = {0, 0, 0, 0};
};

std::string hex(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%a", v);
  return buf;
}

void save(const std::string& path, const Saved& prev, const Saved& cur) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    for (const Saved* s : {&prev, &cur}) {
      f << s->step;
      for (double v : s->w) f << " " << hex(v);
      f << "\n";
    }
  }
  std::rename(tmp.c_str(), path.c_str());  // atomic: a kill never leaves half a file
}

bool load(const std::string& path, Saved& prev, Saved& cur) {
  std::ifstream f(path);
  std::string line;
  Saved* slots[] = {&prev, &cur};
  for (Saved* s : slots) {
    if (!std::getline(f, line)) return false;
    std::istringstream is(line);
    std::string tok;
    is >> s->step;
    for (double& v : s->w) {
      is >> tok;
      v = std::strtod(tok.c_str(), nullptr);
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: restart_worker STATE_DIR STEPS [CRASH_STEP]\n";
    return 2;
  }
  const std::string dir = argv[1];
  const int steps = std::atoi(argv[2]);
  const int crash_step = argc > 3 ? std::atoi(argv[3]) : -1;
  const char* rc = std::getenv("TANDEM_RESTART_COUNT");
  if (rc == nullptr) rc = std::getenv("TORCHELASTIC_RESTART_COUNT");  // under torchrun
  const int restart = rc ? std::atoi(rc) : 0;
  at::set_num_threads(1);

  auto state = tandem::ProcessState::from_environment();
  auto pg = tandem::ProcessGroup::create(
      state, tandem::ProcessGroupOptions().timeout(std::chrono::seconds(20)));
  const int r = pg->rank();
  const std::string path = dir + "/rank" + std::to_string(r) + ".state";

  Saved prev, cur;
  bool resumed = load(path, prev, cur);
  // Agree on the step every rank has: the smallest saved one.
  auto mine = at::tensor({static_cast<int64_t>(resumed ? cur.step : 0)});
  pg->allreduce(mine, tandem::ReduceOp::kMin);
  const int start = static_cast<int>(mine.item<int64_t>());
  if (resumed && cur.step != start) cur = prev;  // this rank was one step ahead
  if (resumed && cur.step != start) {
    std::cerr << "rank " << r << " cannot resume at step " << start << "\n";
    return 4;
  }
  if (resumed) std::cout << "rank " << r << " resumes at step " << start << std::endl;

  auto w = at::empty({kDim}, at::kDouble);
  for (int i = 0; i < kDim; ++i) w[i] = cur.w[i];
  const auto truth = at::tensor({1.0, -2.0, 3.0, 0.5}, at::kDouble);
  for (int step = start; step < steps; ++step) {
    if (step == crash_step && restart == 0 && r == 1) {
      std::cout << "rank 1 crashes at step " << step << std::endl;
      return 1;
    }
    // This rank's batch: deterministic in (rank, step).
    auto x = at::arange(kBatch * kDim, at::kDouble)
                 .reshape({kBatch, kDim})
                 .mul(0.01 * (1 + r))
                 .add(0.003 * step)
                 .sin();
    auto y = x.matmul(truth);
    auto grad = x.t().matmul(x.matmul(w) - y).mul(2.0 / kBatch);
    pg->allreduce(grad, tandem::ReduceOp::kMean);
    w = w - grad.mul(kLr);
    prev = cur;
    cur.step = step + 1;
    for (int i = 0; i < kDim; ++i) cur.w[i] = w[i].item<double>();
    save(path, prev, cur);
  }
  std::cout << "final " << steps;
  for (int i = 0; i < kDim; ++i) std::cout << " " << hex(w[i].item<double>());
  std::cout << std::endl;
  pg->barrier();
  return 0;
}
