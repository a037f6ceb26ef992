// The pure logic of sharding: where a rank's chunk of a unit lies, how a checkpoint's chunks are
// cut again for another number of ranks, and which settings ask for which stage.
#include <gtest/gtest.h>

#include <stdexcept>

#include "tandem/config/config.h"
#include "tandem/config/run_config.h"
#include "tandem/parallel/strategy.h"
#include "tandem/parallel/zero.h"

using namespace tandem::parallel;

TEST(Sharding, ChunksArePaddedAndNeverEmpty) {
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(shard_of(10, 4, r).numel, 3);
    EXPECT_EQ(shard_of(10, 4, r).offset, 3 * r);
    EXPECT_EQ(shard_of(3, 4, r).numel, 1);  // a bias of 3 over 4 ranks: the last chunk is padding
    EXPECT_EQ(shard_of(0, 4, r).numel, 1);
  }
  EXPECT_EQ(shard_of(105, 1, 0).numel, 105);
}

// Every real element of every new chunk comes from exactly the saved element of the same global
// index; padding is never read.
TEST(Sharding, ReshardPiecesMapEveryElementToItsSavedPlace) {
  for (int64_t numel = 1; numel <= 40; ++numel)
    for (int saved = 1; saved <= 5; ++saved)
      for (int world = 1; world <= 5; ++world)
        for (int rank = 0; rank < world; ++rank) {
          const auto mine = shard_of(numel, world, rank);
          const auto old_chunk = shard_of(numel, saved, 0).numel;
          std::vector<int> covered(static_cast<size_t>(mine.numel), 0);
          for (const auto& p : reshard_pieces(numel, saved, world, rank)) {
            ASSERT_GE(p.source_rank, 0);
            ASSERT_LT(p.source_rank, saved);
            ASSERT_LE(p.source_offset + p.length, old_chunk);
            for (int64_t k = 0; k < p.length; ++k) {
              const int64_t target_global = mine.offset + p.target_offset + k;
              const int64_t source_global = p.source_rank * old_chunk + p.source_offset + k;
              ASSERT_EQ(target_global, source_global);
              ASSERT_LT(source_global, numel);
              covered[static_cast<size_t>(p.target_offset + k)]++;
            }
          }
          for (int64_t t = 0; t < mine.numel; ++t)
            EXPECT_EQ(covered[static_cast<size_t>(t)], mine.offset + t < numel ? 1 : 0)
                << numel << " " << saved << "->" << world << " rank " << rank << " at " << t;
        }
}

