// Config files with Accelerate's keys: parsing, normalization, every error, YAML round trip.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "tandem/config/config.h"
#include "../common/errors.h"

using tandem::config::LaunchConfig;
using tandem::config::load_config_file;
using tandem::config::parse_config;
using tandem::config::Source;
using tandem::config::to_yaml;
using tandem::config::validate;

namespace {

using tandem::testing::error_of;
using tandem::testing::contains;

const std::string kData = TANDEM_CONFIG_DATA;

std::string parse_error(const std::string& yaml) {
  return error_of([&] { parse_config(yaml, "test.yaml"); });
}

}  // namespace

TEST(ConfigFile, EveryShippedConfigParsesAndValidates) {
  for (const char* name : {"single_process", "multi_cpu", "multi_gpu", "multi_machine", "fsdp",
                           "deepspeed", "fp8", "bf16_true", "tpu_ignored"}) {
    SCOPED_TRACE(name);
    auto cfg = load_config_file(kData + "/" + name + ".yaml");
    EXPECT_NO_THROW(validate(cfg));
  }
}

TEST(ConfigFile, ValuesAreNormalized) {
  auto fsdp = load_config_file(kData + "/fsdp.yaml");
  EXPECT_EQ(fsdp.distributed_type, "FSDP");
  EXPECT_EQ(fsdp.mixed_precision, "bf16");
  EXPECT_EQ(fsdp.fsdp_config.at("fsdp_sharding_strategy"), "SHARD_GRAD_OP");  // was 2
  EXPECT_EQ(fsdp.fsdp_config.at("fsdp_offload_params"), "true");
  EXPECT_EQ(fsdp.fsdp_config.at("fsdp_transformer_layer_cls_to_wrap"), "Block");
  EXPECT_TRUE(fsdp.ignored.empty());  // tpu_env: [] and friends are not worth a warning

  auto ds = load_config_file(kData + "/deepspeed.yaml");
  EXPECT_EQ(ds.gradient_accumulation_steps, 4);
  EXPECT_EQ(ds.deepspeed_config.at("zero_stage"), "3");
  EXPECT_EQ(ds.deepspeed_config.at("offload_param_device"), "cpu");
  EXPECT_EQ(ds.deepspeed_config.at("zero3_init_flag"), "true");
  EXPECT_EQ(ds.sources.at("gradient_accumulation_steps"), Source::kConfigFile);

  auto single = load_config_file(kData + "/single_process.yaml");
  EXPECT_EQ(single.distributed_type, "NO");
  EXPECT_EQ(single.mixed_precision, "no");
  EXPECT_TRUE(single.use_cpu);
  EXPECT_FALSE(single.downcast_bf16);  // 'no' as Accelerate writes it

  auto fp8 = load_config_file(kData + "/fp8.yaml");
  EXPECT_EQ(fp8.fp8_config.at("override_linear_precision"), "false,false,false");
  EXPECT_EQ(fp8.fp8_config.at("fp8_format"), "E4M3");

  auto multi = load_config_file(kData + "/multi_machine.yaml");
  EXPECT_EQ(multi.rdzv_backend, "c10d");
  EXPECT_EQ(multi.main_process_ip, "10.0.0.1");
  EXPECT_FALSE(multi.same_network);
}

TEST(ConfigFile, NamesAndNumbersOfShardingStrategies) {
  const char* names[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                         "HYBRID_SHARD_ZERO2"};
  for (int i = 1; i <= 5; ++i) {
    auto c = parse_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: " +
                          std::to_string(i) + "\n");
    EXPECT_EQ(c.fsdp_config.at("fsdp_sharding_strategy"), names[i - 1]);
    auto by_name = parse_config(std::string("distributed_type: FSDP\nfsdp_config:\n  "
                                            "sharding_strategy: ") +
                                names[i - 1] + "\n");
    EXPECT_EQ(by_name.fsdp_config.at("fsdp_sharding_strategy"), names[i - 1]);  // prefix added
  }
  auto e = parse_error("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 7\n");
  EXPECT_TRUE(contains(e, "fsdp_config.fsdp_sharding_strategy")) << e;
  EXPECT_TRUE(contains(e, "'7'")) << e;
  EXPECT_TRUE(contains(e, "1 FULL_SHARD")) << e;
}

