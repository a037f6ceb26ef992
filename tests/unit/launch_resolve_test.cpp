// Flags over config file over defaults, the distributed type, the device-count check, the
// TANDEM_* environment, and the fork launcher's safety check: all without processes.
#include <gtest/gtest.h>

#include "tandem/config/config.h"
#include "tandem/launch/fork_launcher.h"
#include "tandem/launch/resolve.h"
#include "../common/errors.h"

using tandem::config::LaunchConfig;
using tandem::config::parse_config;
using tandem::config::Source;
using tandem::launch::FlagValues;
using tandem::launch::MachineInfo;
using tandem::launch::program_environment;
using tandem::launch::resolve_launch;

namespace {

// The message of any exception `f` throws (the resolver throws several kinds).
template <typename F>
std::string message_of(F&& f) {
  return tandem::testing::error_of<std::exception>(std::forward<F>(f));
}
using tandem::testing::contains;

const std::string kConfigData = TANDEM_CONFIG_DATA;

MachineInfo cpu_machine() {
  return MachineInfo{};
}
MachineInfo gpu_machine(int n) {
  MachineInfo m;
  m.cuda_devices = n;
  return m;
}

LaunchConfig file(const std::string& name) {
  return tandem::config::load_config_file(kConfigData + "/" + name + ".yaml");
}

}  // namespace

TEST(LaunchResolve, CommandLineBeatsConfigFileBeatsDefaults) {
  auto base = file("multi_cpu");
  base.mixed_precision = "bf16";
  base.sources["mixed_precision"] = Source::kConfigFile;
  auto r = resolve_launch(base, {{"num_processes", "2"}}, cpu_machine());
  EXPECT_EQ(r.config.num_processes, 2);
  EXPECT_EQ(r.config.sources.at("num_processes"), Source::kCommandLine);
  EXPECT_EQ(r.config.mixed_precision, "bf16");
  EXPECT_EQ(r.config.sources.at("mixed_precision"), Source::kConfigFile);
  EXPECT_FALSE(r.config.given("gradient_accumulation_steps"));
  EXPECT_EQ(r.config.gradient_accumulation_steps, 1);
  auto text = tandem::launch::describe_resolved(r);
  EXPECT_TRUE(contains(text, "num_processes: 2 (2 on this machine)  [command line]")) << text;
  EXPECT_TRUE(contains(text, "mixed_precision: bf16  [config file]")) << text;
  EXPECT_TRUE(contains(text, "gradient_accumulation_steps: 1  [default]")) << text;

  // Without any file: defaults, then flags.
  auto plain = resolve_launch(LaunchConfig(), {}, cpu_machine());
  EXPECT_EQ(plain.distributed_type, "NO");
  EXPECT_EQ(plain.processes_per_machine, 1);
  auto flags =
      resolve_launch(LaunchConfig(), {{"num_processes", "3"}, {"use_cpu", "true"}}, cpu_machine());
  EXPECT_EQ(flags.distributed_type, "MULTI_CPU");
  EXPECT_EQ(flags.processes_per_machine, 3);
}

TEST(LaunchResolve, FlagErrorsNameTheFlag) {
  auto e = message_of([] {
    resolve_launch(LaunchConfig(), {{"num_processes", "0"}}, cpu_machine());
  });
  EXPECT_TRUE(contains(e, "--num_processes: got '0'")) << e;
  e = message_of([] {
    resolve_launch(LaunchConfig(), {{"mixed_precision", "fp64"}}, cpu_machine());
  });
  EXPECT_TRUE(contains(e, "--mixed_precision: got 'fp64'")) << e;
  EXPECT_TRUE(contains(e, "bf16-true")) << e;
  e = message_of([] {
    resolve_launch(LaunchConfig(), {{"fsdp_config.fsdp_sharding_strategy", "9"}}, cpu_machine());
  });
  EXPECT_TRUE(contains(e, "--fsdp_sharding_strategy: got '9'")) << e;
  e = message_of([] {
    resolve_launch(LaunchConfig(), {{"deepspeed_config.zero_stage", "4"}}, cpu_machine());
  });
  EXPECT_TRUE(contains(e, "--zero_stage: got '4'")) << e;
  e = message_of([] { resolve_launch(LaunchConfig(), {{"gpu_ids", "a,b"}}, cpu_machine()); });
  EXPECT_TRUE(contains(e, "--gpu_ids")) << e;
  e = message_of([] {
    resolve_launch(LaunchConfig(),
                   {{"num_machines", "2"},
                    {"machine_rank", "2"},
                    {"main_process_ip", "h"},
                    {"main_process_port", "5"}},
                   cpu_machine());
  });
  EXPECT_TRUE(contains(e, "machine_rank 2 is not below num_machines 2")) << e;
}

