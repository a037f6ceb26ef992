// Greedy generation with a transformers GPT-2 checkpoint (config.json and safetensors as
// save_pretrained writes them, sharded or not), under a memory cap with disk offload, and with
// weight-only int8/int4 quantization.
//   generate_gpt2 MODEL_DIR --prompt_ids 464,2068,7586 --max_new_tokens 20
//   generate_gpt2 MODEL_DIR --prompt_ids 464,2068,7586 --max_memory 64MB --offload_dir /tmp/off
//   generate_gpt2 MODEL_DIR --prompt_ids 464,2068,7586 --quantize int8
//   tandem launch --num_processes 2 --cpu generate_gpt2 MODEL_DIR --prompt_ids 1,2 --prompt_ids 3
// Prints `tokens: <ids>` (the prompt left out) for each prompt, in order, from the main process;
// under tandem launch each process generates its share of the prompts (data-parallel inference).
// The flags and what they do: examples/common/generate.h (shared with generate_llm).
#include "common/generate.h"
#include "common/gpt2.h"

int main(int argc, char** argv) {
  return examples::generate_main<examples::GPT2LMHeadModel>(
      "generate_gpt2", "GPT-2", argc, argv, [](const std::string& dir, std::string& described) {
        const auto config = examples::GPT2Config::from_file(dir + "/config.json");
        described = "GPT-2 " + std::to_string(config.n_layer) + " x " + std::to_string(config.n_embd);
        return tandem::inference::init_empty_weights(
            [&] { return examples::GPT2LMHeadModel(config); });
      });
}
