// The checkpoint's layout (Note [Checkpoint layout]): the names of its files, the records its
// parts write and their checked reading, by the writer's functions and by resharding's reader
// on files altered the way a hand or another tool alters them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "../../src/parallel/detail/reshard.h"
#include "checkpoint_test_util.h"
#include "tandem/checkpoint/layout.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/checkpoint/training_state.h"
#include "tandem/comm/process_group.h"

namespace layout = tandem::checkpoint::layout;
using tandem::checkpoint::StatePart;
using tandem::checkpoint::StateReader;
using tandem::checkpoint::StateWriter;
using tandem_test::message_of;
using tandem_test::TempDir;

namespace {

constexpr const char* kTp2 = "pp 1 x dp_replicate 1 x dp_shard 1 x tp 2";

// A checkpoint of `world` ranks written in one process: `write` puts the files in, `state`
// the state.json keys; the manifest then says `world` ranks saved it (as a run of that many
// would have).
void save(const std::string& dir, int world, const std::function<void(StateWriter&)>& write) {
  StatePart part{"test", write, [](const StateReader&) {}};
  tandem::checkpoint::save_training_state(*tandem::ProcessGroup::single(), dir, {part});
  const auto manifest = dir + "/manifest.json";
  auto doc = nlohmann::json::parse(tandem_test::read_file(manifest));
  doc["world_size"] = world;
  tandem_test::write_file(manifest, doc.dump());
}

// Rank r's model part of a tp-2 Linear(4, 2)'s weight (split by rows) and bias (whole).
void write_tp_part(StateWriter& w, int r, std::map<std::string, std::string> meta = {}) {
  const auto weight = torch::arange(8, torch::kFloat).reshape({2, 4});
  layout::TpCut cut{2, r, {{"weight", "rows/1"}}};
  auto metadata = layout::model_part_metadata(kTp2, std::nullopt, cut);
  for (const auto& [k, v] : meta) metadata[k] = v;
  w.write_tensors(layout::model_part_file(0, r),
                  {{"weight", weight.chunk(2, 0)[r].contiguous()}, {"bias", torch::ones({2})}},
                  metadata);
}

}  // namespace

TEST(CheckpointLayout, NamesEveryFileOnce) {
  EXPECT_EQ(layout::model_file(0), "model.safetensors");
  EXPECT_EQ(layout::model_file(2), "model_2.safetensors");
  EXPECT_EQ(layout::model_index_file(0), "model.safetensors.index.json");
  EXPECT_EQ(layout::model_index_file(1), "model_1.safetensors.index.json");
  EXPECT_EQ(layout::model_part_file(1, 3), "model_1.mp3.safetensors");
  EXPECT_EQ(layout::optimizer_stem(0), "optimizer");
  EXPECT_EQ(layout::optimizer_part_stem(1, 2), "optimizer_1.mp2");
  EXPECT_EQ(layout::optimizer_shard_stem(0, 5), "optimizer.rank5");
  EXPECT_EQ(layout::master_weights_file(1), "master_weights_1.safetensors");
  EXPECT_EQ(layout::master_weights_part_file(0, 4), "master_weights.mp4.safetensors");
  EXPECT_EQ(layout::random_states_file(3), "random_states_3.safetensors");
  EXPECT_EQ(layout::custom_file("ema"), "custom_ema.bin");

  // The ranks of model parts, read back from the names the writer gives them.
  EXPECT_EQ(layout::model_part_rank(layout::model_part_file(0, 12), 0), 12);
  EXPECT_EQ(layout::model_part_rank(layout::model_part_file(2, 0), 2), 0);
  EXPECT_FALSE(layout::model_part_rank(layout::model_part_file(2, 0), 0));  // another model
  EXPECT_FALSE(layout::model_part_rank("model.mpx.safetensors", 0));
  EXPECT_FALSE(layout::model_part_rank("model.safetensors", 0));
  EXPECT_HAS(message_of<std::runtime_error>(
                 [] { layout::model_part_rank("model.mp1234567890.safetensors", 0); }),
             "expected a rank of fewer than 10 digits");
}

TEST(CheckpointLayout, MeshStringsAreCheckedPartByPart) {
  EXPECT_EQ(layout::short_mesh(kTp2), "tp 2");
  EXPECT_EQ(layout::short_mesh("pp 1 x dp_replicate 2 x dp_shard 2 x tp 1"),
            "dp_replicate 2 x dp_shard 2");
  EXPECT_EQ(layout::short_mesh("pp 1 x dp_replicate 1 x dp_shard 4 x tp 1"), "dp 4");
  EXPECT_EQ(layout::short_mesh("pp 1 x dp_replicate 1 x dp_shard 1 x tp 1"), "1 process");
  EXPECT_TRUE(layout::model_parallel_mesh(kTp2));
  EXPECT_FALSE(layout::model_parallel_mesh("pp 1 x dp_replicate 1 x dp_shard 4 x tp 1"));
  for (const char* bad : {"pp 1 x tp two", "pp 1 x 2", "pp 1 x tp 0", "pp 1 x tp -1"})
    EXPECT_HAS(message_of<std::invalid_argument>([&] { layout::mesh_dims(bad); }),
               "is not a dimension's name and a positive size");
}

