// The Accelerator's API as a user meets it in one process: what prepare() returns for each kind
// of model, batches under the true-half modes, objects that outlive the Accelerator, and
// strategies that are refused rather than silently replaced.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <tuple>
#include <type_traits>

#include "../../examples/common/mlp.h"
#include "tandem/tandem.h"
#include "../common/temp_dir.h"

namespace {

using examples::MLP;
using examples::MLPImpl;

// Builds an Accelerator of one process whatever the calling environment says.
struct SingleProcessEnv {
  SingleProcessEnv() {
    for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "TANDEM_DISTRIBUTED_TYPE",
                          "TANDEM_MIXED_PRECISION", "TANDEM_TIMELINE", "OMPI_COMM_WORLD_RANK",
                          "PMI_RANK", "SLURM_PROCID"})
      ::unsetenv(k);
  }
};

tandem::AcceleratorOptions cpu_options() {
  SingleProcessEnv clean;
  return tandem::AcceleratorOptions().cpu(true).seed(0);
}

bool same_parameters(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  if (pa.size() != pb.size()) return false;
  for (size_t i = 0; i < pa.size(); ++i)
    if (!pa[i].is_same(pb[i])) return false;
  return true;
}

}  // namespace

// `m = acc.prepare(m)` compiles for TORCH_MODULE holders and hands back the same module.
TEST(AcceleratorPrepare, ReturnsTheTypePassedIn) {
  tandem::Accelerator acc(cpu_options());
  MLP m(4, 8, 3);
  MLP before = m;
  m = acc.prepare(m);
  static_assert(std::is_same_v<decltype(acc.prepare(m)), MLP>);
  EXPECT_TRUE(same_parameters(*m, *before));

  auto impl = std::make_shared<MLPImpl>(4, 8, 3);
  std::shared_ptr<MLPImpl> p = acc.prepare(impl);
  static_assert(std::is_same_v<decltype(acc.prepare(impl)), std::shared_ptr<MLPImpl>>);
  EXPECT_EQ(p.get(), impl.get());

  torch::nn::Linear lin(3, 2);
  lin = acc.prepare(lin);
  static_assert(std::is_same_v<decltype(acc.prepare(lin)), torch::nn::Linear>);
  EXPECT_EQ(lin->weight.size(0), 2);
}

TEST(AcceleratorPrepare, ModelAndOptimizerTogether) {
  tandem::Accelerator acc(cpu_options());
  MLP model(4, 8, 3);
  tandem::AcceleratedOptimizer opt;
  auto adamw = std::make_shared<torch::optim::AdamW>(model->parameters());
  std::tie(model, opt) = acc.prepare(model, adamw);
  EXPECT_EQ(opt.ptr().get(), adamw.get());

  auto extra = torch::zeros({2}, torch::requires_grad());
  auto [m2, o2] = acc.prepare(MLP(4, 8, 3), std::make_shared<torch::optim::SGD>(
                                                std::vector<at::Tensor>{extra}, 0.1));
  static_assert(std::is_same_v<decltype(m2), MLP>);
  EXPECT_EQ(m2->fc1->weight.size(1), 4);
  (void)o2;
  auto ptr = std::make_shared<MLPImpl>(4, 8, 3);
  auto [m3, o3] = acc.prepare(ptr, std::make_shared<torch::optim::SGD>(ptr->parameters(), 0.1));
  static_assert(std::is_same_v<decltype(m3), std::shared_ptr<MLPImpl>>);
  EXPECT_EQ(m3.get(), ptr.get());
  (void)o3;
}

