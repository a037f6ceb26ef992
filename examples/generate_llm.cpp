// Greedy generation with a transformers Llama-family checkpoint (llama, mistral, qwen2, qwen3,
// mixtral, qwen3_moe: config.json and safetensors as save_pretrained writes them, sharded or not,
// float32/bfloat16/float16 on disk), through the inference path: empty weights, a device map
// under a memory cap with the rest on disk, weight-only int8/int4 quantization, the key/value
// cache; data-parallel over the prompts under tandem launch.
//   generate_llm MODEL_DIR --prompt_ids 9707,11,1879 --max_new_tokens 20
//   generate_llm MODEL_DIR --prompt_ids 9707,11,1879 --max_memory 200MB --offload_dir /tmp/off
//   generate_llm MODEL_DIR --prompt_ids 9707,11,1879 --quantize int8
//   tandem launch --num_processes 2 --cpu generate_llm MODEL_DIR --prompt_ids 1,2 --prompt_ids 3
// Computes in float32 (weights stored in bf16/fp16 are widened as they load). Prints
// `tokens: <ids>` per prompt from the main process; the flags: examples/common/generate.h.
#include "common/generate.h"
#include "tandem/models/llama.h"

int main(int argc, char** argv) {
  namespace models = tandem::models;
  return examples::generate_main<models::LlamaForCausalLM>(
      "generate_llm", "Llama-family", argc, argv,
      [](const std::string& dir, std::string& described) {
        const auto config = models::LlamaConfig::from_file(dir + "/config.json");
        described = config.model_type + " " + std::to_string(config.num_hidden_layers) + " x " +
                    std::to_string(config.hidden_size) +
                    (config.num_experts > 0 ? " (" + std::to_string(config.num_experts) +
                                                  " experts, top " +
                                                  std::to_string(config.num_experts_per_tok) + ")"
                                            : std::string());
        return tandem::inference::init_empty_weights(
            [&] { return models::LlamaForCausalLM(config); });
      });
}
