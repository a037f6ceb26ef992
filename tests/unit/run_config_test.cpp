// The run configuration resolved once (config/run_config.h) and the one table of TANDEM_*
// variables (config/run_env.h): options over the environment, the words of booleans, errors
// that name the variable, its config key and its launch flag, and the launcher's environment
// read back to the configuration it came from. No processes.
#include <gtest/gtest.h>

#include <signal.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "../common/errors.h"
#include "tandem/accelerator.h"
#include "tandem/config/config.h"
#include "tandem/config/run_config.h"
#include "tandem/config/run_env.h"
#include "tandem/error.h"
#include "tandem/launch/launcher.h"
#include "tandem/launch/resolve.h"
#include "tandem/parallel/activation_checkpoint.h"

namespace {

using tandem::AcceleratorOptions;
using tandem::EnvMap;
using tandem::config::EnvReader;
using tandem::config::resolve_run_config;
using tandem::config::run_environment_table;
using tandem::testing::contains;
using tandem::testing::error_of;
namespace var = tandem::config::var;

const std::string kData = TANDEM_TEST_DATA;

// The variables a launcher gives rank 0 of a one-machine job of `n` processes.
EnvMap world(int n) {
  const auto w = std::to_string(n);
  return {{"RANK", "0"}, {"WORLD_SIZE", w}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", w},
          {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
}

EnvMap with(EnvMap env, const EnvMap& more) {
  for (const auto& [k, v] : more) env[k] = v;
  return env;
}

std::string resolve_error(const AcceleratorOptions& options, const EnvMap& env) {
  return error_of([&] { resolve_run_config(options, env); });
}

TEST(RunConfig, DefaultsWithoutEnvironment) {
  const auto c = resolve_run_config(AcceleratorOptions(), {});
  EXPECT_EQ(c.process.world_size, 1);
  EXPECT_EQ(c.distributed_type, tandem::parallel::DistributedType::kNo);
  EXPECT_FALSE(c.sharding);
  EXPECT_FALSE(c.cpu);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_FALSE(c.num_threads);
  EXPECT_FALSE(c.gradient_clipping);
  EXPECT_EQ(c.comm_hook, "none");
  EXPECT_EQ(c.mixed_precision, "no");
  EXPECT_FALSE(c.fp8);
  // Note [A topology always built]: every size resolved, each 1 on one process.
  EXPECT_EQ(c.mesh_shape.dims(), tandem::comm::MeshShape().resolve(1).dims());
  EXPECT_EQ(c.mesh_shape.to_string(), "pp 1 x dp_replicate 1 x dp_shard 1 x tp 1");
  EXPECT_FALSE(c.activation_checkpointing);
  EXPECT_EQ(c.timeline_dir, "");
  EXPECT_TRUE(c.from_environment.empty());
}

// What the program says in code stands; the environment fills in what it left unset.
TEST(RunConfig, OptionsBeatTheEnvironment) {
  const EnvMap env = {{var::kUseCpu, "1"},
                      {var::kGradientAccumulationSteps, "8"},
                      {var::kGradientClipping, "2.5"},
                      {var::kGradientAsBucketView, "true"},
                      {var::kMixedPrecision, "bf16"},
                      {var::kDowncastBf16, "yes"},
                      {var::kActivationCheckpointing, "on"},
                      {var::kTimeline, "/tmp/from-env"},
                      {var::kNumCpuThreads, "3"},
                      {var::kDistributedType, "DEEPSPEED"},
                      {var::kZeroStage, "3"}};
  const auto from_env = resolve_run_config(AcceleratorOptions(), env);
  EXPECT_TRUE(from_env.cpu);
  EXPECT_EQ(from_env.gradient_accumulation_steps, 8);
  EXPECT_EQ(from_env.gradient_clipping, 2.5);
  EXPECT_EQ(from_env.comm_hook, "none");
  EXPECT_TRUE(from_env.gradient_as_bucket_view);
  EXPECT_EQ(from_env.mixed_precision, "bf16");
  EXPECT_TRUE(from_env.downcast_bf16);
  EXPECT_TRUE(from_env.activation_checkpointing);
  EXPECT_EQ(from_env.timeline_dir, "/tmp/from-env");
  EXPECT_EQ(from_env.num_threads, 3);
  ASSERT_TRUE(from_env.sharding);
  EXPECT_EQ(from_env.sharding->stage(), 3);
  EXPECT_EQ(from_env.from_environment.at(var::kZeroStage), "3");

  const auto from_code = resolve_run_config(
      AcceleratorOptions()
          .cpu(false)
          .gradient_accumulation_steps(2)
          .gradient_clipping(0.5)
          .comm_hook("none")
          .gradient_as_bucket_view(false)
          .mixed_precision("no")
          .downcast_bf16(false)
          .activation_checkpointing(false)
          .timeline_dir("/tmp/from-code")
          .sharding(tandem::parallel::ShardingOptions().stage(1))
          .parallelism(tandem::comm::MeshShape().dp_shard_size(1)),
      env);
  EXPECT_FALSE(from_code.cpu);
  EXPECT_EQ(from_code.gradient_accumulation_steps, 2);
  EXPECT_EQ(from_code.gradient_clipping, 0.5);
  EXPECT_EQ(from_code.comm_hook, "none");
  EXPECT_FALSE(from_code.gradient_as_bucket_view);
  EXPECT_EQ(from_code.mixed_precision, "no");
  EXPECT_FALSE(from_code.downcast_bf16);
  EXPECT_FALSE(from_code.activation_checkpointing);
  EXPECT_EQ(from_code.timeline_dir, "/tmp/from-code");
  EXPECT_EQ(from_code.sharding->stage(), 1);
  // The distributed type has no option: it stays the launcher's.
  EXPECT_EQ(from_code.distributed_type, tandem::parallel::DistributedType::kDeepSpeed);
  // The comm hook: the environment's under data parallel, the options' before it; refused under
  // ZeRO, which reduces its gradients without it.
  const EnvMap hook = {{var::kDdpCommHook, "fp16"}};
  EXPECT_EQ(resolve_run_config(AcceleratorOptions(), hook).comm_hook, "fp16");
  EXPECT_EQ(resolve_run_config(AcceleratorOptions().comm_hook("none"), hook).comm_hook, "none");
  const auto e = resolve_error(AcceleratorOptions(), with(env, hook));
  EXPECT_NE(e.find("comm_hook fp16"), std::string::npos) << e;
  EXPECT_NE(e.find("ZeRO stage 3 reduce-scatters them itself"), std::string::npos) << e;
}

// Note [One vocabulary of booleans]: every boolean variable takes the same words.
TEST(RunConfig, EveryBooleanWord) {
  struct Case {
    const char* name;
    bool tandem::config::RunConfig::*field;
  };
  const std::vector<Case> cases = {{var::kUseCpu, &tandem::config::RunConfig::cpu},
                                   {var::kGradientAsBucketView,
                                    &tandem::config::RunConfig::gradient_as_bucket_view},
                                   {var::kDowncastBf16, &tandem::config::RunConfig::downcast_bf16},
                                   {var::kActivationCheckpointing,
                                    &tandem::config::RunConfig::activation_checkpointing},
                                   {var::kDebug, &tandem::config::RunConfig::debug}};
  const std::vector<std::pair<std::string, bool>> words = {
      {"true", true},   {"TRUE", true},   {"yes", true},  {"Yes", true},   {"on", true},
      {"ON", true},     {"y", true},      {"1", true},    {" true ", true}, {"false", false},
      {"False", false}, {"no", false},    {"NO", false},  {"off", false},  {"Off", false},
      {"n", false},     {"0", false},     {" off\t", false}};
  for (const auto& c : cases) {
    for (const auto& [word, value] : words) {
      const auto run = resolve_run_config(AcceleratorOptions(), {{c.name, word}});
      EXPECT_EQ(run.*(c.field), value) << c.name << "=" << word;
    }
    const auto e = resolve_error(AcceleratorOptions(), {{c.name, "maybe"}});
    EXPECT_TRUE(contains(e, c.name)) << e;
    EXPECT_TRUE(contains(e, "got 'maybe', expected true or false")) << e;
    const auto* row = tandem::config::find_env_var(c.name);
    ASSERT_NE(row, nullptr) << c.name;
    EXPECT_TRUE(contains(e, row->key)) << e;
    EXPECT_TRUE(contains(e, row->flag)) << e;
  }
  // Booleans inside the sharding settings too.
  for (const auto& [word, value] : words) {
    auto s = resolve_run_config(AcceleratorOptions(), {{var::kDistributedType, "FSDP"},
                                                       {"TANDEM_FSDP_OFFLOAD_PARAMS", word}})
                 .sharding;
    EXPECT_EQ(s->offload_optimizer(), value) << word;
  }
}

// An error names the variable, its value, the config key and the launch flag that set it.
TEST(RunConfig, ErrorsNameTheVariableTheKeyAndTheFlag) {
  auto e = resolve_error(AcceleratorOptions(), {{var::kGradientAccumulationSteps, "x"}});
  EXPECT_TRUE(contains(e, "[rank 0/1] TANDEM_GRADIENT_ACCUMULATION_STEPS='x' (config "
                          "gradient_accumulation_steps, tandem launch "
                          "--gradient_accumulation_steps) must be a positive integer"))
      << e;
  e = resolve_error(AcceleratorOptions(), {{var::kGradientAccumulationSteps, "0"}});
  EXPECT_TRUE(contains(e, "must be a positive integer")) << e;
  e = resolve_error(AcceleratorOptions(), {{var::kGradientClipping, "lots"}});
  EXPECT_TRUE(contains(e, "TANDEM_GRADIENT_CLIPPING='lots' (config "
                          "deepspeed_config.gradient_clipping, tandem launch --gradient_clipping) "
                          "must be a number >= 0"))
      << e;
  e = resolve_error(AcceleratorOptions(), {{var::kNumCpuThreads, "-2"}});
  EXPECT_TRUE(contains(e, "TANDEM_NUM_CPU_THREADS='-2' (tandem launch "
                          "--num_cpu_threads_per_process) must be a positive integer"))
      << e;
  e = resolve_error(AcceleratorOptions(), {{var::kDistributedType, "DEEPSPEED"}, {var::kZeroStage, "4"}});
  EXPECT_TRUE(contains(e, "TANDEM_ZERO_STAGE='4' (config deepspeed_config.zero_stage, tandem "
                          "launch --zero_stage): expected 0, 1, 2 or 3"))
      << e;
  e = resolve_error(AcceleratorOptions(),
                    {{var::kDistributedType, "DEEPSPEED"}, {var::kOffloadOptimizerDevice, "nvme"}});
  EXPECT_TRUE(contains(e, "--offload_optimizer_device")) << e;
  EXPECT_TRUE(contains(e, "set offload_optimizer_nvme_path")) << e;
  e = resolve_error(AcceleratorOptions(), {{var::kDistributedType, "DEEPSPEED"},
                                           {var::kOffloadParamDevice, "nvme"}});
  EXPECT_TRUE(contains(e, "parameter offload to NVMe is not implemented")) << e;
  e = resolve_error(AcceleratorOptions(), {{var::kDistributedType, "DEEPSPEED"},
                                           {var::kOffloadOptimizerNvmePath, "/tmp/x"}});
  EXPECT_TRUE(contains(e, "offload_optimizer_device is not nvme")) << e;
  auto nvme = resolve_run_config(AcceleratorOptions(), {{var::kDistributedType, "DEEPSPEED"},
                                                        {var::kOffloadOptimizerDevice, "nvme"},
                                                        {var::kOffloadOptimizerNvmePath, "/tmp/x"}});
  EXPECT_EQ(nvme.sharding->nvme_path(), "/tmp/x");
  e = resolve_error(AcceleratorOptions(),
                    {{var::kDistributedType, "FSDP"}, {"TANDEM_FSDP_STATE_DICT_TYPE", "LOCAL"}});
  EXPECT_TRUE(contains(e, "(config fsdp_config.fsdp_state_dict_type, tandem launch "
                          "--fsdp_state_dict_type)"))
      << e;
  e = resolve_error(AcceleratorOptions(),
                    {{var::kDistributedType, "FSDP"}, {"TANDEM_FSDP_NOT_A_KEY", "1"}});
  EXPECT_TRUE(contains(e, "fsdp_not_a_key is not one tandem knows")) << e;
  e = resolve_error(AcceleratorOptions(), {{var::kTpSize, "two"}});
  EXPECT_TRUE(contains(e, "TANDEM_TP_SIZE=two is not a mesh size")) << e;
  EXPECT_TRUE(contains(e, "--tp_size")) << e;
  e = resolve_error(AcceleratorOptions(), {{var::kMixedPrecision, "fp8"},
                                           {"TANDEM_FP8_MARGIN", "wide"}});
  EXPECT_TRUE(contains(e, "TANDEM_FP8_MARGIN='wide' (config fp8_config.margin) must be an integer"))
      << e;
  e = resolve_error(AcceleratorOptions(), {{var::kDistributedType, "WARP_DRIVE"}});
  EXPECT_TRUE(contains(e, "TANDEM_DISTRIBUTED_TYPE (config distributed_type")) << e;
  EXPECT_TRUE(contains(e, "expected one of")) << e;
  e = resolve_error(AcceleratorOptions(), {{var::kDistributedType, "MEGATRON_LM"}});
  EXPECT_TRUE(contains(e, "does not implement")) << e;
  e = resolve_error(AcceleratorOptions(), {{var::kDdpCommHook, "int4"}});
  EXPECT_TRUE(contains(e, "comm_hook: ")) << e;
  // Errors of options given in code keep their own words.
  e = resolve_error(AcceleratorOptions().gradient_accumulation_steps(0), {});
  EXPECT_TRUE(contains(e, "gradient_accumulation_steps is 0; it must be at least 1")) << e;
  e = resolve_error(AcceleratorOptions().bucket_cap_mb(0), {});
  EXPECT_TRUE(contains(e, "bucket_cap_mb and first_bucket_cap_mb must be positive")) << e;
  // The rank is named once ProcessState is known.
  e = resolve_error(AcceleratorOptions(),
                    with(world(4), {{"RANK", "2"}, {"LOCAL_RANK", "2"}, {var::kUseCpu, "maybe"}}));
  EXPECT_TRUE(contains(e, "[rank 2/4] TANDEM_USE_CPU")) << e;
}

// The mesh shape comes resolved against the job.
TEST(RunConfig, MeshShapeIsResolvedAgainstTheWorld) {
  const EnvMap env = with(world(8), {{var::kTpSize, "2"}, {var::kPpSize, "2"}});
  const auto c = resolve_run_config(AcceleratorOptions(), env);
  EXPECT_EQ(c.mesh_shape.tp, 2);
  EXPECT_EQ(c.mesh_shape.pp, 2);
  EXPECT_EQ(c.mesh_shape.dp_replicate * c.mesh_shape.dp_shard, 2);
  const auto e = resolve_error(AcceleratorOptions(), with(world(3), {{var::kTpSize, "2"}}));
  EXPECT_TRUE(contains(e, "[rank 0/3] parallelism: ")) << e;
}

// Note [A topology always built]: the data-parallel sizes follow the strategy. A sharded run
// shards over every data-parallel rank; plain data parallel replicates; a size that no strategy
// would honour is refused, naming it and the fix.
TEST(RunConfig, DataParallelSizesFollowTheStrategy) {
  const auto zero3 = AcceleratorOptions().sharding(tandem::parallel::ShardingOptions().stage(3));
  auto c = resolve_run_config(zero3, world(4));
  EXPECT_EQ(c.mesh_shape.dp_shard, 4);
  EXPECT_EQ(c.mesh_shape.dp_replicate, 1);
  c = resolve_run_config(zero3, with(world(4), {{var::kTpSize, "2"}}));
  EXPECT_EQ(c.mesh_shape.dp_shard, 2);
  EXPECT_EQ(c.mesh_shape.dp_replicate, 1);
  EXPECT_EQ(c.mesh_shape.tp, 2);
  c = resolve_run_config(AcceleratorOptions(), world(4));
  EXPECT_EQ(c.mesh_shape.dp_replicate, 4);
  EXPECT_EQ(c.mesh_shape.dp_shard, 1);
  // NO_SHARD (stage 0) is plain data parallel.
  c = resolve_run_config(AcceleratorOptions().sharding(tandem::parallel::ShardingOptions().stage(0)),
                         world(4));
  EXPECT_EQ(c.mesh_shape.dp_replicate, 4);
  // dp_shard without a ZeRO stage would train as plain data parallel: refused.
  auto e = resolve_error(AcceleratorOptions(), with(world(4), {{var::kDpShardSize, "2"}}));
  EXPECT_TRUE(contains(e, "dp_shard_size 2 (--dp_shard_size")) << e;
  EXPECT_TRUE(contains(e, "--use_fsdp")) << e;
  // dp_replicate with a ZeRO stage is hybrid sharding: shards over dp_shard.
  c = resolve_run_config(zero3, with(world(4), {{var::kDpReplicateSize, "2"}}));
  EXPECT_EQ(c.mesh_shape.dp_replicate, 2);
  EXPECT_EQ(c.mesh_shape.dp_shard, 2);
  // HYBRID_SHARD: one replica per machine (2 machines of 2 ranks), FULL_SHARD on one machine.
  const EnvMap fsdp = {{var::kDistributedType, "FSDP"},
                       {"TANDEM_FSDP_SHARDING_STRATEGY", "HYBRID_SHARD"}};
  auto two_machines = with(with(world(4), fsdp), {{"LOCAL_WORLD_SIZE", "2"}, {var::kNumMachines, "2"}});
  c = resolve_run_config(AcceleratorOptions(), two_machines);
  EXPECT_EQ(c.sharding->stage(), 3);
  EXPECT_TRUE(c.sharding->hybrid());
  EXPECT_EQ(c.mesh_shape.dp_replicate, 2);
  EXPECT_EQ(c.mesh_shape.dp_shard, 2);
  c = resolve_run_config(AcceleratorOptions(), with(world(4), fsdp));
  EXPECT_EQ(c.mesh_shape.dp_replicate, 1);
  EXPECT_EQ(c.mesh_shape.dp_shard, 4);
  // Both set to what the strategy does: accepted.
  c = resolve_run_config(zero3, with(world(4), {{var::kDpShardSize, "4"}}));
  EXPECT_EQ(c.mesh_shape.dp_shard, 4);
}

// The context a variable is read in (the settings of its section).
EnvMap context_of(const std::string& name) {
  // A dp_replicate size of 2 leaves no dp_shard above 1 (refused without sharding) on 2 ranks.
  EnvMap env = world(name == var::kDpReplicateSize ? 2 : 8);
  if (name.rfind(var::kFsdpPrefix, 0) == 0) env[var::kDistributedType] = "FSDP";
  if (name.rfind(var::kFp8Prefix, 0) == 0) env[var::kMixedPrecision] = "fp8";
  for (const char* ds : {var::kZeroStage, var::kOffloadOptimizerDevice, var::kOffloadParamDevice,
                         var::kZero3InitFlag, var::kZero3Save16bitModel, var::kReduceScatter})
    if (name == ds) env[var::kDistributedType] = "DEEPSPEED";
  if (name == var::kPpSchedule || name == var::kPpVirtualStages) env[var::kPpSize] = "2";
  if (name == var::kCpComm) env[var::kCpSize] = "2";
  if (name == var::kOffloadOptimizerNvmePath) {
    env[var::kDistributedType] = "DEEPSPEED";
    env[var::kOffloadOptimizerDevice] = "nvme";
  }
  return env;
}

// Note [One table of variables]: every row the run configuration owns is read by it.
TEST(RunEnvironmentTable, EveryRowOfTheRunConfigurationIsRead) {
  std::set<std::string> names;
  for (const auto& row : run_environment_table()) {
    EXPECT_TRUE(names.insert(row.name).second) << "two rows for " << row.name;
    EXPECT_EQ(std::string(row.name).rfind("TANDEM_", 0), 0u) << row.name;
    if (row.reader != EnvReader::kRunConfig) continue;
    EnvMap env = context_of(row.name);
    env[row.name] = row.example;
    tandem::config::RunConfig c;
    ASSERT_NO_THROW(c = resolve_run_config(AcceleratorOptions(), env))
        << row.name << "=" << row.example << ": " << resolve_error(AcceleratorOptions(), env);
    EXPECT_EQ(c.from_environment.count(row.name), 1u)
        << row.name << " has a row read by the run configuration, but resolve_run_config never "
        << "read it";
  }
  // The rows of other readers are read where they say.
  const auto state = tandem::ProcessState::from_env({{"RANK", "0"}, {"WORLD_SIZE", "1"},
                                                     {var::kLauncher, "1"},
                                                     {var::kErrorFile, "/tmp/e"},
                                                     {var::kHeartbeatFile, "/tmp/b"},
                                                     {var::kHeartbeatIntervalS, "0.5"},
                                                     {var::kLocalAddr, "10.0.0.2"}});
  EXPECT_EQ(state.launcher, tandem::LauncherKind::kTandem);
  EXPECT_EQ(state.error_file, "/tmp/e");
  EXPECT_EQ(state.heartbeat_file, "/tmp/b");
  EXPECT_EQ(state.heartbeat_interval_s, 0.5);
  EXPECT_THROW(tandem::ProcessState::from_env({{"RANK", "0"}, {"WORLD_SIZE", "1"},
                                               {var::kHeartbeatIntervalS, "0"}}),
               tandem::Refused);
  EXPECT_EQ(state.local_addr, "10.0.0.2");
  const auto f = tandem::config::fault_injection_from_env(
      {{var::kCheckpointCrash, "after_files"}, {var::kCheckpointCrashRank, "1"}});
  EXPECT_EQ(f.checkpoint_crash, "after_files");
  EXPECT_EQ(f.checkpoint_crash_rank, 1);
  EXPECT_EQ(tandem::config::fault_injection_from_env({{var::kCheckpointCrash, "mid_files"}})
                .checkpoint_crash,
            "mid_files");
  // A point no save has would arm nothing: refused, naming the points.
  try {
    tandem::config::fault_injection_from_env({{var::kCheckpointCrash, "after_file"}});
    ADD_FAILURE() << "TANDEM_CHECKPOINT_CRASH=after_file was accepted";
  } catch (const tandem::Refused& e) {
    EXPECT_NE(std::string(e.what()).find("mid_files, after_files, before_rename or after_rename"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(tandem::config::default_config_path({{var::kConfigHome, "/x"}}),
            "/x/default_config.yaml");
}

// Every row is documented where users look for the variables.
TEST(RunEnvironmentTable, EveryRowIsDocumented) {
  std::ifstream in(kData + "/../../docs/launching.md");
  ASSERT_TRUE(in) << "docs/launching.md";
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string doc = ss.str();
  for (const auto& row : run_environment_table())
    EXPECT_TRUE(contains(doc, std::string("`") + row.name + "`")) << row.name;
}

tandem::config::LaunchConfig config_file(const std::string& name) {
  return tandem::config::load_config_file(kData + "/configs/" + name + ".yaml");
}

// The environment of rank 0 as `tandem launch` writes it for `config` and `flags`.
EnvMap launched_environment(const tandem::config::LaunchConfig& config,
                            const tandem::launch::FlagValues& flags) {
  const auto resolved = tandem::launch::resolve_launch(config, flags, tandem::launch::MachineInfo{});
  auto options = tandem::launch::to_launch_options(resolved, {});
  const auto plan = tandem::launch::make_plan(options, {"./train"}, {});
  return plan.at(0).env;
}

const std::vector<std::pair<std::string, tandem::launch::FlagValues>>& launches() {
  static const std::vector<std::pair<std::string, tandem::launch::FlagValues>> v = {
      {"deepspeed", {}},
      {"fsdp", {{"fsdp_config.fsdp_activation_checkpointing", "true"}}},
      {"fp8", {{"use_cpu", "true"}}},
      {"single_process",
       {{"num_processes", "4"},
        {"use_cpu", "true"},
        {"gradient_accumulation_steps", "3"},
        {"ddp_comm_hook", "bf16"},
        {"gradient_as_bucket_view", "true"},
        {"deepspeed_config.gradient_clipping", "0.5"},
        {"debug", "true"},
        {"parallelism_config.parallelism_config_tp_size", "2"},
        {"enable_cpu_affinity", "true"}}},
  };
  return v;
}

// Every name the launcher writes has a row, marked as written.
TEST(RunEnvironmentTable, EveryNameTheLauncherWritesHasARow) {
  for (const auto& [file, flags] : launches()) {
    EnvMap env;
    try {
      env = launched_environment(config_file(file), flags);
    } catch (const std::invalid_argument& e) {
      // --enable_cpu_affinity needs the cores; a small machine refuses it.
      if (contains(e.what(), "--enable_cpu_affinity")) continue;
      throw;
    }
    for (const auto& [name, value] : env) {
      if (name.rfind("TANDEM_", 0) != 0) continue;
      const auto* row = tandem::config::find_env_var(name);
      ASSERT_NE(row, nullptr) << file << ": tandem launch writes " << name
                              << ", which has no row in config/run_env.h";
      EXPECT_TRUE(row->written) << name;
    }
  }
}

// The launcher's environment for a configuration resolves to the run that configuration implies.
TEST(RunConfig, LaunchedEnvironmentResolvesToTheConfiguration) {
  for (const auto& [file, flags] : launches()) {
    EnvMap env;
    try {
      env = launched_environment(config_file(file), flags);
    } catch (const std::invalid_argument& e) {
      if (contains(e.what(), "--enable_cpu_affinity")) {
        auto fewer = flags;
        fewer.erase(std::remove_if(fewer.begin(), fewer.end(),
                                   [](const auto& f) { return f.first == "enable_cpu_affinity"; }),
                    fewer.end());
        env = launched_environment(config_file(file), fewer);
      } else {
        throw;
      }
    }
    const auto resolved =
        tandem::launch::resolve_launch(config_file(file), flags, tandem::launch::MachineInfo{});
    const auto& c = resolved.config;
    const auto run = resolve_run_config(AcceleratorOptions(), env);
    SCOPED_TRACE(file);
    EXPECT_EQ(run.process.world_size, c.num_processes);
    EXPECT_EQ(run.process.launcher, tandem::LauncherKind::kTandem);
    EXPECT_EQ(tandem::parallel::to_string(run.distributed_type), resolved.distributed_type);
    EXPECT_EQ(run.mixed_precision, c.mixed_precision);
    EXPECT_EQ(run.downcast_bf16, c.downcast_bf16);
    EXPECT_EQ(run.cpu, c.use_cpu);
    EXPECT_EQ(run.gradient_accumulation_steps, c.gradient_accumulation_steps);
    EXPECT_EQ(run.comm_hook, c.ddp_comm_hook);
    EXPECT_EQ(run.gradient_as_bucket_view, c.gradient_as_bucket_view);
    EXPECT_EQ(run.debug, c.debug);
    EXPECT_EQ(run.num_machines, c.num_machines);
    ASSERT_TRUE(run.num_threads);
    EXPECT_EQ(std::to_string(*run.num_threads), env.at(var::kNumCpuThreads));
    if (c.deepspeed_config.count("gradient_clipping"))
      EXPECT_EQ(run.gradient_clipping, std::stod(c.deepspeed_config.at("gradient_clipping")));
    else
      EXPECT_FALSE(run.gradient_clipping);
    auto ac = c.fsdp_config.find("fsdp_activation_checkpointing");
    EXPECT_EQ(run.activation_checkpointing, ac != c.fsdp_config.end() && ac->second == "true");
    const auto shape = tandem::config::mesh_shape(c);
    const auto want = shape.resolve(c.num_processes, c.num_processes / c.num_machines,
                                    run.sharding && run.sharding->stage() > 0);
    EXPECT_EQ(run.mesh_shape.dims(), want.dims());
    // The sharding the config names.
    if (resolved.distributed_type == "DEEPSPEED") {
      ASSERT_TRUE(run.sharding);
      EXPECT_EQ(std::to_string(run.sharding->stage()), c.deepspeed_config.at("zero_stage"));
      EXPECT_EQ(run.sharding->offload_optimizer(),
                c.deepspeed_config.at("offload_optimizer_device") == "cpu");
      EXPECT_EQ(run.sharding->offload_params(),
                c.deepspeed_config.at("offload_param_device") == "cpu");
      EXPECT_EQ(run.zero3_save_16bit_model, c.deepspeed_config.at("zero3_save_16bit_model") == "true");
      EXPECT_EQ(run.zero3_init_flag, c.deepspeed_config.at("zero3_init_flag") == "true");
    } else if (resolved.distributed_type == "FSDP") {
      ASSERT_TRUE(run.sharding);
      EXPECT_EQ(run.sharding->stage(),
                c.fsdp_config.at("fsdp_sharding_strategy") == "SHARD_GRAD_OP" ? 2 : 3);
      EXPECT_EQ(run.sharding->state_dict_type(), c.fsdp_config.at("fsdp_state_dict_type"));
      EXPECT_EQ(run.sharding->offload_optimizer(), c.fsdp_config.at("fsdp_offload_params") == "true");
      EXPECT_EQ(run.sharding->transformer_layer_cls_to_wrap(),
                std::vector<std::string>{c.fsdp_config.at("fsdp_transformer_layer_cls_to_wrap")});
    } else {
      EXPECT_FALSE(run.sharding);
    }
    if (c.mixed_precision == "fp8") {
      ASSERT_TRUE(run.fp8);
      EXPECT_EQ(run.fp8->fp8_format(), c.fp8_config.at("fp8_format"));
      EXPECT_EQ(std::to_string(run.fp8->amax_history_len()), c.fp8_config.at("amax_history_len"));
      EXPECT_EQ(std::to_string(run.fp8->margin()), c.fp8_config.at("margin"));
      EXPECT_EQ(std::to_string(run.fp8->interval()), c.fp8_config.at("interval"));
    }
    // Every TANDEM_* variable the launcher wrote that the run configuration owns was read.
    for (const auto& [name, value] : env) {
      const auto* row = tandem::config::find_env_var(name);
      if (row && row->reader == EnvReader::kRunConfig) {
        EXPECT_EQ(run.from_environment.count(name), 1u) << name << " was written and not read";
      }
    }
    // describe() names every setting.
    const auto text = tandem::config::describe(run);
    EXPECT_TRUE(contains(text, "mixed_precision: " + c.mixed_precision)) << text;
  }
}

// The readers that predate RunConfig give the same answers through it.
TEST(RunConfig, ZeroWithAPipelineIsRefusedBeforeTheJobStarts) {
  const EnvMap env = {{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                      {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"},
                      {var::kDistributedType, "DEEPSPEED"}, {"TANDEM_ZERO_STAGE", "1"},
                      {var::kPpSize, "2"}};
  try {
    resolve_run_config(AcceleratorOptions(), env);
    ADD_FAILURE() << "ZeRO stage 1 with pp_size 2 was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("[rank 1/2] ZeRO stage 1 does not combine with pipeline parallel"),
              std::string::npos) << what;
  }
  // The same layout without ZeRO, and ZeRO without the pipeline, resolve.
  EnvMap plain = env;
  plain[var::kDistributedType] = "MULTI_CPU";
  EXPECT_EQ(resolve_run_config(AcceleratorOptions(), plain).mesh_shape.pp, 2);
  EnvMap zero = env;
  zero.erase(var::kPpSize);
  EXPECT_EQ(resolve_run_config(AcceleratorOptions(), zero).sharding->stage(), 1);
}

TEST(RunConfig, ReadersAgreeWithTheRunConfiguration) {
  const EnvMap env = {{var::kDistributedType, "FSDP"},
                      {"TANDEM_FSDP_SHARDING_STRATEGY", "2"},
                      {var::kTpSize, "2"},
                      {var::kActivationCheckpointing, "yes"},
                      {"TANDEM_FP8_MARGIN", "3"},
                      {var::kTimeline, "/tmp/t"}};
  EnvMap job = env;  // the same variables in a job of two ranks, as tp 2 needs
  job["WORLD_SIZE"] = "2";
  job["RANK"] = "0";
  job["MASTER_ADDR"] = "127.0.0.1";
  job["MASTER_PORT"] = "29500";
  job["LOCAL_WORLD_SIZE"] = "2";
  const auto run = resolve_run_config(tandem::AcceleratorOptions(), job);
  EXPECT_EQ(tandem::config::sharding_from_env(env)->stage(), 2);
  EXPECT_EQ(run.sharding->stage(), 2);
  EXPECT_EQ(tandem::config::mesh_shape_from_env(env).tp, 2);
  EXPECT_TRUE(tandem::config::activation_checkpointing_from_env(env));
  EXPECT_TRUE(run.activation_checkpointing);
  EXPECT_EQ(tandem::config::fp8_options_from_env(env).margin(), 3);
  EXPECT_EQ(tandem::config::timeline_dir_from_env(env), "/tmp/t");
  EXPECT_EQ(run.timeline_dir, "/tmp/t");
  // Set and empty: off, whatever the FSDP key says (as before).
  EXPECT_FALSE(tandem::config::activation_checkpointing_from_env(
      {{var::kActivationCheckpointing, ""}, {"TANDEM_FSDP_ACTIVATION_CHECKPOINTING", "true"}}));
}

}  // namespace

// Note [Preemption]: a program that checkpoints (periodically, or resumes by itself) saves on
// preemption unless it says otherwise; the cluster's signal comes from the launcher's variable.
TEST(RunConfig, CheckpointOnPreemption) {
  EXPECT_FALSE(resolve_run_config(AcceleratorOptions(), {}).checkpoint_on_preemption);
  EXPECT_TRUE(resolve_run_config(AcceleratorOptions().auto_resume(true), {}).checkpoint_on_preemption);
  EXPECT_TRUE(resolve_run_config(AcceleratorOptions().checkpoint_every_steps(100), {})
                  .checkpoint_on_preemption);
  EXPECT_FALSE(resolve_run_config(
                   AcceleratorOptions().checkpoint_every_steps(100).checkpoint_on_preemption(false), {})
                   .checkpoint_on_preemption);
  EXPECT_TRUE(resolve_run_config(AcceleratorOptions().checkpoint_on_preemption(true), {})
                  .checkpoint_on_preemption);
  auto e = resolve_error(
      AcceleratorOptions().checkpoint_on_preemption(true).automatic_checkpoint_naming(false), {});
  EXPECT_NE(e.find("checkpoint_on_preemption is true and automatic_checkpoint_naming is false"),
            std::string::npos)
      << e;
  const auto c = resolve_run_config(AcceleratorOptions(), {{var::kPreemptionSignal, "USR1"}});
  EXPECT_EQ(c.preemption_signal, SIGUSR1);
  EXPECT_NE(describe(c).find("checkpoint_on_preemption: false"), std::string::npos);
  e = resolve_error(AcceleratorOptions(), {{var::kPreemptionSignal, "nine"}});
  EXPECT_NE(e.find("TANDEM_PREEMPTION_SIGNAL (tandem launch --preemption_signal)=nine: expected "
                   "a signal"),
            std::string::npos)
      << e;
}