TEST(LaunchResolve, DistributedType) {
  // Only one sharding / multi-GPU switch.
  auto e = message_of([] {
    resolve_launch(LaunchConfig(),
                   {{"distributed_type", "FSDP"}, {"distributed_type", "DEEPSPEED"}},
                   cpu_machine());
  });
  EXPECT_TRUE(contains(e, "only one of --multi_gpu, --use_fsdp, --use_deepspeed")) << e;
  EXPECT_TRUE(contains(e, "--use_fsdp and --use_deepspeed")) << e;
  e = message_of([] {
    resolve_launch(LaunchConfig(),
                   {{"use_cpu", "true"}, {"distributed_type", "MULTI_GPU"}, {"num_processes", "2"}},
                   gpu_machine(2));
  });
  EXPECT_TRUE(contains(e, "--cpu and --multi_gpu")) << e;
  e = message_of([] {
    resolve_launch(LaunchConfig(), {{"distributed_type", "MULTI_GPU"}, {"num_processes", "1"}},
                   gpu_machine(2));
  });
  EXPECT_TRUE(contains(e, "--multi_gpu needs at least 2 processes")) << e;

  // A GPU config with --cpu runs on the CPU; on a machine without GPUs too, with a note.
  auto r = resolve_launch(file("multi_gpu"), {{"use_cpu", "true"}}, gpu_machine(2));
  EXPECT_EQ(r.distributed_type, "MULTI_CPU");
  EXPECT_FALSE(r.on_gpu);
  r = resolve_launch(file("multi_gpu"), {}, cpu_machine());
  EXPECT_EQ(r.distributed_type, "MULTI_CPU");
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_TRUE(contains(r.notes[0], "no GPU is visible")) << r.notes[0];
  r = resolve_launch(file("multi_gpu"), {}, gpu_machine(2));
  EXPECT_EQ(r.distributed_type, "MULTI_GPU");
  EXPECT_TRUE(r.on_gpu);

  // FSDP and DEEPSPEED run on the CPU too (tandem's sharding works there).
  EXPECT_EQ(resolve_launch(file("fsdp"), {}, cpu_machine()).distributed_type, "FSDP");
  EXPECT_EQ(resolve_launch(file("deepspeed"), {}, cpu_machine()).distributed_type, "DEEPSPEED");
  // Flags replace the file's type; one process is not distributed.
  EXPECT_EQ(resolve_launch(file("fsdp"), {{"distributed_type", "DEEPSPEED"}}, cpu_machine())
                .distributed_type,
            "DEEPSPEED");
  EXPECT_EQ(
      resolve_launch(file("multi_cpu"), {{"num_processes", "1"}}, cpu_machine()).distributed_type,
      "NO");
  // SageMaker's DATA_PARALLEL runs as data parallel; devices tandem cannot drive are refused
  // (DeviceTypesTandemCannotDriveAreRefused).
  auto dp = parse_config("distributed_type: DATA_PARALLEL\nnum_processes: 2\nuse_cpu: true\n");
  EXPECT_EQ(resolve_launch(dp, {}, cpu_machine()).distributed_type, "MULTI_CPU");
}

// `tandem config validate` and `tandem launch` give one answer on a file for other devices: the
// same refusal (check_strategy_available), before anything else about the file is resolved.
TEST(LaunchResolve, DeviceTypesTandemCannotDriveAreRefused) {
  for (const char* type : {"TPU", "MULTI_XPU", "MULTI_NPU", "MULTI_HPU", "MODEL_PARALLEL"}) {
    for (const char* more : {"", "num_processes: 2\nuse_cpu: true\n"}) {
      auto cfg = parse_config(std::string("distributed_type: ") + type + "\n" + more, "dev.yaml");
      tandem::launch::ResolvedLaunch as_validate;  // what `tandem config validate` checks
      as_validate.config = cfg;
      as_validate.distributed_type = cfg.distributed_type;
      auto validate_says =
          message_of([&] { tandem::launch::check_strategy_available(as_validate); });
      auto launch_says = message_of([&] { resolve_launch(cfg, {}, cpu_machine()); });
      EXPECT_EQ(launch_says, validate_says) << type;
      EXPECT_TRUE(contains(launch_says, "(from dev.yaml) asks for")) << launch_says;
      EXPECT_TRUE(contains(launch_says, "MULTI_CPU")) << launch_says;     // what runs instead
      EXPECT_TRUE(tandem::config::ignored_warning(cfg).empty()) << type;  // not "ignored"
    }
  }
  auto e = message_of(
      [] { resolve_launch(parse_config("distributed_type: TPU\n"), {}, cpu_machine()); });
  EXPECT_TRUE(contains(e, "distributed_type XLA (from <config>) asks for TPUs")) << e;
  EXPECT_TRUE(contains(e, "does not drive")) << e;
}