// free_memory (Accelerate's name): after it a new model trains exactly as under a fresh
// Accelerator, and save_state holds the new model only.
TEST(AcceleratorPrepare, FreeMemoryStartsOverForTheNextModel) {
  auto train = [](tandem::Accelerator& acc) {
    torch::manual_seed(3);
    MLP model(4, 8, 3);
    auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(model->parameters(), 0.01));
    model = acc.prepare(model);
    for (int s = 0; s < 3; ++s) {
      auto x = torch::randn({5, 4});
      acc.backward(model->forward(x).pow(2).mean());
      opt.step();
      opt.zero_grad();
    }
    return model;
  };
  tandem::Accelerator fresh(cpu_options());
  auto want = train(fresh);
  tandem::Accelerator reused(cpu_options());
  auto first = train(reused);
  reused.free_memory();
  auto got = train(reused);
  for (size_t i = 0; i < want->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(want->parameters()[i], got->parameters()[i]));
  tandem::testing::TempDir dir;
  reused.save_state(dir.str());
  EXPECT_TRUE(std::filesystem::exists(dir.path / "model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir.path / "model_1.safetensors"))
      << "the model prepared before free_memory is not part of the state";
  (void)first;
}

// Under bf16-true a float batch is cast to bf16 (labels untouched) and trains; the cast can be
// turned off per loader or for the Accelerator; modes that keep fp32 weights never cast.
TEST(TrueHalfInputs, FloatingBatchesFollowTheWeights) {
  tandem::Accelerator acc(cpu_options().mixed_precision("bf16-true"));
  auto model = acc.prepare(MLP(16, 32, 4));
  auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(model->parameters(), 0.1));
  auto loader = acc.prepare_data_loader(examples::TeacherClassification(40, 16, 4),
                                        tandem::data::DataLoaderOptions().batch_size(8));
  int batches = 0;
  for (auto& b : *loader) {
    EXPECT_EQ(b.data.scalar_type(), at::kBFloat16);
    EXPECT_EQ(b.target.scalar_type(), at::kLong);
    auto scope = acc.accumulate();
    acc.backward(torch::cross_entropy_loss(model->forward(b.data), b.target));
    opt.step();
    opt.zero_grad();
    ++batches;
  }
  EXPECT_EQ(batches, 5);

  auto raw = acc.prepare_data_loader(
      examples::TeacherClassification(16, 16, 4),
      tandem::data::DataLoaderOptions().batch_size(8).cast_floating_inputs(false));
  for (auto& b : *raw) EXPECT_EQ(b.data.scalar_type(), at::kFloat);
  auto no_prefetch = acc.prepare_data_loader(examples::TeacherClassification(16, 16, 4),
                                             tandem::data::DataLoaderOptions().batch_size(8).prefetch(0));
  for (auto& b : *no_prefetch) EXPECT_EQ(b.data.scalar_type(), at::kBFloat16);
}

TEST(TrueHalfInputs, OffForTheAcceleratorAndInOtherModes) {
  {
    tandem::Accelerator acc(cpu_options().mixed_precision("bf16-true").cast_floating_inputs(false));
    auto loader = acc.prepare_data_loader(examples::TeacherClassification(8, 16, 4),
                                          tandem::data::DataLoaderOptions().batch_size(8));
    for (auto& b : *loader) EXPECT_EQ(b.data.scalar_type(), at::kFloat);
  }
  for (const char* mode : {"no", "bf16"}) {
    tandem::Accelerator acc(cpu_options().mixed_precision(mode));
    auto loader = acc.prepare_data_loader(examples::TeacherClassification(8, 16, 4),
                                          tandem::data::DataLoaderOptions().batch_size(8));
    for (auto& b : *loader) EXPECT_EQ(b.data.scalar_type(), at::kFloat) << mode;
  }
}

