// A rank of the checkpoint tests. Modes:
//   run      train the MLP (AdamW, shuffled, gradient accumulation 2) to --steps optimizer steps;
//            --resume loads the latest checkpoint first; --stop-at K saves at step K and exits
//            (an interruption); --out writes the final parameters and optimizer state (rank 0).
//   crash    save a checkpoint, write its parameters to --out, then save again with the fault
//            injection point --point armed (the process is SIGKILLed inside the second save).
//   verify   load the latest checkpoint and write its parameters to --out.
//   loop     save checkpoints in a loop until killed (random-time kill test).
//   failing  save asynchronously with a registered object that throws, then wait for the save.
//   compare  --out A --project B: two dumps, every tensor and the metadata, but the counter:
//            prints "equal but counter X and Y" or what differs.
// --async makes every save asynchronous (Note [Asynchronous checkpoints]); --every K saves
// periodically every K optimizer steps (checkpoint_every_steps, checkpoint_async with --async).
// --mixed-precision MODE and --master-weights train in that precision mode; the dump then holds
// the fp32 masters too.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "../../examples/common/mlp.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/tandem.h"
#include "../common/jobs_main.h"

namespace {

struct Counter {  // a user object registered for checkpointing
  int64_t value = 0;
  std::string state_dict() const { return std::to_string(value); }
  void load_state_dict(const std::string& s) { value = std::stoll(s); }
};

void dump(tandem::Accelerator& acc, torch::nn::Module& m, torch::optim::Optimizer& opt,
          int64_t counter, const std::string& path) {
  std::vector<std::pair<std::string, at::Tensor>> t;
  for (auto& p : m.named_parameters()) {
    t.emplace_back("param." + p.key(), p.value().detach());
    auto master = acc.master_parameter(p.value());
    if (master.defined()) t.emplace_back("master." + p.key(), master.detach());
  }
  for (auto& s : tandem::checkpoint::optimizer_state(opt).tensors) t.emplace_back("optim." + s.first, s.second);
  t.emplace_back("counter", torch::tensor({counter}));
  tandem::checkpoint::save_safetensors(path, t, {{"optimizer_json", tandem::checkpoint::optimizer_state(opt).json}});
}

}  // namespace

