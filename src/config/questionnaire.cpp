// The interactive questionnaire of `tandem config`. Every answer goes through the same
// validation as a config file value (config::set_value), so an answer that is accepted here is
// also accepted when the file is read back.
#include "tandem/config/questionnaire.h"
#include "tandem/error.h"
#include "../detail/env.h"

#include <cctype>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem::config {
namespace {

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

using ::tandem::detail::lower;

class Asker {
 public:
  Asker(std::istream& in, std::ostream& out) : in_(in), out_(out) {}

  // Asks until `check` accepts the answer (it throws with the reason otherwise).
  std::string ask(const std::string& question, const std::string& fallback,
                  const std::function<void(const std::string&)>& check) {
    for (;;) {
      out_ << question << (fallback.empty() ? "" : " [" + fallback + "]") << ": " << std::flush;
      std::string line;
      if (!std::getline(in_, line))
        throw std::runtime_error(
            "the input ended before every question was answered; nothing was written");
      line = trim(line);
      if (line.empty()) line = fallback;
      if (line.empty()) {
        out_ << "  An answer is required; please answer again.\n";
        continue;
      }
      try {
        check(line);
        return line;
      } catch (const std::exception& e) {
        out_ << "  " << e.what() << "; please answer again.\n";
      }
    }
  }

  // A numbered choice; the answer is the number or the option's name. Returns the index.
  size_t choose(const std::string& question, const std::vector<std::string>& names,
                const std::vector<std::string>& labels, size_t fallback,
                const std::function<void(size_t)>& refuse = nullptr) {
    out_ << question << "\n";
    for (size_t i = 0; i < labels.size(); ++i) out_ << "  [" << i << "] " << labels[i] << "\n";
    size_t picked = fallback;
    ask("Your choice", std::to_string(fallback), [&](const std::string& a) {
      for (size_t i = 0; i < names.size(); ++i)
        if (a == std::to_string(i) || lower(a) == lower(names[i])) {
          if (refuse) refuse(i);
          picked = i;
          return;
        }
      throw ::tandem::Refused("'" + a + "' is not one of the choices: answer 0 to " +
                                  std::to_string(names.size() - 1) + " or a name");
    });
    return picked;
  }

  bool yes_no(const std::string& question, bool fallback) {
    bool value = fallback;
    ask(question + " (yes/no)", fallback ? "yes" : "no", [&](const std::string& a) {
      std::string l = lower(a);
      if (l == "yes" || l == "y" || l == "true")
        value = true;
      else if (l == "no" || l == "n" || l == "false")
        value = false;
      else
        throw ::tandem::Refused("'" + a + "' is not yes or no");
    });
    return value;
  }

 private:
  std::istream& in_;
  std::ostream& out_;
};

}  // namespace