TEST(Sharding, SettingsOfDeepSpeedAndFsdpChooseTheStage) {
  using Env = tandem::EnvMap;
  EXPECT_FALSE(tandem::config::sharding_from_env(Env{}));
  EXPECT_FALSE(tandem::config::sharding_from_env(Env{{"TANDEM_DISTRIBUTED_TYPE", "MULTI_CPU"}}));
  EXPECT_EQ(tandem::config::sharding_from_env(Env{{"TANDEM_DISTRIBUTED_TYPE", "DEEPSPEED"}})->stage(), 2);
  auto ds = tandem::config::sharding_from_env(Env{{"TANDEM_DISTRIBUTED_TYPE", "DEEPSPEED"},
                                          {"TANDEM_ZERO_STAGE", "1"},
                                          {"TANDEM_OFFLOAD_OPTIMIZER_DEVICE", "cpu"},
                                          {"TANDEM_REDUCE_SCATTER", "allreduce"}});
  EXPECT_EQ(ds->stage(), 1);
  EXPECT_TRUE(ds->offload_optimizer());
  EXPECT_EQ(ds->reduce_scatter(), tandem::ProcessGroup::ReduceScatterAlgorithm::kAllreduceSlice);
  const std::vector<std::pair<std::string, int>> fsdp = {
      {"FULL_SHARD", 3}, {"SHARD_GRAD_OP", 2}, {"NO_SHARD", 0}, {"HYBRID_SHARD", 3},
      {"HYBRID_SHARD_ZERO2", 2}, {"1", 3}, {"2", 2}, {"3", 0}, {"4", 3}, {"5", 2}};
  for (const auto& [name, stage] : fsdp)
    EXPECT_EQ(tandem::config::sharding_from_env(Env{{"TANDEM_DISTRIBUTED_TYPE", "FSDP"},
                                            {"TANDEM_FSDP_SHARDING_STRATEGY", name}})
                  ->stage(),
              stage)
        << name;
  auto f = tandem::config::sharding_from_env(Env{{"TANDEM_DISTRIBUTED_TYPE", "FSDP"},
                                         {"TANDEM_FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"},
                                         {"TANDEM_FSDP_OFFLOAD_PARAMS", "true"},
                                         {"TANDEM_FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"},
                                         {"TANDEM_FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE"},
                                         {"TANDEM_FSDP_USE_ORIG_PARAMS", "true"}});
  EXPECT_TRUE(f->offload_optimizer());
  EXPECT_FALSE(f->offload_params());
  EXPECT_EQ(f->state_dict_type(), "SHARDED_STATE_DICT");
  EXPECT_EQ(unsupported_sharding_message(*f), "");
  EXPECT_EQ(unsupported_sharding_message(ShardingOptions().stage(3).offload_params(true)), "");
  EXPECT_NE(unsupported_sharding_message(ShardingOptions().stage(2).offload_params(true))
                .find("stage 3"),
            std::string::npos);
  // Every value tandem cannot honour is an error naming it.
  const std::vector<Env> bad = {
      {{"TANDEM_DISTRIBUTED_TYPE", "DEEPSPEED"}, {"TANDEM_ZERO_STAGE", "4"}},
      {{"TANDEM_DISTRIBUTED_TYPE", "DEEPSPEED"}, {"TANDEM_OFFLOAD_OPTIMIZER_DEVICE", "nvme"}},
      {{"TANDEM_DISTRIBUTED_TYPE", "FSDP"}, {"TANDEM_FSDP_SHARDING_STRATEGY", "HALF_SHARD"}},
      {{"TANDEM_DISTRIBUTED_TYPE", "FSDP"}, {"TANDEM_FSDP_STATE_DICT_TYPE", "LOCAL_STATE_DICT"}},
      {{"TANDEM_DISTRIBUTED_TYPE", "FSDP"}, {"TANDEM_FSDP_ACTIVATION_CHECKPOINTING", "often"}},
      {{"TANDEM_DISTRIBUTED_TYPE", "FSDP"}, {"TANDEM_FSDP_NOT_A_KEY", "1"}},
      {{"TANDEM_DISTRIBUTED_TYPE", "FSDP"}, {"TANDEM_REDUCE_SCATTER", "ring"}},
      {{"TANDEM_DISTRIBUTED_TYPE", "FSDP"}, {"TANDEM_FSDP_AUTO_WRAP_POLICY", "EVERYTHING"}},
      {{"TANDEM_DISTRIBUTED_TYPE", "FSDP"}, {"TANDEM_FSDP_MIN_NUM_PARAMS", "many"}},
      {{"TANDEM_DISTRIBUTED_TYPE", "WARP_DRIVE"}}};
  for (const auto& env : bad) EXPECT_THROW(tandem::config::sharding_from_env(env), std::invalid_argument);
  try {
    tandem::config::sharding_from_env(Env{{"TANDEM_DISTRIBUTED_TYPE", "FSDP"}, {"TANDEM_FSDP_NOT_A_KEY", "1"}});
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp_not_a_key"), std::string::npos) << e.what();
  }
}

TEST(Sharding, FsdpStrategiesByNameOrNumber) {
  using tandem::parallel::fsdp_sharding_strategy;
  EXPECT_EQ(fsdp_sharding_strategy("FULL_SHARD").stage, 3);
  EXPECT_EQ(fsdp_sharding_strategy("shard_grad_op").stage, 2);
  EXPECT_EQ(fsdp_sharding_strategy("3").name, "NO_SHARD");
  EXPECT_TRUE(fsdp_sharding_strategy("4").hybrid);
  EXPECT_EQ(fsdp_sharding_strategy("HYBRID_SHARD_ZERO2").stage, 2);
  EXPECT_FALSE(fsdp_sharding_strategy("1").hybrid);
  for (const char* bad : {"0", "6", "FULL", ""}) {
    try {
      fsdp_sharding_strategy(bad);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("5 HYBRID_SHARD_ZERO2"), std::string::npos) << e.what();
    }
  }
  // The config file's names are the same table's.
  ASSERT_EQ(tandem::config::fsdp_sharding_strategies().size(),
            tandem::parallel::fsdp_sharding_strategies().size());
}