int run_worker(int argc, char** argv) {
  CLI::App app{"resume_worker"};
  std::string mode = "run", out, project = ".", point, precision = "no";
  bool master_weights = false;
  int64_t steps = 10, stop_at = -1, limit = 0;
  bool resume = false, async = false;
  int64_t every = 0;
  app.add_option("mode", mode);
  app.add_flag("--async", async);
  app.add_option("--every", every);
  app.add_option("--out", out);
  app.add_option("--project", project);
  app.add_option("--steps", steps);
  app.add_option("--stop-at", stop_at);
  app.add_option("--point", point);
  app.add_option("--total-limit", limit);
  app.add_flag("--resume", resume);
  app.add_option("--mixed-precision", precision);
  app.add_flag("--master-weights", master_weights);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  if (mode == "compare") {
    tandem::checkpoint::SafetensorsFile a(out), b(project);
    bool same = a.names() == b.names() && a.metadata() == b.metadata();
    if (!same) std::cout << "the names or the metadata differ" << std::endl;
    for (const auto& name : a.names())
      if (name != "counter" && b.contains(name) && !torch::equal(a.tensor(name), b.tensor(name))) {
        std::cout << name << " differs" << std::endl;
        same = false;
      }
    if (!same) return 1;
    std::cout << "equal but counter " << a.tensor("counter").item<int64_t>() << " and "
              << b.tensor("counter").item<int64_t>() << std::endl;
    return 0;
  }
  try {
    auto options = tandem::AcceleratorOptions()
                       .gradient_accumulation_steps(2)
                       .project_dir(project)
                       .total_limit(static_cast<int>(limit))
                       .mixed_precision(precision)
                       .checkpoint_every_steps(every)
                       .checkpoint_async(async);
    if (master_weights) options.master_weights(true);
    tandem::Accelerator acc(options);
    torch::manual_seed(7);
    auto model = acc.prepare(examples::MLP(32, 64, 5));
    auto adamw = std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
    auto opt = acc.prepare(adamw);
    auto sched = acc.prepare_scheduler(std::make_shared<torch::optim::StepLR>(*adamw, 3, 0.5));
    Counter counter;
    acc.register_for_checkpointing("counter", counter);
    int broken_saves = 0;  // the first save of "broken" throws
    if (mode == "failing")
      acc.register_for_checkpointing(
          "broken",
          [&broken_saves]() -> std::string {
            if (broken_saves++ == 0) throw std::runtime_error("cannot serialize the broken object");
            return "ok";
          },
          [](const std::string&) {});
    const auto save = [&] { return acc.save_state(tandem::SaveOptions().async(async)); };
    auto loader = acc.prepare_data_loader(examples::TeacherClassification(150, 32, 5, 3, 4),
                                          tandem::data::DataLoaderOptions().batch_size(8).shuffle(true).seed(5));
    auto train_steps = [&](int64_t until) {
      int64_t done = acc.step();
      for (int64_t epoch = loader->epoch(); done < until; ++epoch) {
        loader->set_epoch(epoch);
        for (auto& b : *loader) {
          auto scope = acc.accumulate();
          acc.backward(torch::cross_entropy_loss(model->forward(b.data), b.target));
          opt.step();
          opt.zero_grad();
          if (!acc.sync_gradients()) continue;
          sched->step();
          ++counter.value;
          if (++done == stop_at) {
            save();
            std::cout << "saved at step " << done << " (epoch " << loader->epoch() << ", batch "
                      << loader->position() << ")" << std::endl;
            return false;
          }
          if (done >= until) break;
        }
      }
      return true;
    };
    if (mode == "run") {
      if (resume) {
        acc.load_state();
        std::cout << "resumed at step " << acc.step() << std::endl;
        // How far the fp32 masters the optimizer will step are from the loaded weights.
        double gap = -1;
        for (auto& p : model->parameters()) {
          auto master = acc.master_parameter(p);
          if (master.defined())
            gap = std::max(gap, (master - p.to(torch::kFloat)).abs().max().item<double>());
        }
        if (gap >= 0) std::cout << "master gap " << gap << std::endl;
      }
      if (!train_steps(steps)) return 0;
      if (acc.is_main_process() && !out.empty()) dump(acc, *model, *adamw, counter.value, out);
      std::cout << "finished " << acc.step() << " steps" << std::endl;
      return 0;
    }
    if (mode == "crash") {
      train_steps(3);
      acc.save_state();
      if (acc.is_main_process()) dump(acc, *model, *adamw, counter.value, out);
      train_steps(5);
      ::setenv("TANDEM_CHECKPOINT_CRASH", point.c_str(), 1);
      save();
      // An asynchronous save is written while training goes on (and the process waits for it
      // at its end).
      if (async) train_steps(8);
      acc.wait_for_checkpoint();
      std::cout << "second save completed" << std::endl;
      return 0;
    }
    if (mode == "verify") {
      acc.load_state();
      if (acc.is_main_process()) dump(acc, *model, *adamw, counter.value, out);
      std::cout << "loaded " << acc.latest_checkpoint() << " at step " << acc.step() << std::endl;
      return 0;
    }
    if (mode == "failing") {
      train_steps(2);
      const auto dir = save();
      train_steps(3);
      try {
        acc.wait_for_checkpoint();
        std::cout << "the failing save completed" << std::endl;
      } catch (const std::exception& e) {
        std::cout << "save failed: " << e.what() << std::endl;
        std::cout << "checkpoint exists: " << std::filesystem::exists(dir) << std::endl;
      }
      acc.save_state(tandem::SaveOptions().async(async).dir(project + "/after"));
      acc.wait_for_checkpoint();
      return 0;
    }
    if (mode == "loop") {
      for (int64_t k = 1;; ++k) {
        train_steps(k);
        save();
        std::cout << "saved " << k << std::endl;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "ERROR: " << e.what() << std::endl;
    return 1;
  }
  return 2;
}

int main(int argc, char** argv) { return tandem::testing::main_with_jobs(argc, argv, run_worker); }
