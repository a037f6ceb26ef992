// `tandem launch` with config files (the --dry_run plan of each kind of job), precedence of
// flags, `tandem config` default/show/validate, the questionnaire on a pseudo-terminal, and
// `tandem env`.
#include <gtest/gtest.h>
#include <pty.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "../common/subprocess.h"
#include "tandem/config/config.h"

using tandem::testing::count_of;
using tandem::testing::run_command;

namespace {

const std::string kCli = TANDEM_CLI;
const std::string kData = TANDEM_CONFIG_DATA;

// A fresh TANDEM_CONFIG_HOME per test, so that no default config of this machine interferes.
class ConfigHome : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tandem-home-XXXXXX";
    home_ = mkdtemp(tmpl);
  }
  void TearDown() override { std::system(("rm -rf " + home_).c_str()); }
  std::map<std::string, std::string> env() const {
    // No GPU for these tests: the plans must not depend on the machine they run on.
    return {{"TANDEM_CONFIG_HOME", home_}, {"CUDA_VISIBLE_DEVICES", ""}};
  }
  tandem::testing::RunResult tandem(std::vector<std::string> args) const {
    args.insert(args.begin(), kCli);
    return run_command(args, env(), 60);
  }
  tandem::testing::RunResult dry_run(const std::string& config,
                                     std::vector<std::string> flags = {}) {
    std::vector<std::string> args{"launch", "--config_file", kData + "/" + config + ".yaml"};
    args.insert(args.end(), flags.begin(), flags.end());
    for (const char* a : {"--dry_run", "prog", "--lr", "0.1"}) args.push_back(a);
    return tandem(args);
  }
  std::string home_;
};

bool has(const std::string& out, const std::string& s) {
  return out.find(s) != std::string::npos;
}

// The environment lines of one rank in a --dry_run plan.
std::string rank_block(const std::string& out, int rank) {
  auto start = out.find("rank " + std::to_string(rank) + " (local");
  if (start == std::string::npos) return "";
  auto end = out.find("\nrank ", start + 1);
  return out.substr(start, end == std::string::npos ? std::string::npos : end - start);
}

}  // namespace

using LaunchConfigFiles = ConfigHome;

TEST_F(LaunchConfigFiles, SingleProcess) {
  auto r = dry_run("single_process");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "rank 0 (local 0): prog --lr 0.1")) << r.output;
  EXPECT_EQ(count_of(r.output, "(local "), 1) << r.output;
  auto b = rank_block(r.output, 0);
  EXPECT_TRUE(has(b, "TANDEM_DISTRIBUTED_TYPE=NO")) << b;
  EXPECT_TRUE(has(b, "TANDEM_USE_CPU=1")) << b;
  EXPECT_TRUE(has(b, "TANDEM_MIXED_PRECISION=no")) << b;
  EXPECT_TRUE(has(b, "WORLD_SIZE=1")) << b;
  EXPECT_FALSE(has(r.output, "warning")) << r.output;  // tpu_env: [] etc. are not worth one
}

TEST_F(LaunchConfigFiles, MultiCpu) {
  auto r = dry_run("multi_cpu");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "(local "), 4) << r.output;
  auto b = rank_block(r.output, 3);
  EXPECT_TRUE(has(b, "TANDEM_DISTRIBUTED_TYPE=MULTI_CPU")) << b;
  EXPECT_TRUE(has(b, "RANK=3")) << b;
  EXPECT_TRUE(has(b, "WORLD_SIZE=4")) << b;
}

TEST_F(LaunchConfigFiles, MultiGpuOnAMachineWithoutGpus) {
  auto r = dry_run("multi_gpu");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "note: distributed_type MULTI_GPU: no GPU is visible")) << r.output;
  EXPECT_EQ(count_of(r.output, "(local "), 2) << r.output;
  auto b = rank_block(r.output, 1);
  EXPECT_TRUE(has(b, "TANDEM_DISTRIBUTED_TYPE=MULTI_CPU")) << b;
  EXPECT_TRUE(has(b, "TANDEM_MIXED_PRECISION=bf16")) << b;
  EXPECT_TRUE(has(b, "TANDEM_GPU_IDS=0,1")) << b;
  EXPECT_TRUE(has(b, "CUDA_VISIBLE_DEVICES=0,1")) << b;
}

