// The activation memory activation checkpointing saves, counted exactly by the counting CPU
// allocator (installed first thing in main, so that every tensor of the test is counted).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "../../examples/common/gpt.h"
#include "tandem/parallel/activation_checkpoint.h"
#include "tandem/track/cpu_memory.h"

namespace {

constexpr int64_t kWidth = 64, kBatch = 512, kBlocks = 8;

// fc1 (W -> 4W), SiLU written out (h * sigmoid(h)), fc2 (4W -> W): the kept activations are
// fc1's output h, sigmoid(h), their product (fc2's input), 4W each, and the block's output (W):
// 13 x batch x W floats.
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kWidth, 4 * kWidth))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kWidth, kWidth))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = fc1(x);
    return fc2(h * torch::sigmoid(h));
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MlpBlock);

torch::nn::Sequential model(bool checkpointed) {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  for (int64_t i = 0; i < kBlocks; ++i) m->push_back(MlpBlock());
  if (checkpointed) tandem::parallel::checkpoint_sequential_entries(m);
  return m;
}

int64_t current() { return tandem::track::cpu_memory_stats().current_bytes; }

// Peak bytes above the baseline during one forward and backward (the second step: the
// parameters' .grad exist already and are accumulated into in place, so that the peak is the
// activations and the backward's transients).
int64_t activation_peak(torch::nn::Sequential& m, const torch::Tensor& x) {
  for (int step = 0; step < 2; ++step) {
    const int64_t baseline = current();
    tandem::track::reset_peak_cpu_memory();
    m->forward(x).pow(2).mean().backward();
    if (step == 1) return tandem::track::cpu_memory_stats().peak_bytes - baseline;
  }
  return 0;
}

}  // namespace

TEST(ActivationCheckpointMemory, PeakActivationMemoryFallsAsTheBlockCountPredicts) {
  ASSERT_TRUE(tandem::track::counting_cpu_allocator_installed());
  torch::manual_seed(1);
  auto x = torch::randn({kBatch, kWidth});

  // What one block keeps for its backward (its output included), and its output alone.
  int64_t per_block = 0, output = 0;
  {
    auto one = model(false);
    const int64_t before = current();
    auto y = one[0]->as<MlpBlockImpl>()->forward(x);
    per_block = current() - before;
    output = y.numel() * static_cast<int64_t>(y.element_size());
  }
  EXPECT_EQ(per_block, 13 * kBatch * kWidth * 4);  // h, sigmoid(h), silu(h): 4W each; output: W

  auto plain = model(false);
  auto ckpt = model(true);
  const int64_t plain_peak = activation_peak(plain, x);
  const int64_t ckpt_peak = activation_peak(ckpt, x);
  // Without checkpointing all blocks' activations are alive when backward starts, and the
  // backward of the last block adds its transients T (gradients flowing between the layers, a
  // block's weight gradients before they are accumulated): plain = B x S + T. With it, the
  // blocks' outputs (each the next block's saved input), one block recomputed at a time and the
  // same transients: B x O + S + T.
  EXPECT_GE(plain_peak, kBlocks * per_block);
  const int64_t transients = plain_peak - kBlocks * per_block;
  const int64_t predicted = kBlocks * output + per_block + transients;
  const double expected = static_cast<double>(plain_peak) / static_cast<double>(predicted);
  const double measured = static_cast<double>(plain_peak) / static_cast<double>(ckpt_peak);
  std::cout << "activation peak, " << kBlocks << " blocks, batch " << kBatch << ", width " << kWidth
            << ": without checkpointing " << plain_peak / 1024 << " KiB, with "
            << ckpt_peak / 1024 << " KiB (predicted " << predicted / 1024 << " KiB): " << measured
            << "x less, " << expected << "x predicted; per block S = " << per_block / 1024
            << " KiB kept, O = " << output / 1024 << " KiB of it the output, T = "
            << transients / 1024 << " KiB" << std::endl;
  // The recompute also holds the recomputed block's output and its incoming gradient: two
  // outputs' worth above the prediction at most.
  EXPECT_LE(ckpt_peak, predicted + 2 * output);
  EXPECT_GE(measured, 0.9 * expected);
  EXPECT_GE(measured, 3.0);
}

// The example GPT (GELU through LibTorch's oneDNN kernels, which take scratch memory through
// raw_allocate: Note [Counted allocations]) with 8 blocks: checkpointing every block keeps one
// block's input instead of every block's activations. Predicted: the plain peak is about
// B x A (A: one block's kept activations, measured as the plain 1-block peak minus the
// embedding/head part, i.e. the 2-block peak minus the 1-block peak), the checkpointed one
// B x (the block input) + A; the test asserts the measured fall reaches 0.8 of that.
int64_t gpt_peak(int64_t layers, bool checkpointed) {
  examples::GPTConfig c;
  c.layers = layers;
  c.width = 64;
  c.heads = 4;
  c.context = 64;
  torch::manual_seed(4);
  examples::GPT gpt(c);
  auto idx = torch::randint(0, c.vocab, {16, c.context});
  auto targets = torch::randint(0, c.vocab, {16, c.context});
  auto pos = torch::arange(c.context, torch::kLong);
  int64_t peak = 0;
  for (int step = 0; step < 2; ++step) {
    const int64_t baseline = current();
    tandem::track::reset_peak_cpu_memory();
    auto x = gpt->wte(idx) + gpt->wpe(pos);
    for (auto& b : gpt->blocks)
      x = checkpointed ? tandem::parallel::checkpoint([b](const torch::Tensor& t) mutable { return b(t); }, x)
                       : b(x);
    auto logits = gpt->head(gpt->ln_f(x));
    torch::nn::functional::cross_entropy(logits.view({-1, c.vocab}), targets.view({-1})).backward();
    peak = tandem::track::cpu_memory_stats().peak_bytes - baseline;
  }
  return peak;
}

TEST(ActivationCheckpointMemory, ExampleGptPeakFallsAsTheBlockCountPredicts) {
  ASSERT_TRUE(at::globalContext().userEnabledMkldnn());
  const int64_t kB = 8;
  const int64_t one = gpt_peak(1, false), two = gpt_peak(2, false);
  const int64_t per_block = two - one;  // one block's kept activations
  const int64_t block_input = 16 * 64 * 64 * 4;
  const int64_t plain = gpt_peak(kB, false), ckpt = gpt_peak(kB, true);
  const double expected = double(plain) / double(plain - (kB - 1) * per_block + kB * block_input);
  const double measured = double(plain) / double(ckpt);
  std::cout << "example GPT, " << kB << " blocks: peak " << plain / 1024 << " KiB plain, " << ckpt / 1024
            << " KiB checkpointed: " << measured << "x (predicted " << expected << "x; one block keeps "
            << per_block / 1024 << " KiB)" << std::endl;
  EXPECT_GT(per_block, 4 * block_input);
  EXPECT_GE(measured, 0.8 * expected);
  EXPECT_GE(measured, 2.0);
}

// c10::Allocator::raw_allocate (oneDNN's way in) asserts that a DataPtr's context is its data:
// the counting allocator hands out such DataPtrs and still counts the bytes.
TEST(CountingAllocator, ServesRawAllocate) {
  auto* a = c10::GetAllocator(c10::DeviceType::CPU);
  const int64_t before = current();
  void* p = a->raw_allocate(4096);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(current() - before, 4096);
  a->raw_deallocate(p);
  EXPECT_EQ(current(), before);
}

int main(int argc, char** argv) {
  tandem::track::install_counting_cpu_allocator();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
