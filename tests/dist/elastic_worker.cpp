// One elastic training job: an MLP with AdamW over a prepared, shuffled loader (4 samples per
// rank and step), checkpointing every 3 optimizer steps into --project (total_limit 2), resuming
// by itself from the latest checkpoint (auto_resume), until --steps optimizer steps are done.
//
//   elastic_worker --project DIR --steps N [--exit_after S] [--kill_rank R --kill_after S]
//                  [--kill_in_save K] [--kill_machine]
//                  [--preempt_after S [--preempt_rank R] [--preempt_launcher] [--signal_in_save]
//                   [--preempt_signal USR1]]
//                  [--stop_rank R --stop_after S] [--mismatch_rank R --mismatch_after S]
//                  [--freeze_rank R --freeze_after S --freeze sigstop|sleep] [--timeout_s T]
//
// --exit_after S: stop (exit 0) after step S, as a job stopped by hand. On the first attempt only
// (TANDEM_RESTART_COUNT 0): --kill_rank R --kill_after S: rank R kills itself with SIGKILL after
// step S (with --kill_machine, its launcher first: the machine's other ranks die with it, as when
// a machine is lost); --kill_in_save K: the main process kills itself with SIGKILL in the middle of its K-th
// save (in a registered object's save, after the other files were written). Rank 0 prints
// "final_digest <sum of |parameters| in double>" and every rank "world <n> resumed <dir> step
// <k>" after the resume. --preempt_after S: after step S, rank R (default 0) sends itself
// SIGTERM (--preempt_signal USR1: SIGUSR1), or with --preempt_launcher its launcher (which forwards it to every rank), as a
// cluster preempting the job (Note [Preemption]); with --signal_in_save it sends its launcher a
// second SIGTERM in the middle of the next save and waits for the SIGKILL that follows.
// Note [Flight recorder]: --stop_rank R --stop_after S: after step S rank R sends itself SIGUSR2
// (its flight recorder is dumped), and leaves without a word to the others, as a rank that
// stopped; --mismatch_rank R --mismatch_after S: after step S every rank reduces a metric of 8
// elements, rank R one of 9 (where that returns, every rank dumps on SIGUSR2 and exits 3).
// Note [Heartbeat]: --freeze_rank R --freeze_after S (first attempt only): after step S rank R
// prints "rank R freezes (<how>) after step S at <seconds since the epoch>" and stops itself with
// SIGSTOP (--freeze sigstop) or sleeps for good, alive (--freeze sleep).
// --timeout_s: the collectives' timeout.
#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "tandem/accelerator.h"

