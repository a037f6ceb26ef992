// parallelism_config in config files and on `tandem launch`'s command line: Accelerate's key
// names, tandem's pp_size, the mesh check against the job, the TANDEM_* variables.
#include <gtest/gtest.h>

#include "tandem/comm/mesh.h"
#include "tandem/config/config.h"
#include "tandem/config/run_config.h"
#include "tandem/launch/resolve.h"
#include "../common/errors.h"

using tandem::config::LaunchConfig;
using tandem::config::parse_config;

namespace {

using tandem::testing::error_of;
using tandem::testing::contains;

const std::string kBase = "distributed_type: MULTI_CPU\nnum_processes: 4\nuse_cpu: true\n";

tandem::launch::MachineInfo cpu_only() {
  return {};
}

}  // namespace

TEST(ParallelismConfig, AccelerateKeysAndPpSize) {
  auto c = parse_config(kBase +
                        "parallelism_config:\n"
                        "  parallelism_config_dp_replicate_size: 2\n"
                        "  parallelism_config_tp_size: 2\n"
                        "  parallelism_config_cp_size: 1\n"
                        "  pp_size: 1\n");
  EXPECT_EQ(c.parallelism_config.at("parallelism_config_dp_replicate_size"), "2");
  EXPECT_EQ(c.parallelism_config.at("parallelism_config_tp_size"), "2");
  EXPECT_EQ(c.parallelism_config.at("pp_size"), "1");
  EXPECT_EQ(c.parallelism_config.count("parallelism_config_dp_shard_size"), 0u);
  EXPECT_TRUE(c.given("parallelism_config.parallelism_config_tp_size"));
  EXPECT_TRUE(c.ignored.empty());  // acted on, no longer an ignored section
  auto shape = tandem::config::mesh_shape(c);
  EXPECT_EQ(shape.tp, 2);
  EXPECT_EQ(shape.dp_replicate, 2);
  EXPECT_EQ(shape.dp_shard, 0);
  EXPECT_EQ(shape.pp, 1);
  tandem::config::validate(c);
  // The prefix may be left out, as Accelerate's launcher adds it.
  auto short_names = parse_config(kBase + "parallelism_config:\n  tp_size: 4\n");
  EXPECT_EQ(short_names.parallelism_config.at("parallelism_config_tp_size"), "4");
  // Written back under Accelerate's names, and read again to the same values.
  auto again = parse_config(tandem::config::to_yaml(c));
  EXPECT_EQ(again.parallelism_config, c.parallelism_config);
  EXPECT_TRUE(contains(tandem::config::to_yaml(c), "parallelism_config_tp_size: 2"));
}

// Note [Context parallel]: Accelerate's cp_size and cp_comm_strategy reach the ranks as
// TANDEM_CP_SIZE and TANDEM_CP_COMM_STRATEGY; cp counts in the mesh's derivation.
TEST(ParallelismConfig, ContextParallelKeys) {
  auto c = parse_config(kBase + "parallelism_config:\n  parallelism_config_cp_size: 2\n"
                                "  cp_comm_strategy: allgather\n");
  EXPECT_EQ(c.parallelism_config.at("parallelism_config_cp_size"), "2");
  EXPECT_EQ(tandem::config::mesh_shape(c).cp, 2);
  tandem::config::validate(c);
  auto env = tandem::launch::program_environment(tandem::launch::resolve_launch(c, {}, cpu_only()));
  EXPECT_EQ(env.at("TANDEM_CP_SIZE"), "2");
  EXPECT_EQ(env.at("TANDEM_CP_COMM_STRATEGY"), "allgather");
  auto again = parse_config(tandem::config::to_yaml(c));
  EXPECT_EQ(again.parallelism_config, c.parallelism_config);
  // 4 processes, cp 2: dp 2 derived; cp 3 does not divide them.
  auto shape = tandem::config::mesh_shape(c).resolve(4);
  EXPECT_EQ(shape.dp_replicate, 2);
  auto e = error_of([] {
    tandem::config::validate(parse_config(kBase + "parallelism_config:\n  cp_size: 3\n"));
  });
  EXPECT_TRUE(contains(e, "not a multiple of pp x cp x tp")) << e;
  // Ulysses: a third strategy; Accelerate's DeepSpeed sequence-parallel keys are named as not
  // acted on, with the key that is.
  auto u = parse_config(kBase + "parallelism_config:\n  cp_size: 2\n  cp_comm_strategy: ulysses\n");
  EXPECT_EQ(u.parallelism_config.at("parallelism_config_cp_comm_strategy"), "ulysses");
  auto sp = parse_config(kBase + "parallelism_config:\n  parallelism_config_sp_size: 2\n"
                                 "  parallelism_config_sp_backend: deepspeed\n");
  ASSERT_EQ(sp.ignored.size(), 2u);
  EXPECT_TRUE(contains(sp.ignored[0], "cp_comm_strategy: ulysses")) << sp.ignored[0];
}

