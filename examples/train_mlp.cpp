// Data-parallel classification with an MLP on a data set the program makes itself.
//   tandem launch --num_processes 2 --cpu build/examples/train_mlp --epochs 3
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "common/mlp.h"
#include "tandem/tandem.h"

int main(int argc, char** argv) {
  CLI::App app{"train_mlp: an MLP on a learnable synthetic data set"};
  int64_t samples = 8192, batch = 64, epochs = 3, accum = 1;
  double lr = 0.05;
  std::string mixed_precision;  // empty: the launcher's (TANDEM_MIXED_PRECISION), else "no"
  app.add_option("--samples", samples, "Training samples");
  app.add_option("--batch-size", batch, "Batch size per process");
  app.add_option("--epochs", epochs, "Epochs");
  app.add_option("--lr", lr, "Learning rate (SGD with momentum 0.9)");
  auto* accum_opt = app.add_option("--accumulate", accum,
                                   "Gradient accumulation steps (default: the launcher's "
                                   "--gradient_accumulation_steps, else 1)")
                        ->check(CLI::PositiveNumber);
  app.add_option("--mixed_precision", mixed_precision, "no, bf16, fp16, bf16-true, fp16-true, fp8");
  CLI11_PARSE(app, argc, argv);
  try {
    auto options = tandem::AcceleratorOptions().seed(0);
    if (accum_opt->count()) options.gradient_accumulation_steps(static_cast<int>(accum));
    if (!mixed_precision.empty()) options.mixed_precision(mixed_precision);
    tandem::Accelerator acc(options);
    // One teacher, two draws of points: a training set and a held-out test set.
    examples::TeacherClassification train(samples, 784, 10, /*data_seed=*/1);
    examples::TeacherClassification test(2000, 784, 10, /*data_seed=*/2);
    auto model = acc.prepare(examples::MLP());
    auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(
        model->parameters(), torch::optim::SGDOptions(lr).momentum(0.9)));
    auto loader = acc.prepare_data_loader(
        train, tandem::data::DataLoaderOptions().batch_size(batch).shuffle(true).seed(42));
    acc.print("training on", acc.num_processes(), "processes,", loader->size(),
              "batches per epoch per process");
    tandem::track::ProgressBar bar(tandem::track::ProgressOptions()
                                       .total(epochs * loader->size())
                                       .description("train_mlp")
                                       .is_main_process(acc.is_main_process()));
    int64_t step = 0;
    for (int64_t epoch = 0; epoch < epochs; ++epoch) {
      loader->set_epoch(epoch);
      for (auto& b : *loader) {
        auto scope = acc.accumulate();  // autocast on for this micro-step, in bf16/fp16 modes
        // -true modes keep the weights in bf16/fp16: inputs go in the same dtype.
        auto x = b.data.to(acc.precision_policy().param_dtype);
        auto loss = torch::cross_entropy_loss(model->forward(x), b.target);
        acc.backward(loss);
        opt.step();
        opt.zero_grad();
        bar.update(++step, acc.reduce(loss.detach()).item<double>());
      }
      // Accuracy on the held-out set, each sample counted once across ranks.
      torch::NoGradGuard no_grad;
      auto autocast = acc.autocast();  // evaluation outside accumulate(): autocast by hand
      auto eval = acc.prepare_data_loader(test, tandem::data::DataLoaderOptions().batch_size(256));
      int64_t correct = 0, seen = 0;
      for (auto& b : *eval) {
        auto x = b.data.to(acc.precision_policy().param_dtype);
        auto hits = acc.gather_for_metrics(model->forward(x).argmax(1).eq(b.target));
        correct += hits.sum().item<int64_t>();
        seen += hits.size(0);
      }
      acc.print("epoch", epoch, "accuracy", static_cast<double>(correct) / seen, "on", seen,
                "samples");
    }
    bar.close();
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 0;
}