TEST(ConfigFile, IgnoredSettingsGiveOneWarningNamingThem) {
  auto c = load_config_file(kData + "/tpu_ignored.yaml");
  std::string w = tandem::config::ignored_warning(c);
  EXPECT_TRUE(contains(w, "tpu_name")) << w;
  EXPECT_TRUE(contains(w, "tpu_zone")) << w;
  EXPECT_TRUE(contains(w, "command_file")) << w;
  EXPECT_TRUE(contains(w, "ignored")) << w;
  EXPECT_FALSE(contains(w, "megatron_lm_config")) << w;  // empty: nothing to ignore
  EXPECT_FALSE(contains(w, "\n")) << "one warning, one line: " << w;

  auto sm = parse_config(
      "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: DATA_PARALLEL\n"
      "ec2_instance_type: ml.p3.2xlarge\niam_role_name: role\nregion: us-east-1\n"
      "dynamo_config:\n  dynamo_backend: INDUCTOR\nmixed_precision: fp16\n");
  w = tandem::config::ignored_warning(sm);
  for (const char* k : {"AMAZON_SAGEMAKER", "DATA_PARALLEL", "ec2_instance_type", "iam_role_name",
                        "region", "dynamo_config"})
    EXPECT_TRUE(contains(w, k)) << k << " in " << w;

  auto others = parse_config(
      "distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  "
      "megatron_lm_tp_degree: 2\nipex_config:\n  ipex: true\n"
      "mpirun_config:\n  mpirun_hostfile: /h\nmain_training_function: go\n");
  w = tandem::config::ignored_warning(others);
  for (const char* k : {"megatron_lm_config", "ipex_config", "mpirun_config",
                        "main_training_function"})
    EXPECT_TRUE(contains(w, k)) << k << " in " << w;
  // MEGATRON_LM is a strategy: refused at launch (check_strategy_available), never "ignored".
  EXPECT_FALSE(contains(w, "MEGATRON_LM")) << w;
  EXPECT_EQ(tandem::config::ignored_warning(parse_config("distributed_type: NO\n")), "");
}

TEST(ConfigFile, UnknownKeysAreOneErrorListingEveryKey) {
  auto e = parse_error(
      "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\ninvalid_key: x\n"
      "another_invalid_key: y\nnum_processes: 1\n");
  EXPECT_TRUE(contains(e, "another_invalid_key, invalid_key")) << e;
  EXPECT_TRUE(contains(e, "Accelerate does not know")) << e;
  EXPECT_TRUE(contains(e, "test.yaml")) << e;
  // A top-level key Accelerate keeps elsewhere is unknown at the top.
  e = parse_error("distributed_type: NO\ngradient_accumulation_steps: 2\n");
  EXPECT_TRUE(contains(e, "gradient_accumulation_steps")) << e;
}

