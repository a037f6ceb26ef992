// save_model / load_model: size strings, shard assignment, single and sharded checkpoints in
// transformers' layout, strict and non-strict loading, dtype policy, tied weights.
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>

#include "checkpoint_test_util.h"
#include "tandem/checkpoint/merge_weights.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/checkpoint/training_state.h"
#include "tandem/comm/process_group.h"

using namespace tandem::checkpoint;
using tandem_test::message_of;
using tandem_test::TempDir;
namespace fs = std::filesystem;

namespace {

// Two linear layers and a buffer: fc1.weight [8,4], fc1.bias [8], fc2.weight [2,8], fc2.bias [2],
// steps [1] (I64).
struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 2));
    steps = register_buffer("steps", torch::full({1}, 7, torch::kLong));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor steps;
};

void expect_same_state(const torch::nn::Module& a, const torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
  auto ba = a.named_buffers(), bb = b.named_buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (const auto& item : ba) EXPECT_TRUE(torch::equal(item.value(), bb[item.key()])) << item.key();
}

nlohmann::json read_json(const fs::path& p) {
  return nlohmann::json::parse(tandem_test::read_file(p.string()));
}

}  // namespace

TEST(ParseSize, DecimalAndBinaryUnits) {
  EXPECT_EQ(parse_size("10GB"), 10'000'000'000ULL);
  EXPECT_EQ(parse_size("200MB"), 200'000'000ULL);
  EXPECT_EQ(parse_size("1.5GB"), 1'500'000'000ULL);
  EXPECT_EQ(parse_size("500KB"), 500'000ULL);
  EXPECT_EQ(parse_size("500kB"), 500'000ULL);
  EXPECT_EQ(parse_size("2TB"), 2'000'000'000'000ULL);
  EXPECT_EQ(parse_size("1KiB"), 1024ULL);
  EXPECT_EQ(parse_size("3MiB"), 3ULL << 20);
  EXPECT_EQ(parse_size("2GiB"), 2ULL << 30);
  EXPECT_EQ(parse_size("1TiB"), 1ULL << 40);
  EXPECT_EQ(parse_size("0.5KiB"), 512ULL);
  EXPECT_EQ(parse_size("1048576"), 1048576ULL);
  EXPECT_EQ(parse_size("12B"), 12ULL);
  EXPECT_EQ(parse_size(" 5 GB "), 5'000'000'000ULL);
  EXPECT_EQ(parse_size("0.0001KB"), 0ULL);  // fractions of a byte round down
  EXPECT_EQ(parse_size("18446744073709551615"), ~0ULL);
}

TEST(ParseSize, RejectsMalformedSizes) {
  for (const char* bad : {"", "GB", "ten GB", "10XB", "10 G", "10Gb", "10b", "-1GB", "1.2.3GB",
                          "18446744073709551616", "20000000000GB", "1e9", "10GBs"}) {
    auto msg = message_of<std::invalid_argument>([&] { parse_size(bad); });
    EXPECT_HAS(msg, std::string("size '") + bad + "'");
    EXPECT_HAS(msg, "expected a number and a unit");
  }
  EXPECT_HAS(message_of<std::invalid_argument>([] { parse_size("5Gb"); }), "gigabits");
}

TEST(AssignShards, GreedyInOrder) {
  using Shards = std::vector<std::vector<std::size_t>>;
  EXPECT_EQ(assign_shards({}, 10), Shards{});
  EXPECT_EQ(assign_shards({4, 4, 4}, 10), (Shards{{0, 1}, {2}}));
  EXPECT_EQ(assign_shards({5, 5, 5}, 10), (Shards{{0, 1}, {2}}));  // exactly full stays
  EXPECT_EQ(assign_shards({3, 3, 3}, 100), (Shards{{0, 1, 2}}));
  // A tensor larger than the limit gets a shard of its own.
  EXPECT_EQ(assign_shards({2, 30, 2, 2}, 10), (Shards{{0}, {1}, {2, 3}}));
  EXPECT_EQ(assign_shards({30, 2}, 10), (Shards{{0}, {1}}));
  // Order is kept, not bin-packed: 6 then 6 then 4 (a packer would pair 6 and 4).
  EXPECT_EQ(assign_shards({6, 6, 4}, 10), (Shards{{0}, {1, 2}}));
  EXPECT_EQ(assign_shards({0, 0, 10, 0}, 10), (Shards{{0, 1, 2, 3}}));
  EXPECT_EQ(assign_shards({~0ULL, 1}, ~0ULL), (Shards{{0}, {1}}));  // no overflow
}

TEST(AssignShards, FileNames) {
  EXPECT_EQ(shard_file_name(0, 3), "model-00001-of-00003.safetensors");
  EXPECT_EQ(shard_file_name(11, 12), "model-00012-of-00012.safetensors");
}

TEST(ModelIo, NamesAreParametersThenBuffers) {
  Net net;
  EXPECT_EQ(model_tensor_names(net), (std::vector<std::string>{"fc1.weight", "fc1.bias",
                                                               "fc2.weight", "fc2.bias", "steps"}));
}

TEST(ModelIo, SingleFileRoundTrip) {
  TempDir dir;
  Net a, b;
  save_model(a, dir.path().string());
  EXPECT_TRUE(fs::exists(dir.path() / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir.path() / "model.safetensors.index.json"));
  SafetensorsFile f(dir.file("model.safetensors"));
  EXPECT_EQ(f.metadata(), (SafetensorsMetadata{{"format", "pt"}}));
  EXPECT_EQ(f.size(), 5u);

  b.steps.fill_(0);
  auto report = load_model(b, dir.path().string());
  EXPECT_TRUE(report.ok());
  expect_same_state(a, b);
  // The parameters are still leaves that require grad.
  EXPECT_TRUE(b.fc1->weight.requires_grad());
  EXPECT_TRUE(b.fc1->weight.is_leaf());

  Net c;
  load_model(c, dir.file("model.safetensors"));  // a file path works too
  expect_same_state(a, c);
}

TEST(ModelIo, ShardedRoundTripAndIndex) {
  TempDir dir;
  Net a, b;
  // Sizes in name order: fc1.weight 128, fc1.bias 32, fc2.weight 64, fc2.bias 8, steps 8.
  save_model(a, dir.path().string(), "100B");  // 128 alone (over the limit), 32+64, 8+8
  std::vector<std::string> shards = {"model-00001-of-00003.safetensors",
                                     "model-00002-of-00003.safetensors",
                                     "model-00003-of-00003.safetensors"};
  for (const auto& s : shards) EXPECT_TRUE(fs::exists(dir.path() / s)) << s;
  EXPECT_FALSE(fs::exists(dir.path() / "model.safetensors"));

  auto index = read_json(dir.path() / "model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"], 128 + 32 + 64 + 8 + 8);
  nlohmann::json expected_map = {{"fc1.weight", shards[0]},
                                 {"fc1.bias", shards[1]},
                                 {"fc2.weight", shards[1]},
                                 {"fc2.bias", shards[2]},
                                 {"steps", shards[2]}};
  EXPECT_EQ(index["weight_map"], expected_map);
  // transformers' formatting: indent 2, sorted keys, trailing newline.
  std::string text = tandem_test::read_file(dir.file("model.safetensors.index.json"));
  EXPECT_EQ(text.rfind("{\n  \"metadata\": {\n    \"total_size\": 240\n  },\n", 0), 0u) << text;
  EXPECT_EQ(text.back(), '\n');
  for (const auto& [name, file] : index["weight_map"].items()) {
    SafetensorsFile f(dir.file(file.get<std::string>()));
    EXPECT_TRUE(f.contains(name)) << name;
  }

  auto report = load_model(b, dir.path().string());
  EXPECT_TRUE(report.ok());
  expect_same_state(a, b);
  Net c;
  load_model(c, dir.file("model.safetensors.index.json"));  // the index path works too
  expect_same_state(a, c);
}

TEST(ModelIo, ResavingRemovesStaleFiles) {
  TempDir dir;
  Net a;
  save_model(a, dir.path().string(), "100B");
  EXPECT_TRUE(fs::exists(dir.path() / "model.safetensors.index.json"));
  tandem_test::write_file(dir.file("notes.txt"), "keep me");
  save_model(a, dir.path().string());
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.path())) left.push_back(e.path().filename());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"model.safetensors", "notes.txt"}));
}