TEST_F(LaunchConfigFiles, MultiMachine) {
  auto r = dry_run("multi_machine");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "(local "), 4) << r.output;
  EXPECT_TRUE(has(r.output, "rank 4 (local 0)")) << r.output;
  EXPECT_TRUE(has(r.output, "rank 7 (local 3)")) << r.output;
  auto b = rank_block(r.output, 5);
  EXPECT_TRUE(has(b, "WORLD_SIZE=8")) << b;
  EXPECT_TRUE(has(b, "LOCAL_RANK=1")) << b;
  EXPECT_TRUE(has(b, "GROUP_RANK=1")) << b;
  EXPECT_TRUE(has(b, "MASTER_ADDR=10.0.0.1")) << b;
  EXPECT_TRUE(has(b, "MASTER_PORT=29500")) << b;
  EXPECT_TRUE(has(r.output, "rdzv_backend: c10d  [config file]")) << r.output;
}

// Sharding reaches the ranks as TANDEM_* settings (FSDP's strategies and DeepSpeed's stages are
// ZeRO stages 0-3); what tandem cannot honour (parameter offload below stage 3, a stage that does
// not exist) is refused before any rank starts, naming where the request came from; nothing runs
// as something else behind the user's back.
TEST_F(LaunchConfigFiles, ShardingIsPassedOnOrRefused) {
  auto r = dry_run("fsdp");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto b = rank_block(r.output, 1);
  EXPECT_TRUE(has(b, "TANDEM_DISTRIBUTED_TYPE=FSDP")) << b;
  EXPECT_TRUE(has(b, "TANDEM_FSDP_SHARDING_STRATEGY=SHARD_GRAD_OP")) << b;
  EXPECT_TRUE(has(b, "TANDEM_FSDP_OFFLOAD_PARAMS=true")) << b;
  r = dry_run("deepspeed");  // zero_stage 3, optimizer and parameters offloaded
  ASSERT_EQ(r.exit_code, 0) << r.output;
  b = rank_block(r.output, 0);
  EXPECT_TRUE(has(b, "TANDEM_ZERO_STAGE=3")) << b;
  EXPECT_TRUE(has(b, "TANDEM_OFFLOAD_PARAM_DEVICE=cpu")) << b;
  r = dry_run("deepspeed", {"--zero_stage", "2"});  // parameters offloaded without stage 3
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, kData + "/deepspeed.yaml")) << r.output;
  EXPECT_TRUE(has(r.output, "offload_param_device cpu needs zero_stage 3")) << r.output;
  EXPECT_EQ(count_of(r.output, "(local "), 0) << r.output;
  r = tandem({"launch", "--use_fsdp", "--num_processes", "2", "--cpu", "--dry_run", "prog"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(rank_block(r.output, 0), "TANDEM_FSDP_SHARDING_STRATEGY=FULL_SHARD")) << r.output;
  r = tandem({"launch", "--use_deepspeed", "--num_processes", "2", "--cpu", "--dry_run",
              "prog"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(rank_block(r.output, 0), "TANDEM_ZERO_STAGE=2")) << r.output;
  std::ofstream(home_ + "/megatron.yaml") << "distributed_type: MEGATRON_LM\nnum_processes: 2\n";
  r = tandem({"launch", "--config_file", home_ + "/megatron.yaml", "--cpu", "true"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "MEGATRON_LM")) << r.output;
}

TEST_F(LaunchConfigFiles, MixedPrecision) {
  auto r = dry_run("fp8");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto b = rank_block(r.output, 0);
  for (const char* kv : {"TANDEM_MIXED_PRECISION=fp8", "TANDEM_FP8_BACKEND=TE",
                         "TANDEM_FP8_FORMAT=E4M3", "TANDEM_FP8_AMAX_HISTORY_LEN=1024",
                         "TANDEM_FP8_OVERRIDE_LINEAR_PRECISION=false,false,false"})
    EXPECT_TRUE(has(b, kv)) << kv << "\n" << b;
  r = dry_run("bf16_true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(rank_block(r.output, 1), "TANDEM_MIXED_PRECISION=bf16-true")) << r.output;
}

TEST_F(LaunchConfigFiles, IgnoredSettingsWarnOnce) {
  auto r = dry_run("tpu_ignored");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "warning"), 1) << r.output;
  EXPECT_TRUE(has(r.output, "tpu_name, tpu_zone, command_file")) << r.output;
}