TEST(ConfigFile, WrongValuesNameKeyValueAndWhatIsAllowed) {
  struct Case {
    std::string yaml, key, value, allowed;
  };
  std::vector<Case> cases = {
      {"num_processes: 0", "num_processes", "'0'", "at least 1"},
      {"num_processes: many", "num_processes", "'many'", "at least 1"},
      {"num_machines: 0", "num_machines", "'0'", "at least 1"},
      {"mixed_precision: fp32", "mixed_precision", "'fp32'", "no, fp16, bf16, fp8, bf16-true"},
      {"main_process_port: 70000", "main_process_port", "'70000'", "1-65535"},
      {"main_process_port: -1", "main_process_port", "'-1'", "1-65535"},
      {"gpu_ids: 0,x", "gpu_ids", "'x'", "device indices"},
      {"gpu_ids: cuda:0", "gpu_ids", "'cuda:0'", "device indices"},
      {"gpu_ids: 0,0", "gpu_ids", "appears twice", "each device once"},
      {"use_cpu: maybe", "use_cpu", "'maybe'", "true or false"},
      {"rdzv_backend: etcd", "rdzv_backend", "'etcd'", "static, c10d"},
      {"compute_environment: MOON", "compute_environment", "'MOON'", "LOCAL_MACHINE"},
      {"main_process_ip: 'a b'", "main_process_ip", "'a b'", "IP address"},
      {"deepspeed_config:\n  zero_stage: 5", "deepspeed_config.zero_stage", "'5'", "0, 1, 2 or 3"},
      {"deepspeed_config:\n  offload_optimizer_device: gpu", "offload_optimizer_device", "'gpu'",
       "none, cpu, nvme"},
      {"deepspeed_config:\n  gradient_accumulation_steps: 0", "gradient_accumulation_steps", "'0'",
       "at least 1"},
      {"fsdp_config:\n  fsdp_offload_params: sometimes", "fsdp_offload_params", "'sometimes'",
       "true or false"},
      {"fsdp_config:\n  fsdp_state_dict_type: BIG", "fsdp_state_dict_type", "'BIG'",
       "SHARDED_STATE_DICT"},
      {"fsdp_config: 3", "fsdp_config", "'3'", "a map"},
  };
  for (const auto& c : cases) {
    std::string yaml = c.yaml;
    if (!contains(yaml, "distributed_type")) yaml = "distributed_type: MULTI_CPU\n" + yaml;
    auto e = parse_error(yaml + "\n");
    SCOPED_TRACE(c.yaml);
    EXPECT_TRUE(contains(e, c.key)) << e;
    EXPECT_TRUE(contains(e, c.value)) << e;
    EXPECT_TRUE(contains(e, c.allowed)) << e;
    EXPECT_TRUE(contains(e, "test.yaml")) << e;
  }
  auto e = parse_error("distributed_type: TURBO\n");
  EXPECT_TRUE(contains(e, "'TURBO'")) << e;
  EXPECT_TRUE(contains(e, "MULTI_CPU")) << e;
}

TEST(ConfigFile, SeveralProblemsAreReportedTogether) {
  auto e = parse_error(
      "distributed_type: MULTI_CPU\nnum_processes: 0\nmixed_precision: fp32\n"
      "bogus: 1\n");
  EXPECT_TRUE(contains(e, "3 problems")) << e;
  EXPECT_TRUE(contains(e, "bogus")) << e;
  EXPECT_TRUE(contains(e, "num_processes")) << e;
  EXPECT_TRUE(contains(e, "mixed_precision")) << e;
}

TEST(ConfigFile, MalformedYamlGivesLineAndColumn) {
  auto e = parse_error("distributed_type: NO\nnum_processes: [1, 2\nmixed_precision: no\n");
  EXPECT_TRUE(contains(e, "not valid YAML")) << e;
  EXPECT_TRUE(contains(e, "line ")) << e;
  EXPECT_TRUE(contains(e, "column ")) << e;
  e = parse_error("distributed_type: NO\n  bad indent: 1\n");
  EXPECT_TRUE(contains(e, "line 2")) << e;
  e = parse_error("");
  EXPECT_TRUE(contains(e, "empty")) << e;
  e = parse_error("- a\n- b\n");
  EXPECT_TRUE(contains(e, "not a map")) << e;
  e = parse_error("num_processes: 2\n");
  EXPECT_TRUE(contains(e, "distributed_type is missing")) << e;
}

TEST(ConfigFile, CrossKeyChecks) {
  auto e = error_of([] {
    validate(
        parse_config("distributed_type: MULTI_CPU\nnum_machines: 2\n"
                     "machine_rank: 2\nmain_process_ip: 10.0.0.1\n"
                     "main_process_port: 29500\nnum_processes: 4\n"));
  });
  EXPECT_TRUE(contains(e, "machine_rank 2 is not below num_machines 2")) << e;
  e = error_of([] {
    validate(
        parse_config("distributed_type: MULTI_CPU\nnum_machines: 2\n"
                     "main_process_ip: 10.0.0.1\nmain_process_port: 1\n"
                     "num_processes: 3\n"));
  });
  EXPECT_TRUE(contains(e, "num_processes 3 is not a multiple of num_machines 2")) << e;
  e = error_of([] {
    validate(
        parse_config("distributed_type: MULTI_CPU\nnum_machines: 2\n"
                     "num_processes: 4\nmain_process_port: 29500\n"));
  });
  EXPECT_TRUE(contains(e, "main_process_ip is required")) << e;
  e = error_of([] {
    validate(
        parse_config("distributed_type: MULTI_CPU\nnum_machines: 2\n"
                     "num_processes: 4\nmain_process_ip: h\n"));
  });
  EXPECT_TRUE(contains(e, "main_process_port is required")) << e;
  e = error_of([] {
    validate(
        parse_config("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
                     "  offload_param_device: cpu\n"));
  });
  EXPECT_TRUE(contains(e, "needs zero_stage 3")) << e;
}