TEST(ModelIo, StrictLoadListsEveryProblemAndChangesNothing) {
  struct Other : torch::nn::Module {
    Other() {
      fc1 = register_module("fc1", torch::nn::Linear(4, 6));  // fc1 [6,4] vs [8,4]
      extra = register_parameter("extra", torch::zeros({3}));
    }
    torch::nn::Linear fc1{nullptr};
    torch::Tensor extra;
  };
  TempDir dir;
  Net a;
  save_model(a, dir.path().string());
  Other o;
  auto before = o.fc1->bias.clone();
  auto msg = message_of<std::runtime_error>([&] { load_model(o, dir.path().string()); });
  EXPECT_HAS(msg, "1 missing, 3 unexpected, 2 mismatched");
  EXPECT_HAS(msg, "nothing was loaded");
  EXPECT_HAS(msg, "missing from the checkpoint: extra");
  EXPECT_HAS(msg, "unexpected in the checkpoint: fc2.bias");
  EXPECT_HAS(msg, "unexpected in the checkpoint: fc2.weight");
  EXPECT_HAS(msg, "unexpected in the checkpoint: steps");
  EXPECT_HAS(msg, "mismatched: fc1.weight: checkpoint [8, 4] F32");
  EXPECT_HAS(msg, "model [6, 4] F32");
  EXPECT_HAS(msg, "mismatched: fc1.bias: checkpoint [8] F32");
  EXPECT_HAS(msg, "strict(false)");
  EXPECT_TRUE(torch::equal(o.fc1->bias, before));
}