TEST(CheckpointLayout, TensorParallelMetadataRoundTripsAndIsChecked) {
  layout::TpCut cut{4, 3, {{"q", "rows/3"}, {"o", "cols"}}};
  auto meta = layout::model_part_metadata(kTp2, 1, cut);
  EXPECT_EQ(meta.at(layout::kMeshMeta), kTp2);
  EXPECT_EQ(meta.at(layout::kPipelineStageMeta), "1");
  const auto back = layout::read_tp_cut(meta, "f", "");
  EXPECT_EQ(back.size, 4);
  EXPECT_EQ(back.rank, 3);
  EXPECT_EQ(back.split, cut.split);
  EXPECT_EQ(layout::read_tp_cut(layout::model_part_metadata(kTp2, std::nullopt, {}), "f", "").size,
            0);

  auto with = [&](const char* key, const std::string& value) {
    auto m = meta;
    m[key] = value;
    return message_of<std::runtime_error>([&] { layout::read_tp_cut(m, "the file", " FIX"); });
  };
  EXPECT_HAS(with(layout::kTpRankMeta, "4"),
             "the file: metadata \"tandem_tp_rank\" is \"4\", expected this file's "
             "tensor-parallel rank, an integer from 0 to 3");
  EXPECT_HAS(with(layout::kTpSizeMeta, "2x"), "metadata \"tandem_tp_size\" is \"2x\"");
  EXPECT_HAS(with(layout::kTpSplitMeta, R"({"q": "rows/0"})"),
             "gives tensor 'q' the split \"rows/0\", expected \"cols\" or \"rows/<parts>\"");
  EXPECT_HAS(with(layout::kTpSplitMeta, "{"), "expected a JSON object");
  EXPECT_HAS(with(layout::kTpSplitMeta, "{"), " FIX");
  auto partial = meta;
  partial.erase(layout::kTpRankMeta);
  EXPECT_HAS(message_of<std::runtime_error>([&] { layout::read_tp_cut(partial, "f", ""); }),
             "has \"tandem_tp_size\" but no \"tandem_tp_rank\"");
  EXPECT_EQ(layout::split_parts("rows/3"), 3);
  EXPECT_EQ(layout::split_parts("cols"), 1);
  EXPECT_THROW(layout::split_parts("rows/x"), std::invalid_argument);
}

TEST(CheckpointLayout, OptimizerRecordRoundTripsAndIsChecked) {
  layout::OptimizerRecord rec;
  rec.tp_rank = 1;
  rec.tp_size = 2;
  rec.names = {{"a.weight", "a.bias"}};
  rec.splits = {{"cols", ""}};
  const auto back = layout::read_optimizer_record(layout::optimizer_record_json(rec), "f");
  EXPECT_EQ(back.tp_rank, 1);
  EXPECT_EQ(back.tp_size, 2);
  EXPECT_EQ(back.names, rec.names);
  EXPECT_EQ(back.splits, rec.splits);

  auto error = [](const std::string& text) {
    return message_of<std::runtime_error>([&] { layout::read_optimizer_record(text, "opt.json"); });
  };
  EXPECT_HAS(error(R"({"tp_rank": 2, "tp_size": 2})"),
             "opt.json: its \"tandem\" record has \"tp_rank\" 2, expected an integer from 0 to 1");
  EXPECT_HAS(error(R"({"names": [["a"]], "splits": [[]]})"), "of different shapes");
  EXPECT_HAS(error(R"({"splits": [["rows/"]]})"), "gives the split \"rows/\"");
  EXPECT_HAS(error(R"({"names": "a"})"), "\"names\" that is not a list of lists of strings");
  EXPECT_HAS(error("[1"), "does not parse");
}

