// Gradient reduction cost: tandem's bucketed reduction of the MLP's gradients during a (trivial)
// backward, in several reducer configurations, beside raw c10d Gloo allreduces of the same bytes
// (one tensor, and one tensor per bucket). Every configuration is measured `rounds` times,
// alternating, and the median is printed.
// Run under `tandem launch --num_processes N`. Prints "RESULT allreduce ..." lines from rank 0.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>

#include "../examples/common/mlp.h"
#include "tandem/accelerator.h"
#include "tandem/parallel/ddp.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Variant {
  std::string name;
  std::function<void()> once;  // one reduction (raw) or one backward (reducer)
  std::function<void()> local;  // the same backward without communication; null for raw
  std::string detail;
  std::vector<double> ms;
};

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  torch::set_num_threads(1);
  tandem::Accelerator acc(tandem::AcceleratorOptions().cpu(true));
  tandem::ProcessGroup& pg = acc.process_group();
  std::shared_ptr<tandem::ProcessGroup> pg_ref(std::shared_ptr<void>(), &pg);  // not owning

  auto reference = examples::MLP(784, 512, 10);
  int64_t bytes = 0;
  for (auto& p : reference->parameters()) bytes += p.numel() * 4;
  const int n = acc.num_processes();
  const double factor = 2.0 * (n - 1) / n;  // bus bandwidth of a ring allreduce

  std::vector<Variant> variants;
  // Raw c10d: one flat tensor of the same bytes.
  auto flat = torch::ones({bytes / 4});
  variants.push_back({"raw_one_tensor", [&] { pg.allreduce(flat, tandem::ReduceOp::kSum); }, nullptr,
                      "", {}});
  // The same with the division by the world size that a mean needs (what every DDP pays).
  variants.push_back({"raw_one_tensor_mean", [&] { pg.allreduce(flat, tandem::ReduceOp::kMean); },
                      nullptr, "", {}});

  // tandem's reducer in several configurations, each on its own copy of the model.
  struct Setup {
    std::string name;
    tandem::parallel::ReducerOptions options;
  };
  std::vector<Setup> setups = {
      {"tandem_default", tandem::parallel::ReducerOptions()},
      {"tandem_bucket_view", tandem::parallel::ReducerOptions().gradient_as_bucket_view(true)},
      {"tandem_one_bucket", tandem::parallel::ReducerOptions().first_bucket_cap_mb(25)},
      {"tandem_one_bucket_view",
       tandem::parallel::ReducerOptions().first_bucket_cap_mb(25).gradient_as_bucket_view(true)},
  };
  std::vector<examples::MLP> models;
  std::vector<std::unique_ptr<tandem::parallel::GradientReducer>> reducers;
  for (auto& s : setups) {
    models.push_back(examples::MLP(784, 512, 10));
    reducers.push_back(std::make_unique<tandem::parallel::GradientReducer>(
        models.back()->named_parameters().pairs(), pg_ref, s.options));
  }
  // Raw c10d with one tensor per bucket (the default reducer's split): what two calls cost.
  std::vector<torch::Tensor> per_bucket;
  for (auto& b : reducers[0]->buckets()) {
    int64_t numel = 0;
    for (size_t i : b) numel += models[0]->parameters()[i].numel();
    per_bucket.push_back(torch::ones({numel}));
  }
  variants.push_back({"raw_per_bucket",
                      [&] {
                        std::vector<tandem::Work> works;
                        for (auto& t : per_bucket)
                          works.push_back(pg.allreduce_async({t}, tandem::ReduceOp::kSum));
                        for (auto& w : works) w.wait();
                      },
                      nullptr, "", {}});
  for (size_t k = 0; k < setups.size(); ++k) {
    auto* model = &models[k];
    auto* reducer = reducers[k].get();
    auto backward = [model, reducer] {
      torch::Tensor loss = torch::zeros({});
      for (auto& p : (*model)->parameters()) loss = loss + p.sum();
      loss.backward();
      reducer->after_backward();
    };
    variants.push_back({setups[k].name, backward,
                        [reducer, backward] {
                          reducer->set_sync(false);
                          backward();
                          reducer->set_sync(true);
                        },
                        "buckets=" + std::to_string(reducer->buckets().size()), {}});
  }

  auto time_it = [&](const std::function<void()>& f) {
    for (int i = 0; i < 3; ++i) f();
    acc.wait_for_everyone();
    auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) f();
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / reps;
  };
  std::vector<double> local_ms;
  for (int r = 0; r < rounds; ++r) {
    for (auto& v : variants) {
      double ms = time_it(v.once);
      if (v.local) {
        // The same backward without communication, measured right after, is subtracted.
        double local = time_it(v.local);
        local_ms.push_back(local);
        ms = std::max(1e-6, ms - local);
      }
      v.ms.push_back(ms);
    }
  }
  if (acc.is_main_process()) {
    std::cout << "RESULT allreduce_setup bytes=" << bytes << " processes=" << n << " reps=" << reps
              << " rounds=" << rounds << " backward_local_ms=" << median(local_ms) << std::endl;
    for (auto& v : variants) {
      const double med = median(v.ms);
      const double spread = 100.0 * (*std::max_element(v.ms.begin(), v.ms.end()) -
                                     *std::min_element(v.ms.begin(), v.ms.end())) /
                            med;
      std::cout << "RESULT allreduce name=" << v.name << " ms=" << med << " spread_pct=" << spread
                << " busbw_gbps=" << factor * bytes / (med * 1e-3) / 1e9 << " " << v.detail
                << std::endl;
    }
  }
  return 0;
}
