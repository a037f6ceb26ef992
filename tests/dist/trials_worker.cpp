// In-process trials under data parallel: every rank runs the same study loop; rank 0 samples,
// the values reach every rank, each rank reports its own loss and the prune decision is one.
//   trials_worker STUDY.yaml
#include <torch/torch.h>

#include <iostream>

#include "tandem/tandem.h"
#include "tandem/trials/study.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: trials_worker STUDY.yaml\n";
    return 2;
  }
  try {
    tandem::Accelerator acc(tandem::AcceleratorOptions().seed(5));
    tandem::trials::Study study(tandem::trials::load_study(argv[1], /*needs_program=*/false),
                                &acc.process_group());
    const int rank = acc.process_index();
    while (auto trial = study.ask()) {
      const double lr = trial->real("lr");
      torch::manual_seed(11);
      auto model = acc.prepare(torch::nn::Linear(8, 1));
      auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(model->parameters(),
                                                                 torch::optim::SGDOptions(lr)));
      auto w = torch::arange(8, torch::kFloat32).div(8).unsqueeze(1);
      double loss_value = 0;
      int64_t step = 1;
      std::string stopped = "no";
      for (; step <= 12; ++step) {
        auto x = torch::randn({16, 8});
        auto loss = torch::mse_loss(model->forward(x), x.mm(w));
        acc.backward(loss);
        opt.step();
        opt.zero_grad();
        loss_value = loss.item<double>();  // this rank's own batch: the ranks differ
        if (trial->report(step, loss_value)) {
          stopped = "at step " + std::to_string(step);
          break;
        }
      }
      study.tell(*trial, loss_value);
      acc.free_memory();  // the next trial prepares a new model
      std::cout << "rank " << rank << " trial " << trial->number() << " lr " << trial->params().at("lr")
                << " pruned " << stopped << "\n";
    }
    if (auto best = study.best())
      std::cout << "rank " << rank << " best trial " << best->number << "\n";
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