TEST(ConfigFile, AccelerateLegacyKeys) {
  auto c = parse_config("distributed_type: NO\nfp16: true\n");
  EXPECT_EQ(c.mixed_precision, "fp16");
  c = parse_config("distributed_type: NO\nfp16: true\nmixed_precision: bf16\n");
  EXPECT_EQ(c.mixed_precision, "bf16");
  c = parse_config("distributed_type: TPU\ndynamo_backend: 'NO'\n");
  EXPECT_EQ(c.distributed_type, "XLA");
  c = parse_config("distributed_type: NO\nnum_processes: -1\nmain_process_ip: null\n");
  EXPECT_EQ(c.num_processes, -1);
  EXPECT_FALSE(c.given("main_process_ip"));
}

TEST(ConfigFile, YamlRoundTripIsReadableByAccelerate) {
  LaunchConfig c;
  using tandem::config::set_value;
  auto set = [&](const std::string& k, const std::string& v) {
    set_value(c, k, v, Source::kConfigFile, k);
  };
  set("distributed_type", "DEEPSPEED");
  set("num_processes", "8");
  set("num_machines", "2");
  set("machine_rank", "1");
  set("main_process_ip", "10.1.2.3");
  set("main_process_port", "29500");
  set("gpu_ids", "0");
  set("mixed_precision", "no");
  set("gradient_accumulation_steps", "4");
  set("deepspeed_config.zero_stage", "3");
  set("deepspeed_config.offload_param_device", "cpu");
  set("deepspeed_config.gradient_clipping", "1.0");
  set("fp8_config.fp8_format", "HYBRID");
  std::string yaml = to_yaml(c);
  // PyYAML would read a plain `no` or a bare number as a boolean or an int.
  EXPECT_TRUE(contains(yaml, "mixed_precision: 'no'")) << yaml;
  EXPECT_TRUE(contains(yaml, "gpu_ids: '0'")) << yaml;
  EXPECT_TRUE(contains(yaml, "zero_stage: 3")) << yaml;
  auto back = parse_config(yaml, "roundtrip.yaml");
  EXPECT_EQ(back.distributed_type, "DEEPSPEED");
  EXPECT_EQ(back.num_processes, 8);
  EXPECT_EQ(back.num_machines, 2);
  EXPECT_EQ(back.machine_rank, 1);
  EXPECT_EQ(back.main_process_ip, "10.1.2.3");
  EXPECT_EQ(back.main_process_port, 29500);
  EXPECT_EQ(back.gpu_ids, "0");
  EXPECT_EQ(back.mixed_precision, "no");
  EXPECT_EQ(back.gradient_accumulation_steps, 4);
  EXPECT_EQ(back.deepspeed_config, c.deepspeed_config);
  EXPECT_EQ(back.fp8_config, c.fp8_config);
  EXPECT_TRUE(back.ignored.empty());
  EXPECT_NO_THROW(validate(back));

  auto nothing = parse_config(to_yaml(LaunchConfig()));
  EXPECT_TRUE(contains(to_yaml(LaunchConfig()), "distributed_type: 'NO'"));
  EXPECT_EQ(nothing.distributed_type, "NO");
}

