// Memory estimates against hand-computed numbers, the ZeRO paper's example, and safetensors
// headers written byte by byte here.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>

#include "tandem/track/memory_estimate.h"
#include "../common/temp_dir.h"

namespace fs = std::filesystem;
using namespace tandem::track;
using tandem::testing::TempDir;

namespace {

// A safetensors file: 8-byte little-endian header length, the JSON header (space-padded to a
// multiple of 8, as the format's writers do), then zeroed tensor data of the declared size.
void write_safetensors(const fs::path& path, const nlohmann::json& tensors) {
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}}}};
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors.items()) {
    uint64_t n = 1;
    for (auto d : t["shape"]) n *= d.get<uint64_t>();
    uint64_t bytes = n * (t["dtype"] == "F32" ? 4 : 2);
    header[name] = {{"dtype", t["dtype"]}, {"shape", t["shape"]}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8) text += ' ';
  std::ofstream out(path, std::ios::binary);
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xFF));
  out << text << std::string(offset, '\0');
}

}  // namespace

TEST(MemoryEstimate, GptParameterCountByHand) {
  // layers 4, hidden 128, vocab 256, context 128:
  //   token embedding     256 * 128                  =  32,768
  //   position embedding  128 * 128                  =  16,384
  //   per block  12 * 128^2 + 13 * 128 = 196,608 + 1,664 = 198,272
  //     (qkv 3*16,384 + 384, proj 16,384 + 128, MLP 65,536 + 512 and 65,536 + 128,
  //      two LayerNorms 256 + 256)
  //   4 blocks                                        = 793,088
  //   final LayerNorm 2 * 128                         =     256
  //   output head: tied to the token embedding        =       0
  //   total                                           = 842,496
  auto m = count_gpt_parameters({4, 128, 256, 128});
  EXPECT_EQ(m.num_parameters, 842'496);
  EXPECT_EQ(m.largest_layer_parameters, 198'272);
  EXPECT_EQ(m.largest_layer_name, "transformer block");
  bool tied_note = false;
  for (const auto& n : m.notes) tied_note |= n.find("tied") != std::string::npos;
  EXPECT_TRUE(tied_note);

  // GPT-2 small, whose published count is 124,439,808; its largest layer is the embedding.
  auto gpt2 = count_gpt_parameters({12, 768, 50257, 1024});
  EXPECT_EQ(gpt2.num_parameters, 124'439'808);
  EXPECT_EQ(gpt2.largest_layer_parameters, 50257 * 768);
  EXPECT_EQ(gpt2.largest_layer_name, "token embedding");

  EXPECT_THROW(count_gpt_parameters({0, 128, 256, 128}), std::invalid_argument);
}

TEST(MemoryEstimate, ParameterCountSpellings) {
  EXPECT_EQ(parse_parameter_count("125M"), 125'000'000);
  EXPECT_EQ(parse_parameter_count("7.5B"), 7'500'000'000);
  EXPECT_EQ(parse_parameter_count("7.5b"), 7'500'000'000);
  EXPECT_EQ(parse_parameter_count("1e9"), 1'000'000'000);
  EXPECT_EQ(parse_parameter_count("350k"), 350'000);
  EXPECT_EQ(parse_parameter_count("1.2T"), 1'200'000'000'000);
  EXPECT_EQ(parse_parameter_count("1_000_000"), 1'000'000);
  EXPECT_EQ(parse_parameter_count("70G"), 70'000'000'000);
  for (const char* bad : {"", "B", "abc", "-5", "7.5X", "1e400", "0"}) {
    try {
      parse_parameter_count(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("7.5B"), std::string::npos);  // says what is expected
    }
  }
}

TEST(MemoryEstimate, ZeroPaperExample) {
  // ZeRO paper, Figure 1: Psi = 7.5B, N_d = 64, K = 12.
  auto e = estimate_memory(model_size_from_count(parse_parameter_count("7.5B")), 64);
  ASSERT_EQ(e.zero.size(), 4u);
  EXPECT_DOUBLE_EQ(e.zero[0].bytes_per_device, 120e9);        // 16 * 7.5e9
  EXPECT_DOUBLE_EQ(e.zero[1].bytes_per_device, 31.40625e9);   // 4 * 7.5e9 + 12 * 7.5e9 / 64
  EXPECT_DOUBLE_EQ(e.zero[2].bytes_per_device, 16.640625e9);  // 2 * 7.5e9 + 14 * 7.5e9 / 64
  EXPECT_DOUBLE_EQ(e.zero[3].bytes_per_device, 1.875e9);      // 16 * 7.5e9 / 64
  EXPECT_EQ(format_bytes(e.zero[0].bytes_per_device), "120 GB");
  EXPECT_EQ(format_bytes(e.zero[1].bytes_per_device), "31.4 GB");
  EXPECT_EQ(format_bytes(e.zero[2].bytes_per_device), "16.6 GB");
  EXPECT_EQ(format_bytes(e.zero[3].bytes_per_device), "1.9 GB");
  EXPECT_EQ(e.zero[0].id, "ddp");
  EXPECT_EQ(e.zero[3].id, "zero3");
  // tandem's own strategies on fp32 weights (Note [One memory model], which the memory tests
  // hold to measured peaks): 25 MiB buckets; the largest layer is unknown from a bare count
  // (G = U = 0).
  const double bucket = 25.0 * (1 << 20);
  EXPECT_DOUBLE_EQ(default_bucket_bytes(7.5e9), bucket);
  EXPECT_DOUBLE_EQ(default_bucket_bytes(1000), 4000);  // a model smaller than a bucket
  ASSERT_EQ(e.tandem_fp32.size(), 4u);
  EXPECT_DOUBLE_EQ(e.tandem_fp32[0].bytes_per_device, 20 * 7.5e9);
  EXPECT_DOUBLE_EQ(e.tandem_fp32[1].bytes_per_device, 8 * 7.5e9 + 8 * 7.5e9 / 64 + 2 * bucket);
  EXPECT_DOUBLE_EQ(e.tandem_fp32[2].bytes_per_device, 4 * 7.5e9 + 12 * 7.5e9 / 64 + 2 * bucket);
  EXPECT_DOUBLE_EQ(e.tandem_fp32[3].bytes_per_device, 16 * 7.5e9 / 64);
  EXPECT_EQ(e.tandem_fp32[2].formula, "4P + 12P/W + 2B + 4G");
  EXPECT_THROW(strategy_memory(4, 1, 1, 1, 1, 1), std::invalid_argument);

  std::string text = format_memory_estimate(e);
  for (const char* s : {"7,500,000,000", "120 GB", "31.4 GB", "16.6 GB", "1.9 GB", "K = 12",
                        "activations", "fragmentation", "10^9"}) {
    EXPECT_NE(text.find(s), std::string::npos) << s << "\n" << text;
  }
  auto j = nlohmann::json::parse(memory_estimate_to_json(e));
  EXPECT_EQ(j["parameters"], 7'500'000'000);
  EXPECT_EQ(j["num_processes"], 64);
  EXPECT_DOUBLE_EQ(j["zero"][1]["gb_per_device"].get<double>(), 31.40625);

  EXPECT_THROW(estimate_memory(model_size_from_count(100), 0), std::invalid_argument);
}

TEST(MemoryEstimate, PerDtypeRows) {
  auto e = estimate_memory(count_gpt_parameters({4, 128, 256, 128}), 1);
  const double p = 842'496;
  ASSERT_EQ(e.dtypes.size(), 4u);
  EXPECT_EQ(e.dtypes[0].dtype, "float32");
  EXPECT_DOUBLE_EQ(e.dtypes[0].total_bytes, 4 * p);
  EXPECT_DOUBLE_EQ(e.dtypes[0].largest_layer_bytes, 4 * 198'272.0);
  EXPECT_DOUBLE_EQ(e.dtypes[0].training_adam_bytes, 16 * p);  // Accelerate's 4 x model size
  EXPECT_DOUBLE_EQ(e.dtypes[1].training_adam_bytes, 12 * p);  // 2 + 2 + 4 + 4
  EXPECT_DOUBLE_EQ(e.dtypes[2].total_bytes, p);
  EXPECT_DOUBLE_EQ(e.dtypes[3].total_bytes, p / 2);
  // One device: every ZeRO stage equals DDP.
  for (const auto& z : e.zero) EXPECT_DOUBLE_EQ(z.bytes_per_device, 16 * p);

  auto some = estimate_memory(count_gpt_parameters({4, 128, 256, 128}), 2, {"bf16", "int4"});
  ASSERT_EQ(some.dtypes.size(), 2u);
  EXPECT_EQ(some.dtypes[0].dtype, "float16/bfloat16");
  EXPECT_EQ(some.dtypes[1].dtype, "int4");
  EXPECT_THROW(estimate_memory(model_size_from_count(10), 1, {"float64"}), std::invalid_argument);
}

TEST(MemoryEstimate, SafetensorsHeaderFile) {
  TempDir dir;
  nlohmann::json tensors = {
      {"wte.weight", {{"dtype", "F32"}, {"shape", {256, 128}}}},             // 32,768
      {"h.0.attn.c_attn.weight", {{"dtype", "F32"}, {"shape", {128, 384}}}},  // 49,152
      {"h.0.attn.c_attn.bias", {{"dtype", "F32"}, {"shape", {384}}}},         //    384
      {"h.1.mlp.c_fc.weight", {{"dtype", "BF16"}, {"shape", {128, 512}}}},    // 65,536
      {"ln_f.weight", {{"dtype", "F32"}, {"shape", {128}}}},                  //    128
  };
  write_safetensors(dir.path / "model.safetensors", tensors);
  auto m = read_safetensors_model_size((dir.path / "model.safetensors").string());
  EXPECT_EQ(m.num_parameters, 32'768 + 49'152 + 384 + 65'536 + 128);
  EXPECT_EQ(m.largest_layer_name, "h.1");
  EXPECT_EQ(m.largest_layer_parameters, 65'536);
  EXPECT_EQ(m.stored_dtypes.at("BF16"), 65'536);
  EXPECT_EQ(m.stored_dtypes.at("F32"), 32'768 + 49'152 + 384 + 128);
  // The folder works too.
  EXPECT_EQ(read_safetensors_model_size(dir.str()).num_parameters, m.num_parameters);
  // And a header validated by the checkpoint parser.
  std::string json =
      R"({"a.weight": {"dtype": "F16", "shape": [3, 4], "data_offsets": [0, 24]}, "b": {"dtype": "F16", "shape": [], "data_offsets": [24, 26]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((json.size() >> (8 * i)) & 0xFF);
  file += json + std::string(26, '\0');
  auto from_text = model_size_from_safetensors_header(
      tandem::checkpoint::parse_safetensors_header(file, file.size(), "t"));
  EXPECT_EQ(from_text.num_parameters, 13);
  EXPECT_EQ(from_text.largest_layer_name, "a");
}

TEST(MemoryEstimate, SafetensorsIndexWithShards) {
  TempDir dir;
  // Block 0 is split over both shards: its parts add up before the largest layer is chosen.
  write_safetensors(dir.path / "model-00001-of-00002.safetensors",
                    {{"model.layers.0.q.weight", {{"dtype", "F32"}, {"shape", {64, 64}}}},
                     {"model.embed.weight", {{"dtype", "F32"}, {"shape", {100, 64}}}}});
  write_safetensors(dir.path / "model-00002-of-00002.safetensors",
                    {{"model.layers.0.k.weight", {{"dtype", "F32"}, {"shape", {64, 64}}}},
                     {"model.layers.1.q.weight", {{"dtype", "F32"}, {"shape", {64, 64}}}}});
  nlohmann::json index = {
      {"metadata", {{"total_size", 0}}},
      {"weight_map",
       {{"model.layers.0.q.weight", "model-00001-of-00002.safetensors"},
        {"model.embed.weight", "model-00001-of-00002.safetensors"},
        {"model.layers.0.k.weight", "model-00002-of-00002.safetensors"},
        {"model.layers.1.q.weight", "model-00002-of-00002.safetensors"}}}};
  std::ofstream(dir.path / "model.safetensors.index.json") << index.dump();
  auto m = read_safetensors_model_size((dir.path / "model.safetensors.index.json").string());
  EXPECT_EQ(m.num_parameters, 3 * 4096 + 6400);
  EXPECT_EQ(m.largest_layer_name, "model.layers.0");
  EXPECT_EQ(m.largest_layer_parameters, 8192);
  EXPECT_EQ(read_safetensors_model_size(dir.str()).num_parameters, m.num_parameters);

  fs::remove(dir.path / "model-00002-of-00002.safetensors");
  try {
    read_safetensors_model_size((dir.path / "model.safetensors.index.json").string());
    FAIL() << "expected an error for the missing shard";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("model-00002-of-00002.safetensors"), std::string::npos)
        << e.what();
  }
}

// Note [One safetensors parser]: files that only the validating parser refuses (overlapping
// tensors, offsets past the end, a byte count that does not match the shape, an index entry with
// a path) are refused by estimate-memory too, with the parser's message.
TEST(MemoryEstimate, MalformedFilesGoThroughTheCheckpointParser) {
  TempDir dir;
  auto write_raw = [&](const std::string& name, const std::string& json, size_t data) {
    std::string text = json;
    while (text.size() % 8) text += ' ';
    std::ofstream out(dir.path / name, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((text.size() >> (8 * i)) & 0xFF));
    out << text << std::string(data, '\0');
  };
  auto error_of = [&](const std::string& name) -> std::string {
    try {
      read_safetensors_model_size((dir.path / name).string());
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "";
  };
  write_raw("overlap.safetensors",
            R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
            R"( "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
            24);
  write_raw("past_end.safetensors",
            R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8);
  write_raw("bad_size.safetensors",
            R"({"a": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}})", 16);
  write_raw("bad_dtype.safetensors",
            R"({"a": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}})", 16);
  for (const char* f : {"overlap.safetensors", "past_end.safetensors", "bad_size.safetensors",
                        "bad_dtype.safetensors"}) {
    auto e = error_of(f);
    EXPECT_NE(e.find("safetensors file '"), std::string::npos) << f << ": " << e;
    EXPECT_NE(e.find(f), std::string::npos) << e;
  }
  write_raw("ok.safetensors", R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
            16);
  std::ofstream(dir.path / "escape.index.json")
      << R"({"weight_map": {"a": "../ok.safetensors"}})";
  auto e = error_of("escape.index.json");
  EXPECT_NE(e.find("safetensors index '"), std::string::npos) << e;
  EXPECT_NE(e.find("plain file name"), std::string::npos) << e;
  std::ofstream(dir.path / "list.index.json") << R"({"weight_map": ["ok.safetensors"]})";
  EXPECT_NE(error_of("list.index.json").find("\"weight_map\" object"), std::string::npos);
  std::ofstream(dir.path / "good.index.json")
      << R"({"metadata": {"total_size": 16}, "weight_map": {"a": "ok.safetensors"}})";
  EXPECT_EQ(read_safetensors_model_size((dir.path / "good.index.json").string()).num_parameters, 4);
}

TEST(MemoryEstimate, NotASafetensorsFile) {
  TempDir dir;
  std::ofstream(dir.path / "x.safetensors") << "this is not a checkpoint at all";
  try {
    read_safetensors_model_size((dir.path / "x.safetensors").string());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("safetensors"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_safetensors_model_size((dir.path / "missing.safetensors").string()),
               std::runtime_error);
}