// Note [Accelerator lifetime]: a loader (with the timeline on, whose wait callback used to hold
// the Accelerator by raw pointer) and an optimizer that outlive their Accelerator. Under
// AddressSanitizer the loader's iteration was a heap-use-after-free before the fix.
TEST(AcceleratorLifetime, LoaderAndOptimizerOutliveTheAccelerator) {
  auto dir = std::filesystem::temp_directory_path() / ("tandem-life-" + std::to_string(::getpid()));
  std::shared_ptr<tandem::data::DataLoader<examples::TeacherClassification>> loader;
  tandem::AcceleratedOptimizer opt;
  MLP model(16, 32, 4);
  {
    tandem::Accelerator acc(cpu_options().timeline_dir(dir.string()));
    model = acc.prepare(model);
    opt = acc.prepare(std::make_shared<torch::optim::SGD>(model->parameters(), 0.1));
    loader = acc.prepare_data_loader(examples::TeacherClassification(32, 16, 4),
                                     tandem::data::DataLoaderOptions().batch_size(8));
    for (auto& b : *loader) (void)b;  // the callback works while the Accelerator lives
  }
  int n = 0;
  for (auto& b : *loader) {
    EXPECT_EQ(b.data.size(0), 8);
    ++n;
  }
  EXPECT_EQ(n, 4);
  try {
    opt.step();
    FAIL() << "stepping an optimizer whose Accelerator is gone must fail";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the Accelerator that prepared this optimizer was destroyed"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove_all(dir);
}

// No strategy is accepted and then run as something else: Megatron-LM is refused; FSDP's
// strategies and DeepSpeed's stages run as the ZeRO stage they name.
TEST(AcceleratorStrategies, StrategiesRunOrAreRefused) {
  const auto options = cpu_options();  // clears the environment first
  auto refused = [&options](const char* type, const char* why) {
    ::setenv("TANDEM_DISTRIBUTED_TYPE", type, 1);
    try {
      tandem::Accelerator acc(options);
      ADD_FAILURE() << type << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
    ::unsetenv("TANDEM_DISTRIBUTED_TYPE");
  };
  refused("MEGATRON_LM", "does not implement");
  ::setenv("TANDEM_DISTRIBUTED_TYPE", "FSDP", 1);
  {
    tandem::Accelerator acc(options);  // FULL_SHARD, Accelerate's default
    EXPECT_EQ(acc.strategy().name(), "zero-3");
  }
  ::setenv("TANDEM_FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP", 1);
  {
    tandem::Accelerator acc(options);
    EXPECT_EQ(acc.strategy().name(), "zero-2");
    EXPECT_EQ(acc.distributed_type(), tandem::parallel::DistributedType::kFsdp);
  }
  ::setenv("TANDEM_FSDP_SHARDING_STRATEGY", "3", 1);  // Accelerate's number for NO_SHARD
  {
    tandem::Accelerator acc(options);
    EXPECT_EQ(acc.strategy().name(), "ddp");
  }
  ::setenv("TANDEM_FSDP_BOGUS_KEY", "1", 1);
  refused("FSDP", "fsdp_bogus_key");
  ::unsetenv("TANDEM_FSDP_BOGUS_KEY");
  ::unsetenv("TANDEM_FSDP_SHARDING_STRATEGY");
  ::setenv("TANDEM_DISTRIBUTED_TYPE", "DEEPSPEED", 1);
  {
    tandem::Accelerator acc(options);
    EXPECT_EQ(acc.strategy().name(), "zero-2");
  }
  ::setenv("TANDEM_ZERO_STAGE", "1", 1);
  {
    tandem::Accelerator acc(options);
    EXPECT_EQ(acc.strategy().name(), "zero-1");
  }
  ::setenv("TANDEM_OFFLOAD_OPTIMIZER_DEVICE", "nvme", 1);
  refused("DEEPSPEED", "set offload_optimizer_nvme_path");
  ::unsetenv("TANDEM_OFFLOAD_OPTIMIZER_DEVICE");
  ::unsetenv("TANDEM_ZERO_STAGE");
  ::setenv("TANDEM_DISTRIBUTED_TYPE", "MULTI_CPU", 1);
  EXPECT_NO_THROW(tandem::Accelerator acc(tandem::AcceleratorOptions().cpu(true)));
  ::unsetenv("TANDEM_DISTRIBUTED_TYPE");
}

// One process under ZeRO: shards are whole units; the model trains as without sharding.
TEST(AcceleratorStrategies, ZeroOnOneProcessTrainsAsWithout) {
  auto run = [](std::optional<int> stage) {
    auto options = cpu_options();
    if (stage) options.sharding(tandem::parallel::ShardingOptions().stage(*stage));
    tandem::Accelerator acc(options);
    torch::manual_seed(3);
    auto model = torch::nn::Sequential(torch::nn::Linear(5, 4), torch::nn::Tanh(),
                                       torch::nn::Linear(4, 2));
    auto [m, opt] = acc.prepare(model, std::make_shared<torch::optim::AdamW>(
                                           model->parameters(), torch::optim::AdamWOptions(0.1)));
    for (int step = 0; step < 3; ++step) {
      auto scope = acc.accumulate();
      auto x = torch::arange(10, torch::kFloat).reshape({2, 5}) / (step + 1);
      acc.backward(m->forward(x).pow(2).sum());
      opt.step();
      opt.zero_grad();
    }
    std::vector<torch::Tensor> flat;
    // Through get_state_dict: a ZeRO-3 model's parameters are released between uses.
    for (auto& kv : acc.get_state_dict(*m)) flat.push_back(kv.second.reshape({-1}).clone());
    return torch::cat(flat);
  };
  auto plain = run(std::nullopt);
  EXPECT_TRUE(torch::equal(run(1), plain));
  EXPECT_TRUE(torch::equal(run(2), plain));
  EXPECT_TRUE(torch::equal(run(3), plain));
}

// DeepSpeed's gradient_clipping (AcceleratorOptions::gradient_clipping, TANDEM_GRADIENT_CLIPPING)
// clips before every optimizer step exactly as a clip_grad_norm_ call would.
TEST(AcceleratorStrategies, GradientClippingFromTheConfigClipsEveryStep) {
  auto run = [](bool from_config) {
    auto options = cpu_options();
    if (from_config) ::setenv("TANDEM_GRADIENT_CLIPPING", "0.05", 1);
    tandem::Accelerator acc(options);
    ::unsetenv("TANDEM_GRADIENT_CLIPPING");
    torch::manual_seed(5);
    auto model = torch::nn::Linear(6, 3);
    auto [m, opt] = acc.prepare(model, std::make_shared<torch::optim::SGD>(
                                           model->parameters(), torch::optim::SGDOptions(0.5)));
    for (int step = 0; step < 3; ++step) {
      auto scope = acc.accumulate();
      acc.backward(m->forward(torch::ones({4, 6}) * (step + 1)).pow(2).sum());
      if (!from_config) acc.clip_grad_norm_(m->parameters(), 0.05);
      opt.step();
      opt.zero_grad();
    }
    return torch::cat({m->weight.detach().reshape({-1}), m->bias.detach()});
  };
  EXPECT_TRUE(torch::equal(run(true), run(false)));
  ::setenv("TANDEM_GRADIENT_CLIPPING", "lots", 1);
  EXPECT_THROW(tandem::Accelerator acc(cpu_options()), std::invalid_argument);
  ::unsetenv("TANDEM_GRADIENT_CLIPPING");
}

// Note [One vocabulary of booleans]: every boolean TANDEM_* variable takes the config file's
// words (on/off, yes/no, y/n, 1/0, true/false, any case) and refuses anything else naming the
// variable. Before, TANDEM_USE_CPU=on and TANDEM_GRADIENT_AS_BUCKET_VIEW=ON read as false
// without a word, and TANDEM_ACTIVATION_CHECKPOINTING refused "on".
TEST(AcceleratorEnvironment, BooleansShareOneVocabulary) {
  SingleProcessEnv clean;
  auto with = [](const char* var, const char* value) {
    ::setenv(var, value, 1);
    std::string error;
    try {
      tandem::Accelerator acc(tandem::AcceleratorOptions().seed(0));
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
    ::unsetenv(var);
    return error;
  };
  for (const char* v : {"on", "ON", "Yes", "y", "1", "true", " off ", "No", "0", "n", "False"}) {
    EXPECT_EQ(with("TANDEM_USE_CPU", v), "") << v;
    EXPECT_EQ(with("TANDEM_GRADIENT_AS_BUCKET_VIEW", v), "") << v;
    EXPECT_EQ(with("TANDEM_ACTIVATION_CHECKPOINTING", v), "") << v;
  }
  // downcast_bf16 on a run that is not bf16 is refused for another reason: only the words here.
  for (const char* v : {"off", "No", "0", "n", "False"})
    EXPECT_EQ(with("TANDEM_DOWNCAST_BF16", v), "") << v;
  for (const char* var : {"TANDEM_USE_CPU", "TANDEM_GRADIENT_AS_BUCKET_VIEW",
                          "TANDEM_ACTIVATION_CHECKPOINTING", "TANDEM_DOWNCAST_BF16"}) {
    const auto e = with(var, "maybe");
    EXPECT_NE(e.find(var), std::string::npos) << e;
    EXPECT_NE(e.find("got 'maybe', expected true or false"), std::string::npos) << e;
  }
  EXPECT_TRUE(tandem::config::activation_checkpointing_from_env(
      {{"TANDEM_ACTIVATION_CHECKPOINTING", "On"}}));
  EXPECT_FALSE(tandem::config::activation_checkpointing_from_env(
      {{"TANDEM_ACTIVATION_CHECKPOINTING", "off"}}));
}