// Note [Expert parallel]: ep_size reaches the ranks as TANDEM_EP_SIZE; it is no mesh dimension
// (the ep groups are carved from dp), so the mesh stays dp 4.
TEST(ParallelismConfig, ExpertParallelKey) {
  auto c = parse_config(kBase + "parallelism_config:\n  parallelism_config_ep_size: 2\n");
  EXPECT_EQ(c.parallelism_config.at("parallelism_config_ep_size"), "2");
  tandem::config::validate(c);
  auto env = tandem::launch::program_environment(tandem::launch::resolve_launch(c, {}, cpu_only()));
  EXPECT_EQ(env.at("TANDEM_EP_SIZE"), "2");
  EXPECT_EQ(tandem::config::mesh_shape(c).resolve(4).dp_replicate, 4);
  auto again = parse_config(tandem::config::to_yaml(c));
  EXPECT_EQ(again.parallelism_config, c.parallelism_config);
  auto e = error_of([] { parse_config(kBase + "parallelism_config:\n  ep_size: 0\n"); });
  EXPECT_TRUE(contains(e, "a size >= 1")) << e;
}

TEST(ParallelismConfig, BadValuesAndKeys) {
  auto e = error_of([] { parse_config(kBase + "parallelism_config:\n  parallelism_config_tp_size: 0\n"); });
  EXPECT_TRUE(contains(e, "parallelism_config.parallelism_config_tp_size")) << e;
  EXPECT_TRUE(contains(e, "a size >= 1")) << e;
  e = error_of([] { parse_config(kBase + "parallelism_config:\n  cp_comm_strategy: heads\n"); });
  EXPECT_TRUE(contains(e, "cp_comm_strategy 'heads'")) << e;
  EXPECT_TRUE(contains(e, "alltoall")) << e;
  EXPECT_TRUE(contains(e, "allgather (gathered at once) or ulysses")) << e;
  e = error_of([] { parse_config(kBase + "parallelism_config:\n  tensor_size: 2\n"); });
  EXPECT_TRUE(contains(e, "unknown parallelism_config key 'tensor_size'")) << e;
  EXPECT_TRUE(contains(e, "parallelism_config_tp_size")) << e;
}

TEST(ParallelismConfig, ValidateRefusesAShapeThatDoesNotFitTheJob) {
  auto c = parse_config(kBase + "parallelism_config:\n  parallelism_config_tp_size: 3\n");
  auto e = error_of([&] { tandem::config::validate(c); });
  EXPECT_TRUE(contains(e, "parallelism_config (config file <config>), 4 processes on 1 machine"))
      << e;
  EXPECT_TRUE(contains(e, "not a multiple of pp x cp x tp")) << e;
  auto both = parse_config(kBase + "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
                                   "  parallelism_config_dp_shard_size: 1\n  pp_size: 1\n"
                                   "  parallelism_config_tp_size: 1\n");
  e = error_of([&] { tandem::config::validate(both); });
  EXPECT_TRUE(contains(e, "a factor 2 is missing")) << e;
  // tp across machines: 8 processes on 2 machines, tp 8.
  auto machines = parse_config(
      "distributed_type: MULTI_CPU\nnum_processes: 8\nnum_machines: 2\nmain_process_ip: 10.0.0.1\n"
      "main_process_port: 29500\nparallelism_config:\n  parallelism_config_tp_size: 8\n");
  e = error_of([&] { tandem::config::validate(machines); });
  EXPECT_TRUE(contains(e, "does not fit in the 4 processes of one machine")) << e;
}

TEST(ParallelismConfig, LaunchFlagsExportTheSizes) {
  auto r =
      tandem::launch::resolve_launch(LaunchConfig(),
                                     {{"num_processes", "4"},
                                      {"use_cpu", "true"},
                                      {"parallelism_config.parallelism_config_tp_size", "2"},
                                      {"parallelism_config.parallelism_config_dp_shard_size", "2"}},
                                     cpu_only());
  auto env = tandem::launch::program_environment(r);
  EXPECT_EQ(env.at("TANDEM_TP_SIZE"), "2");
  EXPECT_EQ(env.at("TANDEM_DP_SHARD_SIZE"), "2");
  EXPECT_EQ(env.count("TANDEM_DP_REPLICATE_SIZE"), 0u);
  EXPECT_EQ(env.count("TANDEM_PP_SIZE"), 0u);
  auto shape = tandem::config::mesh_shape_from_env(env).resolve(4, 4);
  EXPECT_EQ(shape.dp_replicate, 1);
  EXPECT_EQ(tandem::launch::flag_for_key("parallelism_config.parallelism_config_tp_size"), "--tp_size");
  EXPECT_EQ(tandem::launch::flag_for_key("parallelism_config.pp_size"), "--pp_size");
  // Nothing set: nothing exported.
  auto plain = tandem::launch::resolve_launch(LaunchConfig(), {{"num_processes", "2"}}, cpu_only());
  EXPECT_EQ(tandem::launch::program_environment(plain).count("TANDEM_TP_SIZE"), 0u);
  // A shape that does not fit is refused before any rank starts.
  auto e = error_of([] {
    tandem::launch::resolve_launch(
        LaunchConfig(),
        {{"num_processes", "4"}, {"use_cpu", "true"}, {"parallelism_config.pp_size", "3"}},
        cpu_only());
  });
  EXPECT_TRUE(contains(e, "--pp_size")) << e;
  EXPECT_TRUE(contains(e, "4 processes")) << e;
}