// Note [Pipelines and ZeRO], and a strategy flag without the flag that enables it: refused at
// launch, naming both flags.
TEST(LaunchResolve, StrategyFlagsNeedTheirEnablingFlag) {
  auto e = message_of([] {
    resolve_launch(LaunchConfig(), {{"num_processes", "2"}, {"deepspeed_config.zero_stage", "3"}},
                   cpu_machine());
  });
  EXPECT_TRUE(contains(e,
                       "--zero_stage 3 needs --use_deepspeed (or use --use_fsdp for FSDP's "
                       "FULL_SHARD)"))
      << e;
  EXPECT_TRUE(contains(e, "plain data parallel")) << e;
  for (const char* key :
       {"deepspeed_config.offload_optimizer_device", "deepspeed_config.offload_param_device"}) {
    e = message_of([&] {
      resolve_launch(LaunchConfig(), {{"num_processes", "2"}, {key, "cpu"}}, cpu_machine());
    });
    EXPECT_TRUE(contains(e, tandem::launch::flag_for_key(key) + " cpu needs --use_deepspeed")) << e;
  }
  e = message_of([] {
    resolve_launch(LaunchConfig(),
                   {{"distributed_type", "DEEPSPEED"},
                    {"num_processes", "2"},
                    {"fsdp_config.fsdp_offload_params", "true"}},
                   cpu_machine());
  });
  EXPECT_TRUE(contains(e, "--fsdp_offload_params true needs --use_fsdp")) << e;
  EXPECT_TRUE(contains(e, "distributed_type DEEPSPEED from the command line")) << e;
  e = message_of([] {
    resolve_launch(file("fsdp"), {{"deepspeed_config.zero_stage", "3"}}, cpu_machine());
  });
  EXPECT_TRUE(contains(e, "--zero_stage 3 needs --use_deepspeed")) << e;
  EXPECT_TRUE(contains(e, "fsdp.yaml")) << e;  // where the FSDP type came from
  // The enabling flag, or the file's type, or a key that acts under every strategy: accepted.
  EXPECT_NO_THROW(
      resolve_launch(file("deepspeed"), {{"deepspeed_config.zero_stage", "3"}}, cpu_machine()));
  EXPECT_NO_THROW(resolve_launch(LaunchConfig(),
                                 {{"distributed_type", "DEEPSPEED"},
                                  {"num_processes", "2"},
                                  {"deepspeed_config.zero_stage", "3"}},
                                 cpu_machine()));
  EXPECT_NO_THROW(resolve_launch(LaunchConfig(),
                                 {{"num_processes", "2"},
                                  {"deepspeed_config.gradient_clipping", "1.0"},
                                  {"fsdp_config.fsdp_activation_checkpointing", "true"}},
                                 cpu_machine()));

  // --pp_size with ZeRO (DeepSpeed's default stage 2 included) or FSDP.
  auto pp = [](FlagValues more) {
    FlagValues f = {{"num_processes", "2"}, {"parallelism_config.pp_size", "2"}};
    f.insert(f.end(), more.begin(), more.end());
    return message_of([&] { resolve_launch(LaunchConfig(), f, cpu_machine()); });
  };
  e = pp({{"distributed_type", "DEEPSPEED"}, {"deepspeed_config.zero_stage", "2"}});
  EXPECT_TRUE(contains(e, "--pp_size 2 does not combine with --use_deepspeed --zero_stage 2")) << e;
  e = pp({{"distributed_type", "DEEPSPEED"}});
  EXPECT_TRUE(contains(e, "--pp_size 2 does not combine with --use_deepspeed (ZeRO stage 2")) << e;
  e = pp({{"distributed_type", "FSDP"}});
  EXPECT_TRUE(contains(e, "--pp_size 2 does not combine with --use_fsdp (FULL_SHARD)")) << e;
  EXPECT_TRUE(contains(e, "--tp_size")) << e;  // what combines with ZeRO
  EXPECT_EQ(pp({{"distributed_type", "DEEPSPEED"}, {"deepspeed_config.zero_stage", "0"}}), "");
  EXPECT_EQ(pp({}), "");
}

