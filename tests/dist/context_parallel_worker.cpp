// A rank of the context-parallel tests (started by `tandem launch --cpu`; the whole job is one
// cp group). Every rank draws the same whole-sequence queries, keys and values and computes
// dense attention and its gradients itself; then its part through ContextParallel::attention,
// and prints "check <name> <max difference>" against the matching part of the dense results.
// Modes:
//   attention  causal, causal with a sliding window, and not causal, with grouped-query heads
//              (4 query heads over 2 key/value heads), by the ring and by allgather: the output
//              and the gradients of q, k and v.
//   shard      shard/unshard/positions: the load-balanced chunks (rank r: r and 2n-1-r), their
//              positions, the whole tensor back, and unshard's gradient (n times the own part).
//   refuse     a sequence that is not a multiple of 2 n: the Refused message on stdout.
#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <limits>
#include <string>

#include "../common/compare_weights.h"
#include "tandem/comm/process_group.h"
#include "tandem/error.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/state.h"

namespace cp = tandem::parallel;

namespace {

void check(const std::string& name, const at::Tensor& got, const at::Tensor& expected) {
  if (got.sizes() != expected.sizes()) {
    std::cout << "check " << name << " shape " << got.sizes() << " != " << expected.sizes()
              << std::endl;
    throw std::runtime_error("shape mismatch in " + name);
  }
  std::cout << "check " << name << " " << (got - expected).abs().max().item<double>() << std::endl;
}

// Dense attention over the whole sequence, in float64 (the reference).
at::Tensor dense_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           bool causal, std::optional<int64_t> window) {
  const auto H = q.size(1), KV = k.size(1), T = q.size(2), D = q.size(3);
  auto expand = [&](const at::Tensor& t) {
    return t.unsqueeze(2).expand({t.size(0), KV, H / KV, T, D}).reshape({t.size(0), H, T, D});
  };
  auto kk = expand(k), vv = expand(v);
  auto scores = torch::matmul(q, kk.transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
  auto pos = torch::arange(T, torch::kLong);
  auto back = pos.unsqueeze(1) - pos.unsqueeze(0);
  auto masked = torch::zeros({T, T}, torch::kBool);
  if (causal) masked = masked.logical_or(back < 0);
  if (window) masked = masked.logical_or(back >= *window);
  scores = scores.masked_fill(masked, -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(scores, -1), vv);
}

void attention(const std::shared_ptr<tandem::ProcessGroup>& world) {
  const int64_t B = 2, H = 4, KV = 2, D = 8, T = 8 * world->size();
  struct Case {
    std::string name;
    bool causal;
    std::optional<int64_t> window;
  };
  // Ulysses: 2 ranks split the 2 KV heads as they are, 4 ranks expand them to the 4 query heads.
  for (const auto& comm : {cp::ContextParallelComm::kRing, cp::ContextParallelComm::kAllgather,
                           cp::ContextParallelComm::kUlysses}) {
    cp::ContextParallel group(world, comm);
    for (const Case& c : {Case{"causal", true, std::nullopt}, Case{"window", true, 5},
                          Case{"full", false, std::nullopt}}) {
      torch::manual_seed(11);
      auto q = torch::randn({B, H, T, D}, torch::kDouble);
      auto k = torch::randn({B, KV, T, D}, torch::kDouble);
      auto v = torch::randn({B, KV, T, D}, torch::kDouble);
      auto up = torch::randn({B, H, T, D}, torch::kDouble);
      auto qd = q.clone().requires_grad_(), kd = k.clone().requires_grad_(),
           vd = v.clone().requires_grad_();
      auto out = dense_attention(qd, kd, vd, c.causal, c.window);
      out.backward(up);
      // This rank's part, in float32 (what the models compute in).
      auto part = [&](const at::Tensor& t) { return group.shard(t, 2); };
      auto ql = part(q).to(torch::kFloat).requires_grad_(),
           kl = part(k).to(torch::kFloat).requires_grad_(),
           vl = part(v).to(torch::kFloat).requires_grad_();
      auto y = group.attention(ql, kl, vl, c.causal, c.window);
      y.backward(part(up).to(torch::kFloat));
      const std::string name = cp::to_string(comm) + " " + c.name + " ";
      check(name + "out", y.to(torch::kDouble), part(out.detach()));
      check(name + "dq", ql.grad().to(torch::kDouble), part(qd.grad()));
      check(name + "dk", kl.grad().to(torch::kDouble), part(kd.grad()));
      check(name + "dv", vl.grad().to(torch::kDouble), part(vd.grad()));
    }
  }
}

void shard(const std::shared_ptr<tandem::ProcessGroup>& world) {
  cp::ContextParallel group(world);
  const int n = world->size(), r = world->rank();
  const int64_t T = 4 * n;  // chunks of 2
  auto x = torch::arange(3 * T, torch::kDouble).view({3, T});
  auto mine = group.shard(x, 1);
  auto want = torch::cat({x.narrow(1, 2 * r, 2), x.narrow(1, 2 * (2 * n - 1 - r), 2)}, 1);
  check("shard", mine, want);
  check("positions", group.positions(T, torch::kCPU).to(torch::kDouble), want[0]);
  auto local = mine.clone().requires_grad_();
  auto whole = group.unshard(local, 1);
  check("unshard", whole.detach(), x);
  auto up = torch::arange(3 * T, torch::kDouble).view({3, T}) * 0.5;
  whole.backward(up);
  check("unshard gradient", local.grad(), group.shard(up, 1) * n);
}

void refuse(const std::shared_ptr<tandem::ProcessGroup>& world) {
  cp::ContextParallel group(world);
  try {
    group.shard(torch::zeros({1, 2 * world->size() + 1}), 1);
    std::cout << "refused: no" << std::endl;
  } catch (const tandem::Refused& e) {
    std::cout << "refused: " << e.what() << std::endl;
  }
  // Ulysses splits the heads: 3 of them over 2 ranks are refused, on every rank.
  cp::ContextParallel ulysses(world, cp::ContextParallelComm::kUlysses);
  auto q = torch::zeros({1, 3, 2, 4});
  try {
    ulysses.attention(q, q, q, true, std::nullopt);
    std::cout << "refused: no" << std::endl;
  } catch (const tandem::Refused& e) {
    std::cout << "refused: " << e.what() << std::endl;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  // One process: pairs of safetensors files (FILE REFERENCE ...), tensor by tensor, each pair's
  // lines after "pair <k>".
  if (mode == "compare" && argc >= 4 && argc % 2 == 0) {
    for (int k = 0; 2 + 2 * k < argc; ++k) {
      std::cout << "pair " << k << std::endl;
      tandem::testing::print_weight_checks(argv[2 + 2 * k], argv[3 + 2 * k]);
    }
    return 0;
  }
  auto state = tandem::ProcessState::from_environment();
  auto world = tandem::ProcessGroup::create(state);
  if (mode == "attention") attention(world);
  else if (mode == "shard") shard(world);
  else if (mode == "refuse") refuse(world);
  else {
    std::cerr << "context_parallel_worker: unknown mode '" << mode
              << "' (attention, shard, refuse)" << std::endl;
    return 2;
  }
  world->barrier();
  return 0;
}