TEST(ConfigFile, DefaultPathAndBasicConfig) {
  using tandem::config::default_config_path;
  EXPECT_EQ(default_config_path({{"TANDEM_CONFIG_HOME", "/c"}, {"HOME", "/h"}}),
            "/c/default_config.yaml");
  EXPECT_EQ(default_config_path({{"XDG_CACHE_HOME", "/x"}, {"HOME", "/h"}}),
            "/x/tandem/default_config.yaml");
  EXPECT_EQ(default_config_path({{"HOME", "/h"}}), "/h/.cache/tandem/default_config.yaml");

  auto cpu = tandem::config::basic_config(0, "bf16");
  EXPECT_EQ(cpu.distributed_type, "NO");
  EXPECT_TRUE(cpu.use_cpu);
  EXPECT_EQ(cpu.mixed_precision, "bf16");
  auto gpus = tandem::config::basic_config(4);
  EXPECT_EQ(gpus.distributed_type, "MULTI_GPU");
  EXPECT_EQ(gpus.num_processes, 4);
  EXPECT_FALSE(gpus.use_cpu);
  EXPECT_EQ(tandem::config::basic_config(1).distributed_type, "NO");
  auto e = error_of([] { tandem::config::basic_config(0, "fp64"); });
  EXPECT_TRUE(contains(e, "--mixed_precision")) << e;
}

TEST(ConfigFile, MissingFileSaysHowToCreateOne) {
  auto e = error_of([] { load_config_file("/nonexistent/tandem.yaml"); });
  EXPECT_TRUE(contains(e, "/nonexistent/tandem.yaml")) << e;
  EXPECT_TRUE(contains(e, "tandem config")) << e;
}

TEST(ConfigFile, WriteAndReportTheDefaultConfig) {
  char tmpl[] = "/tmp/tandem-cfg-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  tandem::EnvMap env{{"TANDEM_CONFIG_HOME", dir + "/sub/dir"}};
  EXPECT_TRUE(contains(tandem::config::default_config_report(env), "Default config: none"));
  const std::string path = tandem::config::default_config_path(env);
  tandem::config::write_config_file(path, to_yaml(tandem::config::basic_config(0)));
  auto report = tandem::config::default_config_report(env);
  EXPECT_TRUE(contains(report, "Default config: " + path)) << report;
  EXPECT_TRUE(contains(report, "    distributed_type: 'NO'")) << report;
  EXPECT_EQ(load_config_file(path).use_cpu, true);
  std::remove(path.c_str());
}

// A typo inside deepspeed_config would leave the default stage 2 running, one inside
// fsdp_config the default strategy: both are refused, naming the key, the section and the
// closest known key (or every known key).
TEST(ConfigFile, UnknownKeysInsideTheSectionsAreRefused) {
  auto e = parse_error("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stgae: 3\n");
  EXPECT_TRUE(contains(e, "deepspeed_config.zero_stgae")) << e;
  EXPECT_TRUE(contains(e, "'zero_stgae' is not a key of deepspeed_config")) << e;
  EXPECT_TRUE(contains(e, "did you mean zero_stage?")) << e;
  e = parse_error("distributed_type: FSDP\nfsdp_config:\n  fsdp_offlaod_params: true\n");
  EXPECT_TRUE(contains(e, "'fsdp_offlaod_params' is not a key of fsdp_config")) << e;
  EXPECT_TRUE(contains(e, "did you mean fsdp_offload_params?")) << e;
  e = parse_error("distributed_type: FSDP\nfsdp_config:\n  banana: 1\n");
  EXPECT_TRUE(contains(e, "'banana' is not a key of fsdp_config")) << e;
  EXPECT_FALSE(contains(e, "did you mean")) << e;
  EXPECT_TRUE(contains(e, "fsdp_sharding_strategy, fsdp_offload_params")) << e;  // the keys
  // Accelerate's DeepSpeed launcher keys are known: ignored with the one warning.
  auto c = parse_config(
      "distributed_type: DEEPSPEED\ndeepspeed_config:\n  "
      "deepspeed_multinode_launcher: standard\n  zero_stage: 3\n");
  EXPECT_EQ(c.deepspeed_config.at("zero_stage"), "3");
  const auto w = tandem::config::ignored_warning(c);
  EXPECT_TRUE(contains(w, "deepspeed_config.deepspeed_multinode_launcher: standard")) << w;
}