TEST_F(LaunchConfigFiles, FlagsBeatTheFile) {
  // --multi_gpu replaces the file's DEEPSPEED (and, without GPUs, runs on the CPU).
  auto r = dry_run("deepspeed",
                   {"--multi_gpu", "--num-processes", "3", "--mixed_precision", "bf16-true"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "(local "), 3) << r.output;
  auto b = rank_block(r.output, 2);
  EXPECT_TRUE(has(b, "TANDEM_DISTRIBUTED_TYPE=MULTI_CPU")) << b;
  EXPECT_TRUE(has(b, "TANDEM_MIXED_PRECISION=bf16-true")) << b;
  EXPECT_TRUE(has(b, "TANDEM_GRADIENT_ACCUMULATION_STEPS=4")) << b;  // from the file
  // The file's deepspeed_config no longer applies, and the one warning says so.
  EXPECT_TRUE(has(r.output,
                  "deepspeed_config.zero_stage: 3 (distributed_type is MULTI_GPU, not "
                  "DEEPSPEED)"))
      << r.output;
  EXPECT_EQ(count_of(r.output, "warning"), 1) << r.output;
  EXPECT_TRUE(has(r.output, "num_processes: 3 (3 on this machine)  [command line]")) << r.output;
  EXPECT_TRUE(has(r.output, "deepspeed_config.offload_optimizer_device: cpu  [config file]"))
      << r.output;
  EXPECT_TRUE(has(r.output, "gradient_accumulation_steps: 4  [config file]")) << r.output;
  // A DeepSpeed flag beside --multi_gpu would change nothing: refused, naming both.
  r = dry_run("deepspeed", {"--multi_gpu", "--zero_stage", "2"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "--zero_stage 2 needs --use_deepspeed")) << r.output;
  EXPECT_TRUE(has(r.output, "distributed_type MULTI_GPU from the command line")) << r.output;
  EXPECT_EQ(count_of(r.output, "(local "), 0) << r.output;

  // --env wins over the TANDEM_* settings.
  r = dry_run("multi_cpu", {"--env", "TANDEM_MIXED_PRECISION=no", "--mixed_precision", "bf16"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(rank_block(r.output, 0), "TANDEM_MIXED_PRECISION=no")) << r.output;
}

TEST_F(LaunchConfigFiles, TheDefaultConfigIsUsedWithoutConfigFile) {
  std::ifstream src(kData + "/multi_cpu.yaml");
  std::ofstream(home_ + "/default_config.yaml") << src.rdbuf();
  auto r = tandem({"launch", "--dry_run", "prog"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "config file: " + home_ + "/default_config.yaml")) << r.output;
  EXPECT_TRUE(has(rank_block(r.output, 1), "TANDEM_DISTRIBUTED_TYPE=MULTI_CPU")) << r.output;
  // --debug prints the resolved configuration and still runs the program.
  r = tandem({"launch", "--debug", "--num_processes", "1", "true"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "tandem launch configuration")) << r.output;
  EXPECT_TRUE(has(r.output, "TANDEM_DEBUG=1")) << r.output;
}

TEST_F(LaunchConfigFiles, ErrorsNameTheProblem) {
  auto r = tandem({"launch", "--num_processes", "0", "--dry_run", "prog"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "--num_processes: got '0', expected an integer of at least 1"))
      << r.output;
  r = tandem({"launch", "--config_file", home_ + "/none.yaml", "--dry_run", "prog"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "cannot read the config file " + home_ + "/none.yaml")) << r.output;
  std::ofstream(home_ + "/bad.yaml") << "distributed_type: NO\nnum_processes: [2\n";
  r = tandem({"launch", "--config_file", home_ + "/bad.yaml", "--dry_run", "prog"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "is not valid YAML: line")) << r.output;
  r = tandem({"launch", "--use_fsdp", "--use_deepspeed", "--num_processes", "2", "prog"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "only one of")) << r.output;
  r = tandem({"launch", "--num_machines", "2", "--num_processes", "2", "prog"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "main_process_ip is required")) << r.output;
}

TEST_F(LaunchConfigFiles, HelpIsGrouped) {
  auto r = tandem({"launch", "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* g : {"Hardware:", "Resources:", "Distributed:", "Precision:", "Sharding:",
                        "Logging:", "--num_processes", "--num-processes", "--fsdp_offload_params",
                        "--zero_stage", "--mixed_precision", "--gpu_ids", "--config_file"})
    EXPECT_TRUE(has(r.output, g)) << g << "\n" << r.output;
}

using ConfigCommand = ConfigHome;

TEST_F(ConfigCommand, DefaultShowValidate) {
  auto r = tandem({"config", "show"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "no configuration at " + home_ + "/default_config.yaml")) << r.output;

  r = tandem({"config", "default", "--mixed_precision", "bf16"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "saved at " + home_ + "/default_config.yaml")) << r.output;
  auto cfg = tandem::config::load_config_file(home_ + "/default_config.yaml");
  EXPECT_EQ(cfg.mixed_precision, "bf16");
  EXPECT_EQ(cfg.distributed_type, "NO");
  EXPECT_TRUE(cfg.use_cpu);

  r = tandem({"config", "default"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "already exists")) << r.output;

  r = tandem({"config", "show"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "mixed_precision: bf16")) << r.output;

  r = tandem({"config", "validate"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "is valid")) << r.output;
  r = tandem({"config", "validate", kData + "/deepspeed.yaml"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "distributed_type DEEPSPEED, num_processes 2")) << r.output;
  EXPECT_FALSE(has(r.output, "refuses")) << r.output;  // ZeRO-3 with offload runs
  std::ofstream(home_ + "/megatron.yaml") << "distributed_type: MEGATRON_LM\nnum_processes: 2\n";
  r = tandem({"config", "validate", home_ + "/megatron.yaml"});
  EXPECT_EQ(r.exit_code, 1) << r.output;  // what tandem launch refuses is not valid
  EXPECT_TRUE(has(r.output, "tandem config validate: distributed_type MEGATRON_LM")) << r.output;
  EXPECT_FALSE(has(r.output, "is valid")) << r.output;
  std::ofstream(home_ + "/wrong.yaml") << "distributed_type: MULTI_CPU\nnum_machines: 2\n"
                                          "machine_rank: 3\nmain_process_ip: h\n"
                                          "main_process_port: 1\nnum_processes: 2\n";
  r = tandem({"config", "validate", home_ + "/wrong.yaml"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "machine_rank 3 is not below num_machines 2")) << r.output;

  r = tandem(
      {"config", "default", "--config_file", home_ + "/other/x.yaml", "--mixed_precision", "fp64"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "--mixed_precision: got 'fp64'")) << r.output;

  // `tandem env` reports the default config.
  r = tandem({"env"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "Default config: " + home_ + "/default_config.yaml")) << r.output;
  EXPECT_TRUE(has(r.output, "    mixed_precision: bf16")) << r.output;
}

// `tandem config validate` and `tandem launch` give one answer on files for devices tandem does
// not drive: both refuse, with the same message.
TEST_F(ConfigCommand, ValidateAndLaunchAgreeOnOtherDevices) {
  for (const char* type : {"TPU", "MULTI_XPU"}) {
    for (const char* more : {"", "num_processes: 2\n"}) {
      const std::string path = home_ + "/device.yaml";
      std::ofstream(path) << "distributed_type: " << type << "\n" << more;
      auto v = tandem({"config", "validate", path});
      auto l = tandem({"launch", "--config_file", path, "--dry_run", "prog"});
      EXPECT_EQ(v.exit_code, 1) << v.output;
      EXPECT_EQ(l.exit_code, 2) << l.output;
      EXPECT_FALSE(has(v.output, "is valid")) << v.output;
      EXPECT_EQ(count_of(l.output, "(local "), 0) << l.output;
      auto message = [](const std::string& out, const std::string& prefix) {
        auto at = out.find(prefix);
        if (at == std::string::npos) return std::string();
        auto end = out.find('\n', at);
        return out.substr(at + prefix.size(), end - at - prefix.size());
      };
      const auto said = message(v.output, "tandem config validate: ");
      EXPECT_TRUE(has(said, "does not drive")) << v.output;
      EXPECT_EQ(said, message(l.output, "tandem launch: ")) << v.output << "\n" << l.output;
    }
  }
}

// Keys tandem checks but does not act on are named in one warning, by validate and by launch.
TEST_F(ConfigCommand, SettingsNotActedOnAreNamed) {
  const std::string path = home_ + "/prefetch.yaml";
  std::ofstream(path) << "distributed_type: FSDP\nnum_processes: 2\nuse_cpu: true\n"
                         "fsdp_config:\n  fsdp_sync_module_states: false\n"
                         "  fsdp_use_orig_params: false\n";
  for (auto r : {tandem({"config", "validate", path}),
                 tandem({"launch", "--config_file", path, "--dry_run", "prog"})}) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(count_of(r.output, "warning"), 1) << r.output;
    EXPECT_TRUE(has(r.output, "does not act on them yet")) << r.output;
    EXPECT_TRUE(has(r.output,
                    "fsdp_config.fsdp_sync_module_states: false, "
                    "fsdp_config.fsdp_use_orig_params: false"))
        << r.output;
  }
  // Given on the command line, too.
  auto r = tandem({"launch", "--use_fsdp", "--num_processes", "2", "--cpu",
                   "--fsdp_state_dict_type", "SHARDED_STATE_DICT", "--dry_run", "prog"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "fsdp_config.fsdp_state_dict_type: SHARDED_STATE_DICT")) << r.output;
  // A typo inside a section is refused by both, naming the closest key.
  std::ofstream(path) << "distributed_type: DEEPSPEED\nnum_processes: 2\nuse_cpu: true\n"
                         "deepspeed_config:\n  zero_stgae: 3\n";
  for (auto t : {tandem({"config", "validate", path}),
                 tandem({"launch", "--config_file", path, "--dry_run", "prog"})}) {
    EXPECT_NE(t.exit_code, 0) << t.output;
    EXPECT_TRUE(has(t.output,
                    "'zero_stgae' is not a key of deepspeed_config; did you mean "
                    "zero_stage?"))
        << t.output;
    EXPECT_EQ(count_of(t.output, "(local "), 0) << t.output;
  }
}