LaunchConfig ask_config(std::istream& in, std::ostream& out, const QuestionnaireOptions& options) {
  Asker q(in, out);
  LaunchConfig c;
  // Validates an answer as the value of `key` and keeps it.
  auto setter = [&](const std::string& key) {
    return [&c, key](const std::string& a) { set_value(c, key, a, Source::kConfigFile, key); };
  };
  const int gpus = options.cuda_devices();

  q.choose("In which compute environment are you running?", {"LOCAL_MACHINE", "AMAZON_SAGEMAKER"},
           {"This machine (or machines you start tandem launch on)", "AWS (Amazon SageMaker)"}, 0,
           [](size_t i) {
             if (i == 1)
               throw ::tandem::Refused(
                   "tandem starts jobs on the machines you run it on; "
                   "Amazon SageMaker is not supported");
           });
  set_value(c, "compute_environment", "LOCAL_MACHINE", Source::kConfigFile, "compute_environment");

  const std::vector<std::string> types = {"NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED"};
  size_t t = q.choose(
      "Which type of distributed training do you use?", types,
      {"No distributed training (one process)", "multi-CPU (MULTI_CPU)", "multi-GPU (MULTI_GPU)",
       "FSDP: fully sharded data parallel (FSDP)", "ZeRO sharding, DeepSpeed-style (DEEPSPEED)"},
      0);
  set_value(c, "distributed_type", types[t], Source::kConfigFile, "distributed_type");
  const std::string type = types[t];

  if (type != "NO") {
    q.ask("How many machines will you use (more than 1 for multi-machine training)?", "1",
          setter("num_machines"));
    if (c.num_machines > 1) {
      q.ask("What is the rank of this machine (0 to " + std::to_string(c.num_machines - 1) + ")?",
            "0", [&](const std::string& a) {
              set_value(c, "machine_rank", a, Source::kConfigFile, "machine_rank");
              if (c.machine_rank >= c.num_machines)
                throw ::tandem::Refused("machine_rank: got '" + a + "', expected 0 to " +
                                            std::to_string(c.num_machines - 1));
            });
      q.ask("What is the IP address of machine 0 (the one that hosts rank 0)?", "",
            setter("main_process_ip"));
      q.ask("Which port will machine 0 listen on?", "29500", [&](const std::string& a) {
        set_value(c, "main_process_port", a, Source::kConfigFile, "main_process_port");
        if (c.main_process_port == 0)
          throw ::tandem::Refused(
              "main_process_port: got '0', expected a port 1-65535 (every "
              "machine must know it in advance)");
      });
      q.ask("Which rendezvous backend (static, c10d)?", "static", setter("rdzv_backend"));
    }
  }

  bool cpu = true;
  if (type == "MULTI_CPU")
    cpu = true;
  else if (type == "MULTI_GPU")
    cpu = false;
  else
    cpu = q.yes_no("Run on the CPU only, even when GPUs are visible?", gpus == 0);
  set_value(c, "use_cpu", cpu ? "true" : "false", Source::kConfigFile, "use_cpu");

  if (type == "NO") {
    c.num_processes = 1;
  } else {
    const int per_machine = !cpu && gpus > 0 ? gpus : 2;
    q.ask("How many processes in total, over all machines?",
          std::to_string(per_machine * c.num_machines), [&](const std::string& a) {
            set_value(c, "num_processes", a, Source::kConfigFile, "num_processes");
            if (c.num_processes % c.num_machines != 0)
              throw ::tandem::Refused("num_processes: got '" + a +
                                          "', expected a multiple of "
                                          "num_machines " +
                                          std::to_string(c.num_machines) +
                                          " (the same number on every machine)");
          });
  }
  c.sources["num_processes"] = Source::kConfigFile;

  if (!cpu) {
    q.ask("Which GPUs should be used, by index (e.g. 0,1), or all?", "all",
          [&](const std::string& a) {
            set_value(c, "gpu_ids", a, Source::kConfigFile, "gpu_ids");
            if (c.gpu_ids == "all" || gpus == 0) return;
            std::stringstream ss(c.gpu_ids);
            std::string id;
            int n = 0;
            while (std::getline(ss, id, ',')) {
              ++n;
              if (std::stoi(id) >= gpus)
                throw ::tandem::Refused("gpu_ids: device " + id +
                                            " does not exist; this "
                                            "machine has " +
                                            std::to_string(gpus) + " GPUs, numbered 0 to " +
                                            std::to_string(gpus - 1));
            }
            if (n < c.num_processes / c.num_machines)
              throw ::tandem::Refused("gpu_ids: got '" + a + "', " + std::to_string(n) +
                                          " GPUs for " +
                                          std::to_string(c.num_processes / c.num_machines) +
                                          " processes per machine; name one GPU per process");
          });
  }

  const auto& precisions = mixed_precision_values();
  size_t mp = q.choose(
      "Which mixed precision do you use?", precisions,
      {"no (fp32)", "fp16 (autocast with loss scaling)", "bf16 (autocast)", "fp8",
       "bf16-true (parameters and compute in bf16)", "fp16-true (parameters and compute in fp16)"},
      0);
  set_value(c, "mixed_precision", precisions[mp], Source::kConfigFile, "mixed_precision");

  if (type == "FSDP") {
    q.ask(
        "Which sharding strategy (1 FULL_SHARD, 2 SHARD_GRAD_OP, 3 NO_SHARD, 4 HYBRID_SHARD, "
        "5 HYBRID_SHARD_ZERO2)?",
        "FULL_SHARD", setter("fsdp_config.fsdp_sharding_strategy"));
    bool offload = q.yes_no("Offload parameters and gradients to the CPU?", false);
    set_value(c, "fsdp_config.fsdp_offload_params", offload ? "true" : "false", Source::kConfigFile,
              "fsdp_offload_params");
  } else if (type == "DEEPSPEED") {
    q.ask("Which ZeRO stage (0, 1, 2, 3)?", "2", setter("deepspeed_config.zero_stage"));
    q.ask("Where should optimizer states be offloaded (none, cpu, nvme)?", "none",
          setter("deepspeed_config.offload_optimizer_device"));
    if (c.deepspeed_config["zero_stage"] == "3")
      q.ask("Where should parameters be offloaded (none, cpu, nvme)?", "none",
            setter("deepspeed_config.offload_param_device"));
  }

  q.ask("How many gradient accumulation steps?", "1", setter("gradient_accumulation_steps"));
  validate(c);
  return c;
}

}  // namespace tandem::config