TEST(ModelIo, NonStrictLoadReportsAndLoadsWhatMatches) {
  struct Partial : torch::nn::Module {
    Partial() {
      fc1 = register_module("fc1", torch::nn::Linear(4, 8));
      fc2 = register_module("fc2", torch::nn::Linear(8, 3));  // fc2 mismatched
      extra = register_buffer("extra", torch::zeros({2}));
    }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
    torch::Tensor extra;
  };
  TempDir dir;
  Net a;
  save_model(a, dir.path().string(), "100B");
  Partial p;
  auto fc2_before = p.fc2->weight.clone();
  auto report = load_model(p, dir.path().string(), LoadOptions().strict(false));
  EXPECT_FALSE(report.ok());
  EXPECT_EQ(report.missing, std::vector<std::string>{"extra"});
  EXPECT_EQ(report.unexpected, std::vector<std::string>{"steps"});
  ASSERT_EQ(report.mismatched.size(), 2u);
  EXPECT_EQ(report.mismatched[0].name, "fc2.weight");
  EXPECT_EQ(report.mismatched[0].checkpoint_shape, (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(report.mismatched[0].model_shape, (std::vector<int64_t>{3, 8}));
  EXPECT_HAS(report.mismatched[0].file, "model-0000");
  EXPECT_EQ(report.mismatched[1].name, "fc2.bias");
  EXPECT_TRUE(torch::equal(p.fc1->weight, a.fc1->weight));
  EXPECT_TRUE(torch::equal(p.fc1->bias, a.fc1->bias));
  EXPECT_TRUE(torch::equal(p.fc2->weight, fc2_before));
  EXPECT_HAS(report.to_string(), "missing from the checkpoint: extra");
}

TEST(ModelIo, DtypeDifferenceIsAMismatchUnlessCastingIsAllowed) {
  TempDir dir;
  Net a;
  save_model(a, dir.path().string());
  Net d;
  d.to(torch::kDouble);
  auto msg = message_of<std::runtime_error>([&] { load_model(d, dir.path().string()); });
  EXPECT_HAS(msg, "mismatched: fc1.weight: checkpoint [8, 4] F32");
  EXPECT_HAS(msg, "model [8, 4] F64");
  EXPECT_HAS(msg, "allow_dtype_cast(true)");

  auto report = load_model(d, dir.path().string(), LoadOptions().allow_dtype_cast(true));
  EXPECT_TRUE(report.ok());
  EXPECT_EQ(d.fc1->weight.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::equal(d.fc1->weight, a.fc1->weight.to(torch::kDouble)));
}

TEST(ModelIo, TiedWeightsAreStoredUnderEachName) {
  struct Head : torch::nn::Module {
    explicit Head(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
    torch::Tensor weight;
  };
  struct Tied : torch::nn::Module {
    Tied() {
      embed = register_module("embed", torch::nn::Linear(4, 4));
      head = register_module("head", std::make_shared<Head>(embed->weight));  // tied
    }
    torch::nn::Linear embed{nullptr};
    std::shared_ptr<Head> head;
  };
  TempDir dir;
  Tied a;
  ASSERT_TRUE(a.head->weight.is_same(a.embed->weight));
  save_model(a, dir.path().string());
  SafetensorsFile f(dir.file("model.safetensors"));
  EXPECT_TRUE(f.contains("embed.weight"));
  EXPECT_TRUE(f.contains("head.weight"));
  EXPECT_TRUE(torch::equal(f.tensor("head.weight"), f.tensor("embed.weight")));

  Tied b;
  EXPECT_TRUE(load_model(b, dir.path().string()).ok());
  EXPECT_TRUE(torch::equal(b.head->weight, a.embed->weight));
  EXPECT_TRUE(b.head->weight.is_same(b.embed->weight));  // still tied

  // A file that stores the tied tensor once (as transformers does) still loads strictly.
  NamedTensors once;
  for (const auto& name : f.names()) {
    if (name != "head.weight") once.emplace_back(name, f.tensor(name));
  }
  save_safetensors(dir.file("once.safetensors"), once);
  Tied c;
  EXPECT_TRUE(load_model(c, dir.file("once.safetensors")).ok());
  EXPECT_TRUE(torch::equal(c.head->weight, a.embed->weight));
}

TEST(ModelIo, BadPathsAndInconsistentIndexes) {
  TempDir dir;
  Net a;
  EXPECT_HAS(message_of<std::runtime_error>([&] { load_model(a, dir.file("none")); }),
             "does not exist");
  EXPECT_HAS(message_of<std::runtime_error>([&] { load_model(a, dir.path().string()); }),
             "holds neither model.safetensors nor model.safetensors.index.json");

  save_model(a, dir.path().string(), "100B");
  auto index_path = dir.path() / "model.safetensors.index.json";
  auto index = read_json(index_path);
  auto good = index;

  index["weight_map"]["fc1.bias"] = "model-00001-of-00003.safetensors";  // wrong shard
  tandem_test::write_file(index_path.string(), index.dump());
  EXPECT_HAS(message_of<std::runtime_error>([&] { load_model(a, dir.path().string()); }),
             "the index and the shards disagree");

  index = good;
  index["weight_map"]["ghost"] = "model-00001-of-00003.safetensors";
  tandem_test::write_file(index_path.string(), index.dump());
  EXPECT_HAS(message_of<std::runtime_error>([&] { load_model(a, dir.path().string()); }),
             "maps 'ghost' to 'model-00001-of-00003.safetensors', which has no such tensor");

  index = good;
  index["weight_map"]["fc1.bias"] = "../elsewhere.safetensors";
  tandem_test::write_file(index_path.string(), index.dump());
  EXPECT_HAS(message_of<std::runtime_error>([&] { load_model(a, dir.path().string()); }),
             "expected a plain file name in the index's directory");

  tandem_test::write_file(index_path.string(), "{\"metadata\": {}}");
  EXPECT_HAS(message_of<std::runtime_error>([&] { load_model(a, dir.path().string()); }),
             "with a \"weight_map\" object");

  EXPECT_HAS(message_of<std::invalid_argument>([&] { save_model(a, dir.path().string(), "0"); }),
             "is zero");
}

TEST(ModelIo, CorruptShardNamesTheFile) {
  TempDir dir;
  Net a;
  save_model(a, dir.path().string());
  std::string path = dir.file("model.safetensors");
  std::string bytes = tandem_test::read_file(path);
  tandem_test::write_file(path, bytes.substr(0, bytes.size() - 1));  // truncated
  auto msg = message_of<SafetensorsError>([&] { load_model(a, dir.path().string()); });
  EXPECT_HAS(msg, path);
}

// ---- merge_weights ----------------------------------------------------------------------------

namespace {

// A save_state() checkpoint of one process holding model.safetensors, with its manifest.
void save_checkpoint(const std::string& dir, const NamedTensors& tensors) {
  StatePart model{"model", [&](StateWriter& w) { w.write_tensors("model.safetensors", tensors); },
                  [](const StateReader&) {}};
  save_training_state(*tandem::ProcessGroup::single(), dir, {model});
}

// One tp rank's model.mp<r> file: w is split by rows, c by columns, b is replicated.
struct TpCheckpoint {
  TempDir dir;
  torch::Tensor w = torch::arange(24, torch::kFloat).reshape({6, 4});
  torch::Tensor c = torch::arange(12, torch::kFloat).reshape({3, 4});
  torch::Tensor b = torch::arange(3, torch::kFloat);

  SafetensorsMetadata meta(int rank, const std::string& split = R"({"c":"cols","w":"rows/1"})") {
    return {{"format", "pt"},
            {"tandem_tp_rank", std::to_string(rank)},
            {"tandem_tp_size", "2"},
            {"tandem_tp_split", split}};
  }
  std::string file(int rank) const {
    return dir.file("model.mp" + std::to_string(rank) + ".safetensors");
  }
  void write(int rank, const SafetensorsMetadata& metadata) {
    save_safetensors(file(rank),
                     {{"w", w.chunk(2, 0)[rank].contiguous()},
                      {"c", c.chunk(2, 1)[rank].contiguous()},
                      {"b", b}},
                     metadata);
  }
  // The error of merging with rank 1's metadata replaced by `metadata` (and rank 0's by
  // `metadata0`, when given); it names the file of rank `named`.
  std::string error_with(const SafetensorsMetadata& metadata,
                         const std::optional<SafetensorsMetadata>& metadata0 = {}, int named = 1) {
    write(0, metadata0 ? *metadata0 : meta(0));
    write(1, metadata);
    const std::string out = dir.file("merged");
    auto msg = message_of<std::runtime_error>([&] { merge_weights(dir.path().string(), out); });
    EXPECT_FALSE(fs::exists(out + "/model.safetensors")) << "a refused merge wrote its output";
    EXPECT_EQ(msg.rfind("merge_weights: " + file(named) + ": ", 0), 0u) << msg;
    return msg;
  }
};

}  // namespace

// merge-weights verifies a save_state() checkpoint against its manifest, as load_state does: a
// flipped data byte or a truncated file is refused naming the file, and nothing is written.
TEST(MergeWeights, VerifiesTheManifestOfASavedState) {
  TempDir dir;
  const std::string ckpt = dir.file("checkpoint_0"), out = dir.file("merged");
  save_checkpoint(ckpt, {{"w", torch::arange(16, torch::kFloat)}});
  auto report = merge_weights(ckpt, out);
  EXPECT_EQ(report.tensors, 1u);
  fs::remove_all(out);

  const std::string model = ckpt + "/model.safetensors";
  std::string bytes = tandem_test::read_file(model);
  std::string flipped = bytes;
  flipped[flipped.size() - 3] ^= 0x01;  // a data byte: the header still parses
  tandem_test::write_file(model, flipped);
  auto msg = message_of<std::runtime_error>([&] { merge_weights(ckpt, out); });
  EXPECT_EQ(
      msg.rfind("merge_weights: " + model + " does not match its checksum in manifest.json", 0), 0u)
      << msg;
  EXPECT_HAS(msg, "restore it from a copy or use another checkpoint");
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  // The file given directly is verified too, against the manifest beside it.
  EXPECT_HAS(message_of<std::runtime_error>([&] { merge_weights(model, out); }),
             "does not match its checksum");

  tandem_test::write_file(model, bytes.substr(0, bytes.size() - 4));
  EXPECT_HAS(message_of<std::runtime_error>([&] { merge_weights(ckpt, out); }),
             model + " has " + std::to_string(bytes.size() - 4) + " bytes, the manifest says " +
                 std::to_string(bytes.size()));

  // A model file the manifest does not list is not part of the checkpoint.
  tandem_test::write_file(model, bytes);
  save_safetensors(ckpt + "/model.mp0.safetensors", {{"w", torch::ones({2})}});
  EXPECT_HAS(message_of<std::runtime_error>([&] { merge_weights(ckpt, out); }),
             ckpt + "/model.mp0.safetensors is not listed in manifest.json");
}

// A manifest or state.json nested too deep is refused before it is parsed (Note [JSON depth
// limit]), by load_state's reader and so by merge-weights.
TEST(MergeWeights, DeeplyNestedManifestIsRefused) {
  TempDir dir;
  const std::string ckpt = dir.file("checkpoint_0");
  save_checkpoint(ckpt, {{"w", torch::ones({2})}});
  tandem_test::write_file(ckpt + "/manifest.json", "{\"files\":" + std::string(300'000, '[') +
                                                       std::string(300'000, ']') + "}");
  auto msg = message_of<std::runtime_error>([&] { merge_weights(ckpt, dir.file("merged")); });
  EXPECT_EQ(
      msg.rfind("merge_weights: " + ckpt + "/manifest.json nests arrays and objects 300001 deep",
                0),
      0u)
      << msg;
  EXPECT_HAS(msg, "more than the limit of 64");
  msg = message_of<std::runtime_error>([&] { StateReader(ckpt, "[rank 0/1]"); });
  EXPECT_EQ(msg.rfind("[rank 0/1] load_state: " + ckpt + "/manifest.json nests", 0), 0u) << msg;

  tandem_test::write_file(ckpt + "/manifest.json", R"({"files": {"state.json": 3}})");
  EXPECT_HAS(message_of<std::runtime_error>([&] { StateReader(ckpt, "[rank 0/1]"); }),
             "the entry of 'state.json' is 3, expected {\"size\": <bytes>, \"xxh64\": \"<hex>\"}");
}

// The shards of a tensor-parallel checkpoint join into the dense tensors.
TEST(MergeWeights, JoinsTensorParallelShards) {
  TpCheckpoint t;
  t.write(0, t.meta(0));
  t.write(1, t.meta(1));
  const std::string out = t.dir.file("merged");
  auto report = merge_weights(t.dir.path().string(), out);
  EXPECT_EQ(report.sources, 2u);
  SafetensorsFile merged(out + "/model.safetensors");
  EXPECT_TRUE(torch::equal(merged.tensor("w"), t.w));
  EXPECT_TRUE(torch::equal(merged.tensor("c"), t.c));
  EXPECT_TRUE(torch::equal(merged.tensor("b"), t.b));
}

// Every bad tensor-parallel metadata value is refused naming the file, the key and the value;
// before, rows/0 and rows/7 wrote a truncated file and tp_size "abc" said only "stoi".
TEST(MergeWeights, RefusesBadTensorParallelMetadata) {
  TpCheckpoint t;
  auto meta = [&](const std::string& key, const std::string& value) {
    auto m = t.meta(1);
    m[key] = value;
    return m;
  };
  auto msg = t.error_with(meta("tandem_tp_split", R"({"c":"cols","w":"rows/0"})"));
  EXPECT_HAS(msg,
             "metadata \"tandem_tp_split\" gives tensor 'w' the split \"rows/0\", expected "
             "\"cols\" or \"rows/<parts>\" with <parts> a positive integer");
  EXPECT_HAS(msg, "save the checkpoint again");

  const std::string seven = R"({"c":"cols","w":"rows/7"})";
  auto seven0 = t.meta(0);
  seven0["tandem_tp_split"] = seven;
  msg = t.error_with(meta("tandem_tp_split", seven), seven0, 0);
  EXPECT_HAS(msg,
             "metadata \"tandem_tp_split\" gives tensor 'w' the split \"rows/7\", but its "
             "shard is F32 [3, 4]: 3 rows do not divide into 7 equal parts");

  msg = t.error_with(meta("tandem_tp_size", "abc"));
  EXPECT_HAS(msg,
             "metadata \"tandem_tp_size\" is \"abc\", expected the number of "
             "tensor-parallel ranks, an integer from 1 to 65536");
  EXPECT_EQ(msg.find("stoi"), std::string::npos) << msg;

  msg = t.error_with(meta("tandem_tp_size", "3"));
  EXPECT_HAS(msg, "metadata \"tandem_tp_size\" is \"3\", but in " + t.file(0) + " it is \"2\"");
  auto none = t.meta(1);
  for (const char* key : {"tandem_tp_size", "tandem_tp_rank", "tandem_tp_split"}) none.erase(key);
  EXPECT_HAS(t.error_with(none), "metadata \"tandem_tp_size\" is absent, but in");

  msg = t.error_with(meta("tandem_tp_rank", "2"));
  EXPECT_HAS(msg,
             "metadata \"tandem_tp_rank\" is \"2\", expected this file's tensor-parallel "
             "rank, an integer from 0 to 1");
  EXPECT_HAS(t.error_with(meta("tandem_tp_rank", "-1")), "\"tandem_tp_rank\" is \"-1\"");

  msg = t.error_with(meta("tandem_tp_split", "{\"w\": 12"));
  EXPECT_HAS(msg, "metadata \"tandem_tp_split\" is \"{\"w\": 12\", expected a JSON object");
  EXPECT_HAS(t.error_with(meta("tandem_tp_split", R"(["w"])")),
             "metadata \"tandem_tp_split\" is \"[\"w\"]\", expected a JSON object");
  EXPECT_HAS(t.error_with(meta("tandem_tp_split", R"({"c":"cols","w":2})")),
             "gives tensor 'w' the split 2, expected");
  EXPECT_HAS(t.error_with(meta("tandem_tp_split", R"({"c":"cols","w":"rows/x"})")),
             "the split \"rows/x\"");
  EXPECT_HAS(t.error_with(meta("tandem_tp_split", R"({"c":"cols","w":"cols"})")),
             "gives tensor 'w' the split \"cols\", but " + t.file(0) + " gives \"rows/1\"");
  // A value nested 70,000 deep is refused before it is parsed (Note [JSON depth limit]).
  msg = t.error_with(meta("tandem_tp_split", std::string(70'000, '[') + std::string(70'000, ']')));
  EXPECT_HAS(msg, "metadata \"tandem_tp_split\" is \"[[[");
  EXPECT_HAS(msg, "(the value nests arrays and objects 70000 deep");

  auto without = t.meta(1);
  without.erase("tandem_tp_rank");
  EXPECT_HAS(t.error_with(without),
             "the metadata has \"tandem_tp_size\" but no \"tandem_tp_rank\"");
}

// Shards whose shapes do not fit together are refused before anything is joined.
TEST(MergeWeights, RefusesShardsThatDoNotFit) {
  TpCheckpoint t;
  t.write(0, t.meta(0));
  save_safetensors(
      t.file(1), {{"w", torch::zeros({3, 5})}, {"c", t.c.chunk(2, 1)[1].contiguous()}, {"b", t.b}},
      t.meta(1));
  auto msg = message_of<std::runtime_error>(
      [&] { merge_weights(t.dir.path().string(), t.dir.file("merged")); });
  EXPECT_HAS(msg, "the shards of 'w' (split \"rows/1\") disagree in dimension 1: F32 [3, 4] in " +
                      t.file(0) + ", F32 [3, 5] in " + t.file(1));

  save_safetensors(t.file(1),
                   {{"w", t.w.chunk(2, 0)[1].contiguous()},
                    {"c", t.c.chunk(2, 1)[1].contiguous()},
                    {"b", torch::zeros({4})}},
                   t.meta(1));
  msg = message_of<std::runtime_error>(
      [&] { merge_weights(t.dir.path().string(), t.dir.file("merged")); });
  EXPECT_HAS(msg, "tensor 'b' is F32 [3] in " + t.file(0) + " but F32 [4] in " + t.file(1) +
                      ", and no file's metadata \"tandem_tp_split\" names it");
  EXPECT_FALSE(fs::exists(t.dir.file("merged") + "/model.safetensors"));
}