TEST_F(ConfigCommand, QuestionnaireNeedsATerminal) {
  auto r = tandem({"config"});  // stdin is not a terminal here
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "needs a terminal")) << r.output;
  r = tandem({"env"});
  EXPECT_TRUE(has(r.output, "Default config: none")) << r.output;
}

// The questionnaire on a pseudo-terminal, as a user sees it, with a wrong answer re-asked.
TEST_F(ConfigCommand, QuestionnaireOnATerminal) {
  int fd = -1;
  pid_t pid = forkpty(&fd, nullptr, nullptr, nullptr);
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    setenv("TANDEM_CONFIG_HOME", home_.c_str(), 1);
    setenv("CUDA_VISIBLE_DEVICES", "", 1);
    execl(kCli.c_str(), kCli.c_str(), "config", static_cast<char*>(nullptr));
    _exit(127);
  }
  std::string seen;
  size_t cursor = 0;
  // Reads until `text` appears after the previous match; false on timeout or end.
  auto expect = [&](const std::string& text) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (;;) {
      auto at = seen.find(text, cursor);
      if (at != std::string::npos) {
        cursor = at + text.size();
        return true;
      }
      if (std::chrono::steady_clock::now() > deadline) return false;
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 100) > 0) {
        char buf[1024];
        ssize_t n = read(fd, buf, sizeof(buf));
        if (n <= 0) return false;
        seen.append(buf, static_cast<size_t>(n));
      }
    }
  };
  auto send = [&](const std::string& line) {
    std::string s = line + "\n";
    ASSERT_EQ(write(fd, s.data(), s.size()), static_cast<ssize_t>(s.size()));
  };
  ASSERT_TRUE(expect("In which compute environment")) << seen;
  ASSERT_TRUE(expect("Your choice [0]: ")) << seen;
  send("");
  ASSERT_TRUE(expect("Which type of distributed training")) << seen;
  ASSERT_TRUE(expect("Your choice [0]: ")) << seen;
  send("1");  // MULTI_CPU
  ASSERT_TRUE(expect("How many machines")) << seen;
  send("");
  ASSERT_TRUE(expect("How many processes in total, over all machines? [2]: ")) << seen;
  send("0");
  ASSERT_TRUE(expect("num_processes: got '0', expected an integer of at least 1")) << seen;
  ASSERT_TRUE(expect("please answer again")) << seen;
  ASSERT_TRUE(expect("How many processes in total, over all machines? [2]: ")) << seen;
  send("3");
  ASSERT_TRUE(expect("Which mixed precision")) << seen;
  ASSERT_TRUE(expect("Your choice [0]: ")) << seen;
  send("bf16");
  ASSERT_TRUE(expect("How many gradient accumulation steps? [1]: ")) << seen;
  send("2");
  ASSERT_TRUE(expect("tandem configuration saved at " + home_ + "/default_config.yaml")) << seen;
  int status = 0;
  waitpid(pid, &status, 0);
  close(fd);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << seen;

  auto cfg = tandem::config::load_config_file(home_ + "/default_config.yaml");
  EXPECT_EQ(cfg.distributed_type, "MULTI_CPU");
  EXPECT_EQ(cfg.num_processes, 3);
  EXPECT_TRUE(cfg.use_cpu);
  EXPECT_EQ(cfg.mixed_precision, "bf16");
  EXPECT_EQ(cfg.gradient_accumulation_steps, 2);
  // ... and `tandem launch` uses it.
  auto r = tandem({"launch", "--dry_run", "prog"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "(local "), 3) << r.output;
  EXPECT_TRUE(has(rank_block(r.output, 2), "TANDEM_GRADIENT_ACCUMULATION_STEPS=2")) << r.output;
}