// --env cannot set what the launcher writes for every rank: it would be replaced silently.
TEST(LaunchResolve, EnvCannotSetWhatTheLauncherSetsPerRank) {
  auto resolved = resolve_launch(file("multi_cpu"), {}, cpu_machine());
  auto e = message_of([&] { tandem::launch::to_launch_options(resolved, {{"RANK", "5"}}); });
  EXPECT_TRUE(contains(e, "--env RANK=5: tandem launch sets RANK for every rank itself")) << e;
  EXPECT_TRUE(contains(e, "--machine_rank")) << e;
  for (const auto& [name, flag] :
       std::vector<std::pair<std::string, std::string>>{{"WORLD_SIZE", "--num_processes"},
                                                        {"LOCAL_RANK", "--num_processes"},
                                                        {"LOCAL_WORLD_SIZE", "--num_processes"},
                                                        {"MASTER_ADDR", "--main_process_ip"},
                                                        {"MASTER_PORT", "--main_process_port"},
                                                        {"TANDEM_RESTART_COUNT", "--max_restarts"},
                                                        {"TANDEM_USE_CPU", "--cpu"}}) {
    const std::string variable = name;
    e = message_of([&] { tandem::launch::to_launch_options(resolved, {{variable, "1"}}); });
    EXPECT_TRUE(contains(e, "--env " + name + "=1")) << e;
    EXPECT_TRUE(contains(e, flag)) << e;
  }
  EXPECT_NO_THROW(tandem::launch::to_launch_options(resolved, {{"GLOO_SOCKET_IFNAME", "lo"}}));
}

TEST(LaunchResolve, NumberOfProcesses) {
  // A GPU type without num_processes uses every GPU (or the gpu_ids), on every machine.
  auto cfg = parse_config("distributed_type: MULTI_GPU\n");
  EXPECT_EQ(resolve_launch(cfg, {}, gpu_machine(4)).config.num_processes, 4);
  cfg = parse_config("distributed_type: MULTI_GPU\ngpu_ids: 0,2\n");
  EXPECT_EQ(resolve_launch(cfg, {}, gpu_machine(4)).config.num_processes, 2);
  // ... and is an error where there is nothing to count.
  auto e = message_of(
      [] { resolve_launch(parse_config("distributed_type: MULTI_CPU\n"), {}, cpu_machine()); });
  EXPECT_TRUE(contains(e, "pass --num_processes")) << e;
  e = message_of([] {
    resolve_launch(parse_config("distributed_type: NO\nnum_processes: -1\n"), {}, cpu_machine());
  });
  EXPECT_TRUE(contains(e, "num_processes is -1")) << e;
  EXPECT_EQ(resolve_launch(parse_config("distributed_type: NO\nnum_processes: -1\n"),
                           {{"num_processes", "2"}}, cpu_machine())
                .processes_per_machine,
            2);
  // num_processes counts all machines (Accelerate's meaning).
  auto r = resolve_launch(file("multi_machine"), {}, cpu_machine());
  EXPECT_EQ(r.processes_per_machine, 4);
  auto opts = tandem::launch::to_launch_options(r, {});
  auto plan = tandem::launch::make_plan(opts, {"prog"}, {});
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].rank, 4);
  EXPECT_EQ(plan[3].rank, 7);
  EXPECT_EQ(plan[0].env.at("WORLD_SIZE"), "8");
  EXPECT_EQ(plan[0].env.at("MASTER_ADDR"), "10.0.0.1");
  EXPECT_EQ(plan[0].env.at("MASTER_PORT"), "29500");
  EXPECT_EQ(plan[0].env.at("LOCAL_WORLD_SIZE"), "4");
  e = message_of([] {
    resolve_launch(file("multi_machine"), {{"num_processes", "6"}, {"num_machines", "4"}},
                   cpu_machine());
  });
  EXPECT_TRUE(contains(e, "not a multiple of num_machines 4")) << e;
}