namespace {

constexpr int64_t kSamples = 96, kPerRank = 4;

struct Points : torch::data::datasets::Dataset<Points> {
  torch::Tensor x, y;
  Points() {
    auto gen = at::detail::createCPUGenerator(11);
    x = torch::randn({kSamples, 8}, gen);
    y = torch::randn({kSamples, 1}, gen);
  }
  torch::data::Example<> get(size_t i) override {
    return {x[static_cast<int64_t>(i)], y[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return kSamples; }
};

int run(int argc, char** argv) {
  std::string project;
  int steps = 10, exit_after = -1, kill_rank = -1, kill_after = -1, kill_in_save = -1;
  int preempt_after = -1, preempt_rank = 0, preempt_signal = SIGTERM;
  int stop_rank = -1, stop_after = -1, mismatch_rank = -1, mismatch_after = -1;
  int freeze_rank = -1, freeze_after = -1;
  std::string freeze = "sigstop";
  double timeout_s = 1800;
  bool kill_machine = false, preempt_launcher = false, signal_in_save = false, preempted = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--kill_machine" || k == "--preempt_launcher" || k == "--signal_in_save") {
      (k == "--kill_machine" ? kill_machine
                             : k == "--preempt_launcher" ? preempt_launcher : signal_in_save) = true;
      --i;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
    const std::string v = argv[i + 1];
    if (k == "--project") project = v;
    else if (k == "--steps") steps = std::stoi(v);
    else if (k == "--exit_after") exit_after = std::stoi(v);
    else if (k == "--kill_rank") kill_rank = std::stoi(v);
    else if (k == "--kill_after") kill_after = std::stoi(v);
    else if (k == "--kill_in_save") kill_in_save = std::stoi(v);
    else if (k == "--preempt_after") preempt_after = std::stoi(v);
    else if (k == "--preempt_rank") preempt_rank = std::stoi(v);
    else if (k == "--stop_rank") stop_rank = std::stoi(v);
    else if (k == "--stop_after") stop_after = std::stoi(v);
    else if (k == "--mismatch_rank") mismatch_rank = std::stoi(v);
    else if (k == "--mismatch_after") mismatch_after = std::stoi(v);
    else if (k == "--timeout_s") timeout_s = std::stod(v);
    else if (k == "--freeze_rank") freeze_rank = std::stoi(v);
    else if (k == "--freeze_after") freeze_after = std::stoi(v);
    else if (k == "--freeze") freeze = v;
    else if (k == "--preempt_signal") preempt_signal = v == "USR1" ? SIGUSR1 : SIGTERM;
    else throw std::invalid_argument("unknown argument " + k);
  }
  const char* restart = std::getenv("TANDEM_RESTART_COUNT");
  const bool first_attempt = !restart || std::string(restart) == "0";
  tandem::Accelerator acc(tandem::AcceleratorOptions()
                              .project_dir(project)
                              .checkpoint_every_steps(3)
                              .total_limit(2)
                              .auto_resume(true)
                              .timeout(std::chrono::milliseconds(
                                  static_cast<int64_t>(timeout_s * 1000))));
  torch::manual_seed(5);
  auto model = acc.prepare(torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                                                 torch::nn::Linear(16, 1)));
  auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(
      model->parameters(), torch::optim::AdamWOptions(1e-2)));
  int saves = 0;
  acc.register_for_checkpointing(
      "saves",
      [&] {
        ++saves;
        if (first_attempt && saves == kill_in_save) {
          std::printf("killing rank %d in save %d\n", acc.process_index(), saves);
          std::fflush(stdout);
          ::kill(::getpid(), SIGKILL);
        }
        if (signal_in_save && preempted) {
          std::printf("second signal in save %d\n", saves);
          std::fflush(stdout);
          ::kill(::getppid(), SIGTERM);
          ::sleep(30);  // the launcher's SIGKILL ends the save here
        }
        return std::to_string(saves);
      },
      [&](const std::string& s) { saves = std::stoi(s); });
  auto loader = acc.prepare_data_loader(
      Points(), tandem::data::DataLoaderOptions().batch_size(kPerRank).shuffle(true).seed(2));
  bool reported = false;
  while (acc.step() < steps) {
    for (auto& b : *loader) {
      if (!reported) {
        reported = true;
        std::printf("world %d resumed %s step %lld\n", acc.num_processes(),
                    acc.resumed().dir.empty() ? "-" : acc.resumed().dir.c_str(),
                    static_cast<long long>(acc.step()));
      }
      auto loss = torch::mse_loss(model->forward(b.data), b.target);
      acc.backward(loss);
      opt.step();
      opt.zero_grad();
      const int s = static_cast<int>(acc.step());
      if (first_attempt && acc.process_index() == kill_rank && s == kill_after) {
        std::printf("killing rank %d%s after step %d\n", kill_rank,
                    kill_machine ? " and its machine's launcher" : "", s);
        std::fflush(stdout);
        if (kill_machine) {
          ::usleep(500 * 1000);  // the launcher relays the line above before it goes
          ::kill(::getppid(), SIGKILL);
        }
        ::kill(::getpid(), SIGKILL);
      }
      if (s == preempt_after && acc.process_index() == preempt_rank) {
        std::printf("signalling %s after step %d\n",
                    preempt_launcher ? "the launcher" : ("rank " + std::to_string(preempt_rank)).c_str(),
                    s);
        std::fflush(stdout);
        preempted = true;
        ::kill(preempt_launcher ? ::getppid() : ::getpid(), preempt_signal);
      }
      if (first_attempt && s == freeze_after && acc.process_index() == freeze_rank) {
        const double now = std::chrono::duration<double>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
        std::printf("rank %d freezes (%s) after step %d at %.3f\n", freeze_rank, freeze.c_str(), s,
                    now);
        std::fflush(stdout);
        if (freeze == "sigstop") ::raise(SIGSTOP);
        for (;;) ::sleep(1);
      }
      if (s == stop_after && acc.process_index() == stop_rank) {
        std::printf("rank %d stops after step %d\n", stop_rank, s);
        std::fflush(stdout);
        ::raise(SIGUSR2);
        ::sleep(1);  // the recorder's thread writes the dump
        std::_Exit(0);
      }
      if (s == mismatch_after) {
        const int64_t n = acc.process_index() == mismatch_rank ? 9 : 8;
        acc.reduce(torch::ones({n}), tandem::ReduceOp::kSum);
        // Where the transport let it pass (it failed nowhere): the recorder is dumped anyway.
        std::printf("the mismatched reduce returned on rank %d\n", acc.process_index());
        std::fflush(stdout);
        ::raise(SIGUSR2);
        ::sleep(1);
        std::_Exit(3);
      }
      if (s == exit_after) {
        std::printf("stopped after step %d\n", s);
        return 0;
      }
      if (s >= steps) break;
    }
    if (acc.step() < steps) loader->set_epoch(loader->epoch() + 1);
  }
  double digest = 0;
  // The dense weights on every layout (under ZeRO-3 gathered; every rank takes part).
  for (const auto& [name, t] : acc.get_state_dict(*model))
    digest += t.to(torch::kDouble).abs().sum().item<double>();
  if (acc.is_main_process()) std::printf("final_digest %.17g\n", digest);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "elastic_worker: " << e.what() << std::endl;
    return 1;
  }
}
