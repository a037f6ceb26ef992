// Device mesh arithmetic without processes: slices, coordinates, shape checks and their
// messages, MeshShape resolution and its environment variables.
#include <gtest/gtest.h>

#include "tandem/comm/mesh.h"
#include "tandem/comm/process_group.h"
#include "tandem/config/run_config.h"
#include "tandem/launch/resolve.h"
#include "../common/errors.h"

using namespace tandem::comm;

namespace {

using tandem::testing::error_of;
using tandem::testing::contains;

using Slices = std::vector<std::vector<int>>;

}  // namespace

TEST(MeshSlices, TwoByTwo) {
  // dp x tp: tp groups are consecutive ranks, dp groups stride by tp.
  EXPECT_EQ(mesh_slices({2, 2}, 1), (Slices{{0, 1}, {2, 3}}));
  EXPECT_EQ(mesh_slices({2, 2}, 0), (Slices{{0, 2}, {1, 3}}));
  EXPECT_EQ(mesh_slices({2, 2}, std::vector<int>{0, 1}), (Slices{{0, 1, 2, 3}}));
}

TEST(MeshSlices, ThreeDimensionsAndFlattening) {
  // pp 2 x dp 3 x tp 2 = 12 ranks.
  const std::vector<int> shape{2, 3, 2};
  EXPECT_EQ(mesh_slices(shape, 2), (Slices{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}}));
  EXPECT_EQ(mesh_slices(shape, 1), (Slices{{0, 2, 4}, {1, 3, 5}, {6, 8, 10}, {7, 9, 11}}));
  EXPECT_EQ(mesh_slices(shape, 0), (Slices{{0, 6}, {1, 7}, {2, 8}, {3, 9}, {4, 10}, {5, 11}}));
  EXPECT_EQ(mesh_slices(shape, std::vector<int>{1, 2}),
            (Slices{{0, 1, 2, 3, 4, 5}, {6, 7, 8, 9, 10, 11}}));
  // Every rank is in exactly one slice of every dimension.
  for (int d = 0; d < 3; ++d) {
    std::vector<int> seen(12, 0);
    for (const auto& s : mesh_slices(shape, d))
      for (int r : s) ++seen[static_cast<size_t>(r)];
    EXPECT_EQ(seen, std::vector<int>(12, 1)) << "dimension " << d;
  }
  EXPECT_EQ(mesh_slices({4}, 0), (Slices{{0, 1, 2, 3}}));
  EXPECT_EQ(mesh_slices({1, 4}, 0), (Slices{{0}, {1}, {2}, {3}}));
  EXPECT_TRUE(contains(error_of([] { mesh_slices({2, 2}, 2); }), "does not exist"));
}

