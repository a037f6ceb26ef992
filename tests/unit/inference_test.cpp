// Big-model inference in one process: device-map planning (Accelerate's policies), empty
// weights, dispatch with disk offload against the model in memory, weight-only quantization
// against the float layers, and causal attention with a cache against the full computation.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "../../examples/common/gpt2.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/error.h"
#include "tandem/inference/device_map.h"
#include "tandem/inference/dispatch.h"
#include "tandem/inference/quantize.h"
#include "tandem/nn/layers.h"

namespace {

namespace fs = std::filesystem;
using namespace tandem::inference;

examples::GPT2Config tiny() {
  examples::GPT2Config c;
  c.vocab_size = 97;
  c.n_positions = 32;
  c.n_embd = 64;
  c.n_layer = 4;
  c.n_head = 4;
  return c;
}

fs::path temp_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("tandem-inference-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

torch::Tensor ids() { return torch::tensor({{3, 14, 15, 92, 65, 35}}, torch::kLong); }

TEST(DeviceMap, FillsDevicesInOrderSplitsWhatDoesNotFitAndKeepsTiedModulesTogether) {
  // root -> a (10), b (splittable: b.0 = 6, b.1 = 6), c (4, tied with a).
  std::vector<ModuleSize> m(6);
  m[0] = {"", 0, 26, {1, 2, 5}, true, {}};
  m[1] = {"a", 10, 10, {}, true, {5}};
  m[2] = {"b", 0, 12, {3, 4}, true, {}};
  m[3] = {"b.0", 6, 6, {}, true, {}};
  m[4] = {"b.1", 6, 6, {}, true, {}};
  m[5] = {"c", 4, 4, {}, true, {1}};
  // Everything fits on cuda:0.
  auto all = plan_device_map(m, {"cuda:0", "cpu"}, {{"cuda:0", 100}, {"cpu", 100}});
  EXPECT_EQ(all, (DeviceMap{{"a", "cuda:0"}, {"c", "cuda:0"}, {"b", "cuda:0"}}));
  // cuda:0 holds 20: a with its tied c (14), then b does not fit and is split; b.0 fits (20).
  auto split = plan_device_map(m, {"cuda:0", "cpu"}, {{"cuda:0", 20}, {"cpu", 100}});
  EXPECT_EQ(split, (DeviceMap{{"a", "cuda:0"}, {"c", "cuda:0"}, {"b.0", "cuda:0"}, {"b.1", "cpu"}}));
  // Not everything fits (26 > 25): room for the largest module still to place (b.0 or b.1: 6)
  // is kept on the CPU. a with c (14) fits in 25 - 6; b.0 after them (20) not in 25 - 6 (b.1
  // left): the rest goes to disk.
  auto disk = plan_device_map(m, {"cpu"}, {{"cpu", 25}});
  EXPECT_EQ(disk, (DeviceMap{{"a", "cpu"}, {"c", "cpu"}, {"b.0", "disk"}, {"b.1", "disk"}}));
  // With 16, a and c (14) would fit, but not beside the 6 kept for a block on disk.
  EXPECT_EQ(plan_device_map(m, {"cpu"}, {{"cpu", 16}})[0], (Placement{"a", "disk"}));
  EXPECT_EQ(plan_device_map(m, {"cpu"}, {{"cpu", 20}})[0], (Placement{"a", "cpu"}));
  EXPECT_THROW(plan_device_map(m, {"cpu"}, {{"cpu", 5}}, /*allow_disk=*/false), std::runtime_error);
}

TEST(DeviceMap, BalancedMemorySpreadsTheModelAndLowZeroSparesTheFirstDevice) {
  MaxMemory mem{{"cuda:0", 100}, {"cuda:1", 100}, {"cpu", 1000}};
  auto b = balanced_memory(mem, 100, 10, false);
  EXPECT_EQ(b.at("cuda:0"), 60u);
  EXPECT_EQ(b.at("cuda:1"), 60u);
  EXPECT_EQ(b.at("cpu"), 1000u);
  auto low = balanced_memory(mem, 100, 10, true);
  EXPECT_EQ(low.at("cuda:1"), 100u);
  EXPECT_EQ(low.at("cuda:0"), 10u);
}

TEST(DeviceMap, ParsesMaxMemoryAndRefusesWhatItCannotRead) {
  EXPECT_EQ(parse_max_memory("64MB"), (MaxMemory{{"cpu", 64'000'000}}));
  EXPECT_EQ(parse_max_memory("cuda:0=1GiB,cpu=2GB"),
            (MaxMemory{{"cuda:0", 1ull << 30}, {"cpu", 2'000'000'000}}));
  for (const char* bad : {"", "tpu=1GB", "cuda:x=1GB", "cpu=lots", "1GB,,"})
    EXPECT_THROW(parse_max_memory(bad), std::invalid_argument) << bad;
}

TEST(DeviceMap, InfersBlocksOfAGPT2AndKeepsTheTiedHeadWithTheEmbedding) {
  auto model = init_empty_weights([] { return examples::GPT2LMHeadModel(tiny()); });
  // Budget for the embeddings and two blocks: the rest goes to disk, whole blocks at a time.
  uint64_t block = 0;
  for (const auto& p : model->transformer->blocks[0]->parameters()) block += p.numel() * 4;
  const uint64_t emb = (97 + 32) * 64 * 4;
  auto map = infer_device_map(*model, DeviceMapOptions().max_memory({{"cpu", emb + 3 * block}}));
  std::map<std::string, std::string> where;
  for (const auto& p : map) where[p.module] = p.device;
  EXPECT_EQ(where["transformer.wte"], "cpu");
  EXPECT_EQ(where["lm_head"], "cpu");  // tied: with the token embedding
  EXPECT_EQ(where["transformer.h.0"], "cpu");
  EXPECT_EQ(where["transformer.h.1"], "cpu");
  EXPECT_EQ(where["transformer.h.3"], "disk");
  for (const auto& p : map)  // blocks are never split
    EXPECT_EQ(p.module.find("attn"), std::string::npos) << p.module;
  EXPECT_THROW(infer_device_map(*model, DeviceMapOptions().policy("fastest")), std::invalid_argument);
}

TEST(EmptyWeights, KeepShapesAndHoldNoBytes) {
  auto model = init_empty_weights([] { return examples::GPT2LMHeadModel(tiny()); });
  for (const auto& p : model->named_parameters()) {
    EXPECT_TRUE(is_empty_weight(p.value())) << p.key();
    EXPECT_GT(p.value().numel(), 0);
  }
  EXPECT_EQ(model->transformer->h[0]->named_parameters()["attn.c_attn.weight"].sizes(),
            (std::vector<int64_t>{64, 192}));
}

// A model in memory, saved; then the same checkpoint loaded with every block on disk.
struct Saved {
  fs::path dir;
  examples::GPT2LMHeadModel dense{nullptr};
};

Saved save_tiny(const std::string& name) {
  torch::manual_seed(7);
  Saved s{temp_dir(name), examples::GPT2LMHeadModel(tiny())};
  {
    torch::NoGradGuard g;
    for (auto& p : s.dense->parameters()) p.normal_(0.0, 0.2);  // biases and norms too
  }
  s.dense->eval();
  tandem::checkpoint::save_model(*s.dense, s.dir.string());
  return s;
}

TEST(Dispatch, DiskOffloadGivesTheLogitsOfTheModelInMemory) {
  auto saved = save_tiny("disk");
  auto want = saved.dense(ids());
  for (bool prefetch : {true, false}) {
    auto model = init_empty_weights([] { return examples::GPT2LMHeadModel(tiny()); });
    model->eval();
    DeviceMap map{{"transformer.wte", "cpu"}, {"transformer.wpe", "cpu"},
                  {"transformer.h.0", "cpu"}, {"transformer.h.1", "disk"},
                  {"transformer.h.2", "disk"}, {"transformer.h.3", "disk"},
                  {"transformer.ln_f", "cpu"}, {"lm_head", "cpu"}};
    auto placed = load_checkpoint_and_dispatch(*model, saved.dir.string(), map,
                                               DispatchOptions().prefetch(prefetch));
    EXPECT_TRUE(is_empty_weight(model->transformer->blocks[2]->ln_1->weight));
    EXPECT_FALSE(is_empty_weight(model->transformer->blocks[0]->ln_1->weight));
    torch::NoGradGuard g;
    for (int round = 0; round < 3; ++round) {
      auto got = model(ids());
      EXPECT_TRUE(torch::equal(got, want)) << "prefetch " << prefetch << " round " << round;
    }
    EXPECT_TRUE(is_empty_weight(model->transformer->blocks[2]->ln_1->weight));
    const auto s = placed->stats();
    EXPECT_EQ(s.loads, 9);
    if (prefetch) {  // the order is learned in the first round, then every read is ahead
      EXPECT_EQ(s.loads_read_ahead, 5);
    } else {
      EXPECT_EQ(s.loads_read_ahead, 0);
    }
    EXPECT_NE(placed->summary().find("disk"), std::string::npos) << placed->summary();
    EXPECT_EQ(placed->bytes_by_place().at("disk"), 3 * placed->largest_offloaded_bytes());
  }
}

TEST(Dispatch, AModelInMemoryGoesToDiskThroughTheOffloadDir) {
  auto saved = save_tiny("offload-dir");
  auto want = saved.dense(ids());
  DeviceMap map{{"transformer.wte", "cpu"}, {"transformer.wpe", "cpu"}, {"transformer.h", "disk"},
         {"transformer.ln_f", "cpu"}, {"lm_head", "cpu"}};
  // transformer.h is a ModuleList (not hookable): refused, naming the fix.
  try {
    dispatch(*saved.dense, map);
    FAIL() << "a disk placement of a module that is not hookable was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("TANDEM_MODULE"), std::string::npos) << e.what();
  }
  map = {{"transformer.wte", "cpu"}, {"transformer.wpe", "cpu"}, {"transformer.h.0", "disk"},
         {"transformer.h.1", "cpu"},  {"transformer.h.2", "cpu"},  {"transformer.h.3", "disk"},
         {"transformer.ln_f", "cpu"}, {"lm_head", "cpu"}};
  EXPECT_THROW(dispatch(*saved.dense, map), std::invalid_argument);  // no offload_dir
  auto off = saved.dir / "offload";
  auto placed = dispatch(*saved.dense, map, DispatchOptions().offload_dir(off.string()));
  EXPECT_TRUE(fs::exists(off / "transformer.h.0.safetensors"));
  torch::NoGradGuard g;
  EXPECT_TRUE(torch::equal(saved.dense(ids()), want));
}

TEST(Dispatch, RefusesMapsThatDoNotCoverTheModelOrSplitTiedWeights) {
  auto saved = save_tiny("refusals");
  auto expect_refusal = [&](const DeviceMap& map, const std::string& words) {
    try {
      dispatch(*saved.dense, map);
      ADD_FAILURE() << "accepted: " << describe_device_map(map);
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_refusal({{"transformer.nope", "cpu"}}, "does not have");
  expect_refusal({{"transformer", "cpu"}}, "under no placement");
  expect_refusal({{"transformer", "cpu"}, {"lm_head", "cuda:0"}}, "tied");
  expect_refusal({{"", "tpu"}}, "places are");
}

TEST(Quantize, Int8AndInt4StayWithinHalfAStepOfTheWeights) {
  torch::manual_seed(3);
  auto w = torch::randn({48, 128});
  auto q8 = quantize_int8(w);
  EXPECT_EQ(q8.values.scalar_type(), torch::kChar);
  auto e8 = (dequantize(q8, "int8", 0) - w).abs();
  EXPECT_TRUE((e8 <= q8.scale.unsqueeze(1) / 2 + 1e-6).all().item<bool>());
  for (int64_t g : {32, 64, 128}) {
    auto q4 = quantize_int4(w, g);
    EXPECT_EQ(q4.values.sizes(), (std::vector<int64_t>{48, 64}));
    auto e4 = (dequantize(q4, "int4", g) - w).abs();
    EXPECT_TRUE((e4 <= q4.scale.repeat_interleave(g, 1) / 2 + 1e-5).all().item<bool>()) << g;
  }
  EXPECT_THROW(quantize_int4(w, 96), tandem::Refused);  // one type for every refusal
  EXPECT_THROW(check_quantize_options(QuantizeOptions().method("int3")), std::invalid_argument);
  EXPECT_THROW(check_quantize_options(QuantizeOptions().method("int4").group_size(48)),
               std::invalid_argument);
}

TEST(Quantize, KernelsAgreeWithDequantizeThenMatmul) {
  torch::manual_seed(4);
  auto x = torch::randn({5, 128});
  for (std::string method : {"int8", "int4"}) {
    auto o = QuantizeOptions().method(method).group_size(32);
    QuantizedLinear fast(128, 96, true, o), slow(128, 96, true, QuantizeOptions(o).use_kernels(false));
    auto q = method == "int8" ? quantize_int8(torch::randn({96, 128})) : quantize_int4(torch::randn({96, 128}), 32);
    for (auto* l : {fast.get(), slow.get()}) {
      l->weight.set_data(q.values);
      l->weight_scale.set_data(q.scale);
      if (q.zero.defined()) l->weight_zero.set_data(q.zero);
      l->bias.set_data(torch::arange(96, torch::kFloat));
    }
    EXPECT_EQ(slow->kernel(torch::kCPU, torch::kFloat), "dequantize + matmul");
    auto a = fast(x), b = slow(x);
    EXPECT_TRUE(torch::allclose(a, b, 1e-4, 1e-4))
        << method << " by " << fast->kernel(torch::kCPU, torch::kFloat) << ": "
        << (a - b).abs().max().item<float>();
  }
}

TEST(Quantize, AModelWithTypedMembersComputesThroughItsQuantizedLayers) {
  auto saved = save_tiny("quantize-model");
  auto want = saved.dense(ids());
  auto report = quantize_model(*saved.dense, QuantizeOptions().method("int8"));
  EXPECT_EQ(report.layers, 4 * 4);  // c_attn, c_proj, c_fc, mlp.c_proj per block
  EXPECT_LT(report.quantized_bytes * 3, report.float_bytes);
  // The blocks call c_attn(x) through typed members: the calls reach the quantized layers.
  auto names = saved.dense->named_buffers();
  EXPECT_EQ(names["transformer.h.0.attn.c_attn.weight"].scalar_type(), torch::kChar);
  EXPECT_TRUE(is_empty_weight(saved.dense->transformer->blocks[0]->attn->c_attn->weight));
  torch::NoGradGuard g;
  auto got = saved.dense(ids());
  const float err = (got - want).abs().max().item<float>();
  EXPECT_GT(err, 0.0f);  // quantized: not the float model
  EXPECT_LT(err, 0.05f * want.abs().max().item<float>());
}

TEST(Quantize, RefusesATorchLinearItsParentMayCallPastTheQuantizedLayer) {
  struct NetImpl : torch::nn::Module {
    NetImpl() : fc(register_module("fc", torch::nn::Linear(8, 8))) {}
    torch::Tensor forward(const torch::Tensor& x) { return fc(x); }
    torch::nn::Linear fc;
  };
  auto net = std::make_shared<NetImpl>();
  try {
    quantize_model(*net, QuantizeOptions());
    FAIL() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tandem::nn::Linear"), std::string::npos) << e.what();
  }
  torch::nn::Sequential seq(torch::nn::Linear(32, 8));
  EXPECT_EQ(quantize_model(*seq, QuantizeOptions()).layers, 1);
  EXPECT_EQ(seq->forward(torch::randn({2, 32})).sizes(), (std::vector<int64_t>{2, 8}));
}

// tandem quantize's checkpoint, loaded into an empty model (its layers from the metadata), equals
// the float model quantized in memory; in memory or with every block on disk.
TEST(Quantize, ACheckpointWrittenQuantizedLoadsBackAsTheModelQuantizedInMemory) {
  auto saved = save_tiny("quantize-checkpoint");
  std::ofstream(saved.dir / "config.json") << "{\"model_type\": \"gpt2\"}";
  for (std::string method : {"int8", "int4"}) {
    const auto options = QuantizeOptions().method(method).group_size(32);
    const auto out = saved.dir / ("q-" + method);
    auto report = quantize_checkpoint(saved.dir.string(), out.string(), options);
    EXPECT_EQ(report.layers, 16) << report.to_string();
    EXPECT_TRUE(fs::exists(out / "config.json"));
    auto recorded = checkpoint_quantization(out.string());
    ASSERT_TRUE(recorded.has_value());
    EXPECT_EQ(recorded->method(), method);
    EXPECT_EQ(recorded->layers().size(), 16u);
    EXPECT_FALSE(checkpoint_quantization(saved.dir.string()).has_value());
    EXPECT_THROW(quantize_checkpoint(saved.dir.string(), out.string(), options),
                 std::invalid_argument);  // the output holds a checkpoint already
    EXPECT_THROW(quantize_checkpoint(out.string(), (saved.dir / "again").string(), options),
                 std::invalid_argument);  // already quantized

    torch::manual_seed(7);
    auto reference = examples::GPT2LMHeadModel(tiny());
    tandem::checkpoint::load_model(*reference, saved.dir.string());
    reference->eval();
    quantize_model(*reference, options);
    torch::NoGradGuard g;
    auto want = reference(ids());
    for (bool disk : {false, true}) {
      auto model = init_empty_weights([] { return examples::GPT2LMHeadModel(tiny()); });
      model->eval();
      quantize_model(*model, *recorded);
      DeviceMap map{{"", "cpu"}};
      if (disk) map = infer_device_map(*model, DeviceMapOptions().max_memory({{"cpu", 1}}));
      auto placed = load_checkpoint_and_dispatch(*model, out.string(), map);
      auto got = model(ids());
      EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5))
          << method << (disk ? " on disk " : " ") << (got - want).abs().max().item<float>();
    }
  }
}

TEST(Attention, WithACacheEqualsTheLastRowsOfTheFullComputation) {
  torch::manual_seed(5);
  auto q = torch::randn({2, 3, 7, 16}), k = torch::randn({2, 3, 7, 16}), v = torch::randn({2, 3, 7, 16});
  std::vector<tandem::nn::AttentionKernel> kernels{tandem::nn::AttentionKernel::kManual};
  if (tandem::nn::fused_attention_available()) kernels.push_back(tandem::nn::AttentionKernel::kFused);
  auto full = tandem::nn::causal_attention(q, k, v, tandem::nn::AttentionKernel::kManual);
  for (auto kernel : kernels) {
    auto name = tandem::nn::attention_kernel_name(kernel);
    EXPECT_TRUE(torch::allclose(tandem::nn::causal_attention(q, k, v, kernel), full, 1e-5, 1e-5)) << name;
    for (int64_t L : {1, 3}) {
      auto part = tandem::nn::causal_attention(q.slice(2, 7 - L), k, v, kernel);
      EXPECT_TRUE(torch::allclose(part, full.slice(2, 7 - L), 1e-5, 1e-5)) << name << " L " << L;
    }
  }
  if (!tandem::nn::fused_attention_available()) {
    EXPECT_THROW(tandem::nn::parse_attention_kernel("sdpa"), std::invalid_argument);
  }
  EXPECT_THROW(tandem::nn::parse_attention_kernel("flash"), std::invalid_argument);
}

}  // namespace