TEST(CheckpointLayout, RunLayoutIsReadWithChecks) {
  TempDir good, bad_mesh, not_object, old;
  save(good.file("ckpt"), 1, [](StateWriter& w) {
    w.set_state(layout::kLayoutKey, layout::run_layout_json(kTp2, "zero-2"));
  });
  const auto saved = layout::saved_run_layout(StateReader(good.file("ckpt"), "[rank 0/1]"));
  EXPECT_TRUE(saved.recorded);
  EXPECT_EQ(saved.mesh, kTp2);
  EXPECT_EQ(saved.describe(), "tp 2 (1 process, zero-2)");

  save(bad_mesh.file("ckpt"), 1, [](StateWriter& w) {
    w.set_state(layout::kLayoutKey, layout::run_layout_json("pp 1 x tp two", "ddp"));
  });
  EXPECT_HAS(message_of<std::runtime_error>([&] {
               layout::saved_run_layout(StateReader(bad_mesh.file("ckpt"), "[rank 0/1]"));
             }),
             "state.json's \"layout\" holds the mesh \"pp 1 x tp two\": its part \"tp two\"");
  save(not_object.file("ckpt"), 1,
       [](StateWriter& w) { w.set_state(layout::kLayoutKey, R"({"mesh": 3})"); });
  const auto msg = message_of<std::runtime_error>([&] {
    layout::saved_run_layout(StateReader(not_object.file("ckpt"), "[rank 0/1]"));
  });
  EXPECT_HAS(msg, "[rank 0/1] load_state: ");
  EXPECT_HAS(msg, "expected an object with the strings \"mesh\" and \"strategy\"");
  EXPECT_HAS(msg, "save the checkpoint again");

  // A checkpoint from before "layout": its "mesh" alone.
  save(old.file("ckpt"), 2,
       [](StateWriter& w) { w.set_state(layout::kMeshKey, layout::mesh_json(kTp2)); });
  const auto earlier = layout::saved_run_layout(StateReader(old.file("ckpt"), "[rank 0/1]"));
  EXPECT_FALSE(earlier.recorded);
  EXPECT_EQ(earlier.mesh, kTp2);
  EXPECT_EQ(earlier.world, 2);
}

// Resharding reads the parts' metadata through the same checks as merge_weights: a tp-2
// checkpoint is joined whole, and one whose second part was altered is refused by name.
TEST(CheckpointLayout, ReshardingJoinsPartsAndRefusesAlteredMetadata) {
  TempDir dir, altered;
  save(dir.file("ckpt"), 2, [](StateWriter& w) {
    write_tp_part(w, 0);
    write_tp_part(w, 1);
  });
  {
    StateReader r(dir.file("ckpt"), "[rank 0/1]");
    tandem::parallel::detail::SavedTensors saved(r, 1, 0);
    EXPECT_TRUE(saved.model_tensor(0, "weight").equal(torch::arange(8, torch::kFloat).reshape({2, 4})));
    EXPECT_TRUE(saved.model_tensor(0, "bias").equal(torch::ones({2})));
  }
  save(altered.file("ckpt"), 2, [](StateWriter& w) {
    write_tp_part(w, 0);
    write_tp_part(w, 1, {{layout::kTpRankMeta, "7"}});
  });
  StateReader r(altered.file("ckpt"), "[rank 0/1]");
  const auto msg = message_of<std::runtime_error>(
      [&] { tandem::parallel::detail::SavedTensors saved(r, 1, 0); });
  EXPECT_HAS(msg, "[rank 0/1] load_state: " + altered.file("ckpt") + "/model.mp1.safetensors");
  EXPECT_HAS(msg, "metadata \"tandem_tp_rank\" is \"7\", expected this file's tensor-parallel rank");
  EXPECT_HAS(msg, layout::kAlteredFileFix);
}

TEST(CheckpointLayout, ReshardingRefusesAlteredOptimizerRecords) {
  TempDir bad_record, bad_shard;
  save(bad_record.file("ckpt"), 1, [](StateWriter& w) {
    w.write_tensors(layout::optimizer_stem(0) + layout::kTensors, {{"x", torch::zeros({1})}});
    w.write_bytes(layout::optimizer_stem(0) + layout::kJson,
                  R"({"param_groups": [], "state": {}, "tandem": {"tp_size": 0}})");
  });
  EXPECT_HAS(message_of<std::runtime_error>([&] {
               StateReader r(bad_record.file("ckpt"), "[rank 0/1]");
               tandem::parallel::detail::SavedTensors saved(r, 0, 1);
             }),
             "optimizer.json: its \"tandem\" record has \"tp_size\" 0, expected an integer from 1");
  // A ZeRO shard file whose "zero" record lost a key.
  save(bad_shard.file("ckpt"), 1, [](StateWriter& w) {
    w.write_tensors(layout::optimizer_shard_stem(0, 0) + layout::kTensors,
                    {{"x", torch::zeros({1})}});
    w.write_bytes(layout::optimizer_shard_stem(0, 0) + layout::kJson,
                  R"({"param_groups": [], "state": {}, "zero": {"units": []}})");
  });
  EXPECT_HAS(message_of<std::runtime_error>([&] {
               StateReader r(bad_shard.file("ckpt"), "[rank 0/1]");
               tandem::parallel::detail::SavedTensors saved(r, 0, 1);
             }),
             "its optimizer files' records are not what save_state() wrote");
}