// Keys tandem checks but does not act on say so, in one line, when their value asks for
// something tandem does not do; the values that describe what tandem does say nothing.
TEST(ConfigFile, SettingsNotActedOnGiveOneWarningNamingThem) {
  using tandem::config::not_acted_on_warning;
  auto c = parse_config(
      "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_forward_prefetch: true\n"
      "  fsdp_backward_prefetch: BACKWARD_PRE\n  fsdp_cpu_ram_efficient_loading: true\n"
      "  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_offload_params: false\n"
      "  fsdp_use_orig_params: false\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
      "  fsdp_reshard_after_forward: false\n");
  auto w = not_acted_on_warning(c);
  for (const char* k : {"fsdp_config.fsdp_use_orig_params: false",
                        "fsdp_config.fsdp_state_dict_type: SHARDED_STATE_DICT",
                        "does not act on"})
    EXPECT_TRUE(contains(w, k)) << k << " in " << w;
  EXPECT_FALSE(contains(w, "fsdp_sharding_strategy")) << w;  // acted on
  EXPECT_FALSE(contains(w, "fsdp_cpu_ram_efficient_loading")) << w;  // ZeRO-3 loads by ranges
  EXPECT_FALSE(contains(w, "prefetch")) << w;  // Note [Prefetching units]
  EXPECT_FALSE(contains(w, "fsdp_reshard_after_forward")) << w;
  EXPECT_FALSE(contains(w, "fsdp_offload_params")) << w;
  EXPECT_FALSE(contains(w, "\n")) << "one warning, one line: " << w;
  EXPECT_EQ(not_acted_on_warning(parse_config(
                "distributed_type: FSDP\nfsdp_config:\n  fsdp_forward_prefetch: false\n"
                "  fsdp_backward_prefetch: NO_PREFETCH\n  fsdp_sync_module_states: true\n")),
            "");
  w = not_acted_on_warning(parse_config(
      "distributed_type: DEEPSPEED\nsame_network: false\ndeepspeed_config:\n  zero_stage: 3\n"
      "  zero3_init_flag: true\n"));
  EXPECT_TRUE(contains(w, "deepspeed_config.zero3_init_flag: true")) << w;
  EXPECT_TRUE(contains(w, "same_network: false")) << w;
  EXPECT_FALSE(contains(w, "zero_stage")) << w;
  // A section of another strategy changes nothing; the keys that act under every strategy do.
  w = not_acted_on_warning(parse_config(
      "distributed_type: MULTI_CPU\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n"
      "  gradient_clipping: 1.0\nfsdp_config:\n  fsdp_activation_checkpointing: true\n"));
  EXPECT_TRUE(contains(w,
                       "deepspeed_config.zero_stage: 3 (distributed_type is MULTI_CPU, not "
                       "DEEPSPEED)"))
      << w;
  EXPECT_FALSE(contains(w, "gradient_clipping")) << w;
  EXPECT_FALSE(contains(w, "activation_checkpointing")) << w;
}

// Note [Pipelines and ZeRO]: a pipeline averages its stages' gradients itself.
TEST(ConfigFile, PipelineWithZeroIsRefused) {
  auto refused = [](const std::string& yaml) {
    return error_of([&] { validate(parse_config(yaml, "pp.yaml")); });
  };
  auto e = refused(
      "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  "
      "zero_stage: 1\nparallelism_config:\n  pp_size: 2\n");
  EXPECT_TRUE(contains(e,
                       "parallelism_config.pp_size: 2 in pp.yaml does not combine with "
                       "distributed_type: DEEPSPEED in pp.yaml (deepspeed_config.zero_stage: 1)"))
      << e;
  e = refused("distributed_type: FSDP\nnum_processes: 2\nparallelism_config:\n  pp_size: 2\n");
  EXPECT_TRUE(contains(e, "distributed_type: FSDP in pp.yaml (FULL_SHARD)")) << e;
  EXPECT_EQ(refused("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  "
                    "zero_stage: 0\nparallelism_config:\n  pp_size: 2\n"),
            "");
  EXPECT_EQ(refused("distributed_type: MULTI_CPU\nnum_processes: 2\nparallelism_config:\n  "
                    "pp_size: 2\n"),
            "");
}
