// Gradient reduction bandwidth: tandem's bucketed reduction of the MLP's gradients during a
// (trivial) backward, beside a raw c10d Gloo allreduce of the same bytes in one tensor.
// Run under `tandem launch --num_processes N`. Prints "RESULT allreduce ..." from rank 0.
#include <torch/torch.h>

#include <chrono>
#include <iostream>

#include "../examples/common/mlp.h"
#include "tandem/accelerator.h"

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  torch::set_num_threads(1);
  tandem::Accelerator acc(tandem::AcceleratorOptions().cpu(true));
  auto mlp = examples::MLP(784, 512, 10);
  acc.prepare(mlp);
  int64_t bytes = 0;
  for (auto& p : mlp->parameters()) bytes += p.numel() * 4;
  const int n = acc.num_processes();
  const double factor = 2.0 * (n - 1) / n;  // bus bandwidth of a ring allreduce
  using Clock = std::chrono::steady_clock;

  // Raw c10d: one flat tensor of the same bytes.
  auto flat = torch::ones({bytes / 4});
  for (int i = 0; i < 5; ++i) acc.process_group().allreduce(flat, tandem::ReduceOp::kSum);
  acc.wait_for_everyone();
  auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) acc.process_group().allreduce(flat, tandem::ReduceOp::kSum);
  double raw = std::chrono::duration<double>(Clock::now() - t0).count() / reps;

  // tandem: a backward whose only work is producing the gradients, reduced in buckets.
  std::vector<torch::Tensor> params = mlp->parameters();
  auto step = [&] {
    torch::Tensor loss = torch::zeros({});
    for (auto& p : params) loss = loss + p.sum();
    acc.backward(loss);
  };
  for (int i = 0; i < 5; ++i) step();
  acc.wait_for_everyone();
  t0 = Clock::now();
  for (int i = 0; i < reps; ++i) step();
  double bucketed = std::chrono::duration<double>(Clock::now() - t0).count() / reps;
  // The same backward without communication, to subtract the autograd work.
  double local;
  {
    auto guard = acc.no_sync();
    t0 = Clock::now();
    for (int i = 0; i < reps; ++i) step();
    local = std::chrono::duration<double>(Clock::now() - t0).count() / reps;
  }
  if (acc.is_main_process()) {
    const double reduce_s = std::max(1e-9, bucketed - local);
    std::cout << "RESULT allreduce bytes=" << bytes << " buckets=" << acc.reducers().at(0)->buckets().size()
              << " raw_ms=" << raw * 1e3 << " raw_busbw_gbps=" << factor * bytes / raw / 1e9
              << " tandem_ms=" << reduce_s * 1e3
              << " tandem_busbw_gbps=" << factor * bytes / reduce_s / 1e9
              << " backward_local_ms=" << local * 1e3 << std::endl;
  }
  return 0;
}