TEST(MeshCoordinates, RowMajor) {
  EXPECT_EQ(coordinates_of(0, {2, 3, 2}), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(coordinates_of(1, {2, 3, 2}), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(coordinates_of(5, {2, 3, 2}), (std::vector<int>{0, 2, 1}));
  EXPECT_EQ(coordinates_of(7, {2, 3, 2}), (std::vector<int>{1, 0, 1}));
  EXPECT_EQ(coordinates_of(11, {2, 3, 2}), (std::vector<int>{1, 2, 1}));
  // A rank's coordinate along a dimension is its index in its slice.
  for (int r = 0; r < 12; ++r)
    for (int d = 0; d < 3; ++d)
      for (const auto& s : mesh_slices({2, 3, 2}, d))
        for (size_t i = 0; i < s.size(); ++i)
          if (s[i] == r) {
            EXPECT_EQ(coordinates_of(r, {2, 3, 2})[static_cast<size_t>(d)], int(i));
          }
  EXPECT_TRUE(contains(error_of([] { coordinates_of(4, {2, 2}); }), "outside a mesh of 4"));
}

TEST(MeshValidation, ProductMustEqualTheWorldAndTheMessageSaysWhatFits) {
  validate_mesh_shape(8, {{"dp", 4}, {"tp", 2}});
  validate_mesh_shape(1, {});
  const auto missing = error_of([] { validate_mesh_shape(8, {{"dp", 2}, {"tp", 2}}); });
  EXPECT_TRUE(contains(missing, "dp 2 x tp 2 has 4 ranks but the job has 8")) << missing;
  EXPECT_TRUE(contains(missing, "a factor 2 is missing")) << missing;
  EXPECT_TRUE(contains(missing, "dp 4, or tp 4 would fit")) << missing;
  const auto too_many = error_of([] { validate_mesh_shape(6, {{"dp", 4}, {"tp", 2}}); });
  EXPECT_TRUE(contains(too_many, "has 8 ranks but the job has 6")) << too_many;
  EXPECT_TRUE(contains(too_many, "dp 3 would fit")) << too_many;
  EXPECT_TRUE(contains(too_many, "or run 8 processes")) << too_many;
  const auto none = error_of([] { validate_mesh_shape(7, {{"dp", 2}, {"tp", 2}}); });
  EXPECT_TRUE(contains(none, "no single size can be changed")) << none;
  EXPECT_TRUE(contains(error_of([] { validate_mesh_shape(4, {{"dp", 2}, {"dp", 2}}); }),
                       "'dp' is given twice"));
  EXPECT_TRUE(contains(error_of([] { validate_mesh_shape(4, {{"dp", 0}, {"tp", 4}}); }),
                       "size 0"));
}

TEST(MeshValidation, TensorParallelStaysWithinAMachine) {
  validate_mesh_shape(8, {{"dp", 2}, {"tp", 4}}, 4);
  validate_mesh_shape(8, {{"dp", 4}, {"tp", 2}}, 4);
  validate_mesh_shape(8, {{"dp", 8}, {"tp", 1}}, 1);  // tp 1 needs nothing
  const auto across = error_of([] { validate_mesh_shape(8, {{"dp", 1}, {"tp", 8}}, 4); });
  EXPECT_TRUE(contains(across, "tensor parallel size 8 does not fit in the 4 processes of one "
                               "machine")) << across;
  EXPECT_TRUE(contains(across, "Choose a tp size that divides 4")) << across;
  const auto uneven = error_of([] { validate_mesh_shape(12, {{"dp", 3}, {"tp", 4}}, 6); });
  EXPECT_TRUE(contains(uneven, "tp must divide the processes per machine")) << uneven;
}

TEST(MeshShapeTest, DefaultsAndDerivation) {
  // Nothing set: every rank a data-parallel replica.
  auto plain = MeshShape().resolve(4);
  EXPECT_EQ(plain.pp, 1);
  EXPECT_EQ(plain.dp_replicate, 4);
  EXPECT_EQ(plain.dp_shard, 1);
  EXPECT_EQ(plain.tp, 1);
  // tp only: dp_replicate derived.
  auto tp = MeshShape().tp_size(2).resolve(8, 8);
  EXPECT_EQ(tp.dp_replicate, 4);
  EXPECT_EQ(tp.dp_shard, 1);
  // One dp size set: the other derived.
  auto hsdp = MeshShape().dp_shard_size(2).tp_size(2).resolve(8);
  EXPECT_EQ(hsdp.dp_replicate, 2);
  auto rep = MeshShape().dp_replicate_size(2).pp_size(2).resolve(8);
  EXPECT_EQ(rep.dp_shard, 2);
  EXPECT_EQ(rep.dims(), (MeshDims{{"pp", 2}, {"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 1}}));
  // Both set: checked, not derived.
  const auto both = error_of([] { MeshShape().dp_replicate_size(2).dp_shard_size(2).resolve(8); });
  EXPECT_TRUE(contains(both, "has 4 ranks but the job has 8")) << both;
  const auto underivable = error_of([] { MeshShape().tp_size(3).resolve(8); });
  EXPECT_TRUE(contains(underivable, "not a multiple of pp x cp x tp")) << underivable;
  const auto machine = error_of([] { MeshShape().tp_size(4).resolve(8, 2); });
  EXPECT_TRUE(contains(machine, "within a machine")) << machine;
  EXPECT_EQ(MeshShape().tp_size(2).to_string(), "pp unset x dp_replicate unset x dp_shard unset x tp 2");
  // Context parallel: counted in the derivation, a dimension between dp_shard and tp only when
  // above 1 (every other mesh, and the layout checkpoints record, as before).
  auto cp = MeshShape().cp_size(2).tp_size(2).resolve(8, 8);
  EXPECT_EQ(cp.dp_replicate, 2);
  EXPECT_EQ(cp.dims(), (MeshDims{{"pp", 1}, {"dp_replicate", 2}, {"dp_shard", 1}, {"cp", 2}, {"tp", 2}}));
  EXPECT_EQ(MeshShape().cp_size(1).resolve(2).dims().size(), 4u);
  EXPECT_EQ(MeshShape().cp_size(2).to_string(),
            "pp unset x dp_replicate unset x dp_shard unset x cp 2 x tp unset");
}

TEST(MeshShapeTest, EnvironmentRoundTrip) {
  auto shape = MeshShape().tp_size(2).dp_shard_size(3);
  auto env = tandem::launch::mesh_shape_environment(shape);
  EXPECT_EQ(env, (tandem::EnvMap{{"TANDEM_TP_SIZE", "2"}, {"TANDEM_DP_SHARD_SIZE", "3"}}));
  auto back = tandem::config::mesh_shape_from_env(env);
  EXPECT_EQ(back.tp, 2);
  EXPECT_EQ(back.dp_shard, 3);
  EXPECT_EQ(back.dp_replicate, 0);
  EXPECT_EQ(back.pp, 0);
  EXPECT_TRUE(tandem::config::mesh_shape_from_env({}).empty());
  const auto bad = error_of([] { tandem::config::mesh_shape_from_env({{"TANDEM_TP_SIZE", "two"}}); });
  EXPECT_TRUE(contains(bad, "TANDEM_TP_SIZE=two is not a mesh size")) << bad;
  EXPECT_FALSE(error_of([] { tandem::config::mesh_shape_from_env({{"TANDEM_PP_SIZE", "0"}}); }).empty());
}

TEST(DeviceMeshTest, OneProcessMeshOfSizeOneDimensions) {
  auto mesh = make_device_mesh(tandem::ProcessGroup::single(), MeshShape());
  EXPECT_EQ(mesh.names(), (std::vector<std::string>{"pp", "dp_replicate", "dp_shard", "tp", "dp"}));
  EXPECT_EQ(mesh.world_size(), 1);
  for (const auto& n : mesh.names()) {
    EXPECT_EQ(mesh.size(n), 1);
    EXPECT_EQ(mesh.coordinate(n), 0);
    ASSERT_TRUE(mesh[n] != nullptr);
    EXPECT_EQ(mesh[n]->size(), 1);
  }
  EXPECT_TRUE(mesh.has("tp"));
  EXPECT_FALSE(mesh.has("cp"));
  const auto e = error_of([&] { mesh["cp"]; });
  EXPECT_TRUE(contains(e, "no dimension 'cp'; it has pp, dp_replicate, dp_shard, tp, dp")) << e;
}
