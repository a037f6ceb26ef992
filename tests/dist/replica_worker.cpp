// One replica of a fault-tolerant job (Note [Replica recovery]): a two-layer network written as
// LibTorch users write one (typed members called directly), AdamW, a shuffled prepared loader of
// 4 samples per replica and step, until --steps optimizer steps are done.
//
//   replica_worker --steps N [--die_at S] [--sleep_ms M]
//
// Prints "step <k> replicas <n> loss <l>" after every step; with --die_at S it kills itself
// (SIGKILL) after step S, as a machine that is lost; --sleep_ms M sleeps M ms after each step
// (so that a replacement has time to join). At the end: "final step <k> digest <hex>", the
// digest an FNV-1a hash of every parameter's bytes and AdamW's state.
#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>

#include "tandem/accelerator.h"

namespace {

struct Points : torch::data::datasets::Dataset<Points> {
  torch::Tensor x, y;
  Points() {
    auto gen = at::detail::createCPUGenerator(5);
    x = torch::randn({200, 8}, gen);
    y = torch::randn({200, 1}, gen);
  }
  torch::data::Example<> get(size_t i) override {
    return {x[static_cast<int64_t>(i)], y[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return 200; }
};

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
};
TORCH_MODULE(Net);

uint64_t fnv(uint64_t h, const at::Tensor& t) {
  auto c = t.detach().contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  for (size_t k = 0; k < c.nbytes(); ++k) h = (h ^ p[k]) * 1099511628211ull;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 40, die_at = -1, sleep_ms = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int64_t v = std::stoll(argv[i + 1]);
    if (a == "--steps")
      steps = v;
    else if (a == "--die_at")
      die_at = v;
    else if (a == "--sleep_ms")
      sleep_ms = v;
  }
  try {
    torch::manual_seed(
        static_cast<uint64_t>(getpid()));  // replicas start apart: the quorum aligns them
    tandem::Accelerator acc;
    Net net;
    acc.prepare(net);
    auto opt = acc.prepare(
        std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.01)));
    auto loader = acc.prepare_data_loader(
        Points(), tandem::data::DataLoaderOptions().batch_size(4).shuffle(true).seed(3));
    while (acc.step() < steps) {
      for (auto& b : *loader) {
        auto loss = torch::mse_loss(net->forward(b.data), b.target);
        acc.backward(loss);
        opt.step();
        opt.zero_grad();
        std::printf("step %lld replicas %d loss %.6f\n", static_cast<long long>(acc.step()),
                    acc.replicas(), loss.item<double>());
        std::fflush(stdout);
        if (acc.step() == die_at) ::raise(SIGKILL);
        if (sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
        if (acc.step() >= steps) break;
      }
    }
    uint64_t h = 1469598103934665603ull;
    for (const auto& p : net->parameters()) h = fnv(h, p);
    // AdamW's state, each parameter's hashed and the hashes sorted (the map is keyed by address).
    auto& adam = static_cast<torch::optim::AdamW&>(opt.optimizer());
    std::vector<uint64_t> states;
    for (const auto& kv : adam.state()) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*kv.second);
      auto step = torch::full({1}, static_cast<double>(s.step()), torch::kDouble);
      states.push_back(fnv(fnv(fnv(1469598103934665603ull, s.exp_avg()), s.exp_avg_sq()), step));
    }
    std::sort(states.begin(), states.end());
    for (uint64_t v : states) h = fnv(h, torch::full({1}, static_cast<int64_t>(v), torch::kLong));
    std::printf("final step %lld digest %016llx\n", static_cast<long long>(acc.step()),
                static_cast<unsigned long long>(h));
    std::fflush(stdout);
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 0;
}