TEST(LaunchResolve, DeviceCountCheck) {
  using tandem::launch::check_device_count;
  EXPECT_NO_THROW(check_device_count(2, 2, ""));
  EXPECT_NO_THROW(check_device_count(2, 4, "1,3"));
  EXPECT_NO_THROW(check_device_count(4, 4, "all"));
  auto e = message_of([] { check_device_count(4, 2, "", "0,1"); });
  EXPECT_TRUE(contains(e, "4 processes per machine need 4 GPUs")) << e;
  EXPECT_TRUE(contains(e, "there are 2 GPUs visible (CUDA_VISIBLE_DEVICES=0,1)")) << e;
  EXPECT_TRUE(contains(e, "--cpu")) << e;
  e = message_of([] { check_device_count(2, 1, ""); });
  EXPECT_TRUE(contains(e, "there is 1 GPU visible")) << e;
  e = message_of([] { check_device_count(1, 2, "0,5"); });
  EXPECT_TRUE(contains(e, "device 5 does not exist")) << e;
  EXPECT_TRUE(contains(e, "numbered 0 to 1")) << e;
  e = message_of([] { check_device_count(2, 4, "3"); });
  EXPECT_TRUE(contains(e, "1 GPU chosen by --gpu_ids 3 (of 4 GPUs visible)")) << e;

  // resolve_launch applies it on GPU runs only.
  e = message_of([] { resolve_launch(LaunchConfig(), {{"num_processes", "3"}}, gpu_machine(2)); });
  EXPECT_TRUE(contains(e, "3 processes per machine need 3 GPUs")) << e;
  EXPECT_NO_THROW(resolve_launch(LaunchConfig(), {{"num_processes", "3"}, {"use_cpu", "true"}},
                                 gpu_machine(2)));
  EXPECT_NO_THROW(resolve_launch(LaunchConfig(), {{"num_processes", "3"}}, cpu_machine()));
}

TEST(LaunchResolve, EnvironmentOfTheRanks) {
  auto env = program_environment(resolve_launch(file("deepspeed"), {}, cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_DISTRIBUTED_TYPE"), "DEEPSPEED");
  EXPECT_EQ(env.at("TANDEM_MIXED_PRECISION"), "fp16");
  EXPECT_EQ(env.at("TANDEM_GRADIENT_ACCUMULATION_STEPS"), "4");
  EXPECT_EQ(env.at("TANDEM_ZERO_STAGE"), "3");
  EXPECT_EQ(env.at("TANDEM_OFFLOAD_OPTIMIZER_DEVICE"), "cpu");
  EXPECT_EQ(env.at("TANDEM_OFFLOAD_PARAM_DEVICE"), "cpu");
  EXPECT_EQ(env.at("TANDEM_GRADIENT_CLIPPING"), "1.0");
  EXPECT_EQ(env.at("TANDEM_ZERO3_INIT_FLAG"), "true");
  EXPECT_EQ(env.at("TANDEM_ZERO3_SAVE_16BIT_MODEL"), "true");
  EXPECT_EQ(env.at("TANDEM_USE_CPU"), "1");
  EXPECT_EQ(env.count("TANDEM_FSDP_SHARDING_STRATEGY"), 0u);

  // Flags win over the file for the sharding settings too.
  env = program_environment(resolve_launch(file("deepspeed"),
                                           {{"deepspeed_config.zero_stage", "1"},
                                            {"gradient_accumulation_steps", "8"},
                                            {"deepspeed_config.offload_param_device", "none"}},
                                           cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_ZERO_STAGE"), "1");
  EXPECT_EQ(env.at("TANDEM_GRADIENT_ACCUMULATION_STEPS"), "8");

  env = program_environment(resolve_launch(file("fsdp"), {}, cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_DISTRIBUTED_TYPE"), "FSDP");
  EXPECT_EQ(env.at("TANDEM_FSDP_SHARDING_STRATEGY"), "SHARD_GRAD_OP");
  EXPECT_EQ(env.at("TANDEM_FSDP_OFFLOAD_PARAMS"), "true");
  EXPECT_EQ(env.at("TANDEM_FSDP_AUTO_WRAP_POLICY"), "TRANSFORMER_BASED_WRAP");
  EXPECT_EQ(env.at("TANDEM_FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP"), "Block");
  EXPECT_EQ(env.at("TANDEM_FSDP_STATE_DICT_TYPE"), "SHARDED_STATE_DICT");
  EXPECT_EQ(env.at("TANDEM_MIXED_PRECISION"), "bf16");
  EXPECT_EQ(env.count("TANDEM_ZERO_STAGE"), 0u);
  // --use_fsdp without fsdp settings: the default strategy.
  env = program_environment(resolve_launch(
      LaunchConfig(), {{"distributed_type", "FSDP"}, {"num_processes", "2"}}, cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_FSDP_SHARDING_STRATEGY"), "FULL_SHARD");

  env = program_environment(resolve_launch(file("fp8"), {}, cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_MIXED_PRECISION"), "fp8");
  EXPECT_EQ(env.at("TANDEM_FP8_BACKEND"), "TE");
  EXPECT_EQ(env.at("TANDEM_FP8_FORMAT"), "E4M3");
  EXPECT_EQ(env.at("TANDEM_FP8_AMAX_HISTORY_LEN"), "1024");
  EXPECT_EQ(env.at("TANDEM_DISTRIBUTED_TYPE"), "NO");

  env = program_environment(resolve_launch(
      file("multi_gpu"), {{"debug", "true"}, {"downcast_bf16", "true"}}, gpu_machine(2)));
  EXPECT_EQ(env.at("TANDEM_GPU_IDS"), "0,1");
  EXPECT_EQ(env.at("CUDA_VISIBLE_DEVICES"), "0,1");
  EXPECT_EQ(env.at("TANDEM_DEBUG"), "1");
  EXPECT_EQ(env.at("TANDEM_DOWNCAST_BF16"), "1");
  EXPECT_EQ(env.count("TANDEM_USE_CPU"), 0u);
  env =
      program_environment(resolve_launch(file("multi_gpu"), {{"gpu_ids", "all"}}, gpu_machine(2)));
  EXPECT_EQ(env.at("TANDEM_GPU_IDS"), "all");
  EXPECT_EQ(env.count("CUDA_VISIBLE_DEVICES"), 0u);

  env = program_environment(resolve_launch(file("bf16_true"), {}, cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_MIXED_PRECISION"), "bf16-true");
  EXPECT_EQ(env.at("TANDEM_DISTRIBUTED_TYPE"), "MULTI_CPU");

  // --env wins over everything.
  auto opts =
      tandem::launch::to_launch_options(resolve_launch(file("bf16_true"), {}, cpu_machine()),
                                        {{"TANDEM_MIXED_PRECISION", "no"}, {"OTHER", "1"}});
  EXPECT_EQ(opts.extra_env().at("TANDEM_MIXED_PRECISION"), "no");
  EXPECT_EQ(opts.extra_env().at("OTHER"), "1");
  EXPECT_EQ(opts.num_processes(), 2);
  EXPECT_TRUE(opts.cpu());
}

TEST(LaunchResolve, LocalAddressOfLoopback) {
  EXPECT_EQ(tandem::launch::local_address_for("127.0.0.1", 29500), "127.0.0.1");
  EXPECT_EQ(tandem::launch::local_address_for("no-such-host.invalid", 1), "");
}

TEST(ForkSafety, EachHazardIsRefusedWithItsFix) {
  using tandem::launch::check_fork_safety;
  using tandem::launch::ForkSafety;
  EXPECT_NO_THROW(check_fork_safety(ForkSafety{}));
  auto e = message_of([] { check_fork_safety(ForkSafety{1, false, 1}); });
  EXPECT_TRUE(contains(e, "1 live tandem ProcessGroup")) << e;
  EXPECT_TRUE(contains(e, "inside the launched function")) << e;
  e = message_of([] { check_fork_safety(ForkSafety{0, true, 1}); });
  EXPECT_TRUE(contains(e, "CUDA is already initialized")) << e;
  e = message_of([] { check_fork_safety(ForkSafety{0, false, 5}); });
  EXPECT_TRUE(contains(e, "runs 5 threads")) << e;
  EXPECT_TRUE(contains(e, "before starting threads")) << e;
  // This test process: no group, no CUDA.
  auto here = tandem::launch::probe_fork_safety();
  EXPECT_EQ(here.live_process_groups, 0);
  EXPECT_FALSE(here.cuda_initialized);
  EXPECT_GE(here.threads, 1);
}

// fsdp_config.fsdp_activation_checkpointing (Accelerate's key) and --activation_checkpointing
// reach the ranks as TANDEM_ACTIVATION_CHECKPOINTING=true, under any distributed type; false or
// absent exports nothing.
TEST(LaunchResolve, ActivationCheckpointingKey) {
  auto env = program_environment(resolve_launch(file("fsdp"), {}, cpu_machine()));
  EXPECT_EQ(env.count("TANDEM_ACTIVATION_CHECKPOINTING"), 0u);  // the file says false
  EXPECT_EQ(env.at("TANDEM_FSDP_ACTIVATION_CHECKPOINTING"), "false");
  env = program_environment(resolve_launch(
      file("fsdp"), {{"fsdp_config.fsdp_activation_checkpointing", "true"}}, cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_ACTIVATION_CHECKPOINTING"), "true");

  auto c = parse_config(
      "distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n"
      "fsdp_config:\n  fsdp_activation_checkpointing: yes\n",
      "inline.yaml");
  EXPECT_EQ(c.fsdp_config.at("fsdp_activation_checkpointing"), "true");
  env = program_environment(resolve_launch(c, {}, cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_DISTRIBUTED_TYPE"), "MULTI_CPU");
  EXPECT_EQ(env.at("TANDEM_ACTIVATION_CHECKPOINTING"), "true");
  EXPECT_EQ(env.count("TANDEM_FSDP_ACTIVATION_CHECKPOINTING"), 0u);  // not an FSDP run

  // Without the key in any file, the flag's key alone.
  env = program_environment(resolve_launch(
      LaunchConfig(), {{"num_processes", "2"}, {"fsdp_config.fsdp_activation_checkpointing", "true"}},
      cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_ACTIVATION_CHECKPOINTING"), "true");

  // A value that is not a boolean is refused with the key's name.
  auto err = message_of([] {
    parse_config("fsdp_config:\n  fsdp_activation_checkpointing: sometimes\n", "bad.yaml");
  });
  EXPECT_TRUE(contains(err, "activation_checkpointing")) << err;
}

// parallelism_config.pp_schedule and pp_virtual_stages (tandem's own keys, --pp_schedule and
// --pp_virtual_stages) reach the ranks as TANDEM_PP_SCHEDULE (its canonical name) and
// TANDEM_PP_VIRTUAL_STAGES; absent, nothing is exported; an unknown schedule and a count below 1
// are refused naming the key.
TEST(LaunchResolve, PipelineScheduleKeys) {
  auto c = parse_config(
      "distributed_type: MULTI_CPU\nnum_processes: 4\nuse_cpu: true\n"
      "parallelism_config:\n  pp_size: 2\n  pp_schedule: interleaved_1f1b\n  pp_virtual_stages: 2\n",
      "inline.yaml");
  auto env = program_environment(resolve_launch(c, {}, cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_PP_SIZE"), "2");
  EXPECT_EQ(env.at("TANDEM_PP_SCHEDULE"), "Interleaved1F1B");
  EXPECT_EQ(env.at("TANDEM_PP_VIRTUAL_STAGES"), "2");
  env = program_environment(resolve_launch(
      LaunchConfig(),
      {{"num_processes", "2"}, {"parallelism_config.pp_size", "2"},
       {"parallelism_config.pp_schedule", "zero_bubble"}},
      cpu_machine()));
  EXPECT_EQ(env.at("TANDEM_PP_SCHEDULE"), "ZeroBubble");
  EXPECT_EQ(env.count("TANDEM_PP_VIRTUAL_STAGES"), 0u);
  env = program_environment(resolve_launch(
      LaunchConfig(), {{"num_processes", "2"}, {"parallelism_config.pp_size", "2"}}, cpu_machine()));
  EXPECT_EQ(env.count("TANDEM_PP_SCHEDULE"), 0u);
  auto err = message_of(
      [] { parse_config("parallelism_config:\n  pp_schedule: ZBVZeroBubble\n", "bad.yaml"); });
  EXPECT_TRUE(contains(err, "unknown pipeline schedule 'ZBVZeroBubble'")) << err;
  EXPECT_TRUE(contains(err, "bad.yaml")) << err;
  err =
      message_of([] { parse_config("parallelism_config:\n  pp_virtual_stages: 0\n", "bad.yaml"); });
  EXPECT_TRUE(contains(err, "pp_virtual_stages")) << err;
}
