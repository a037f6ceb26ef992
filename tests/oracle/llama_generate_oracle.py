"""transformers' Llama-family models and tandem's generate_llm (the inference path: empty weights,
device maps, disk offload, weight-only int8, the key/value cache) on small random checkpoints made
here with fixed seeds and saved by save_pretrained (no hub access). For a Qwen3 (tied head,
grouped-query attention, q/k norms), a Llama (untied head, llama3 rotary scaling) and a Qwen3-MoE
(a dense layer and a sparse one, top 2 of 4):
  - the greedy tokens of transformers' generate(do_sample=False) and its logits within 1e-4
    (relative to the largest) over the prompt and every generated token, with the key/value cache
    and without it;
  - the same under a memory cap that leaves every block on disk, read as it is called;
  - two processes under tandem launch, each generating its share of three prompts, in order;
  (each run a job of one launch per number of processes: GENERATE_LLM_JOBS is tests/
  generate_llm_jobs, examples/generate_llm that runs a launch's jobs);
  - a checkpoint stored in bfloat16, widened to float32 as it loads: transformers' tokens and
    logits when it loads the same folder in float32, in memory and on disk (widened as each block
    is read);
  - weight-only int8 on the fly: the tokens and logits (1e-4) of transformers' model whose
    matrices are rounded as tandem's int8 rounds them.

Usage: llama_generate_oracle.py GENERATE_LLM_JOBS TANDEM_CLI WORK_DIR
"""
import copy
import os
import re
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig  # noqa: E402

from common import fail, fresh_dir, launch_jobs  # noqa: E402

NEW = 12
PROMPTS = [[5, 17, 42], [3, 90, 7, 7, 61], [11]]
SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "qwen3": Qwen3Config(**SHAPE, head_dim=8, tie_word_embeddings=True),
    "llama": LlamaConfig(**SHAPE, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16}),
    "qwen3_moe": Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=24, mlp_only_layers=[0],
                                norm_topk_prob=True),
}


def reference(model, prompt):
    """transformers' greedy tokens, and the logits of the prompt and of every step."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        prompt_logits = model(ids).logits[0]
        steps = torch.stack([s[0] for s in out.logits])
    return tokens, prompt_logits.float(), steps.float()


def generate(jobs, model_dir, prompts, *flags, logits=None, processes=1):
    """Adds a generate_llm job on `processes` ranks to `jobs`; returns a function that gives its
    tokens and output once the jobs ran (they run as jobs of one launch per size)."""
    args = [model_dir, "--max_new_tokens", str(NEW)] + list(flags)
    for p in prompts:
        args += ["--prompt_ids", ",".join(map(str, p))]
    if logits:
        args += ["--logits_out", logits]
    jobs.append((processes, [], args))
    index = len(jobs) - 1

    def result(outputs):
        out = outputs[index]
        tokens = [[int(t) for t in m.split(",")]
                  for m in re.findall(r"^(?:\[rank \d+\] )?tokens: (\S+)$", out, re.M)]
        if len(tokens) != len(prompts):
            fail(f"generate_llm {' '.join(args)}: {len(tokens)} token lines for {len(prompts)} "
                 f"prompts:\n{out}")
        return tokens, out
    return result


def largest_difference(logits_file, refs):
    got = load_file(logits_file)
    worst = 0.0
    for i, (_, prompt_logits, steps) in enumerate(refs):
        scale = max(prompt_logits.abs().max().item(), steps.abs().max().item())
        for key, want in (("prompt", prompt_logits), ("steps", steps)):
            worst = max(worst, (got[f"prompt{i}.{key}"] - want).abs().max().item() / scale)
    return worst


def check(jobs, work, family, config):
    """Writes the family's folders and adds its generate_llm jobs to `jobs`; returns the function
    that checks their results once they ran."""
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # every parameter off its initial value: norms and biases count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model_dir = os.path.join(work, family)
    model.save_pretrained(model_dir, safe_serialization=True)
    refs = [reference(model, p) for p in PROMPTS]
    want = [r[0] for r in refs]
    runs = [(name, flags, os.path.join(work, f"{family}-{name.replace(' ', '_')}.safetensors"))
            for name, flags in (("cache", []), ("no cache", ["--no_cache"]),
                                ("every block on disk", ["--max_memory", "1KB"]))]
    plain = [generate(jobs, model_dir, PROMPTS, *flags, logits=lf) for _, flags, lf in runs]
    two = generate(jobs, model_dir, PROMPTS, processes=2)

    # int8 on the fly: transformers' model with every matrix but the embedding and the head
    # rounded as tandem's int8 rounds it (per output row, symmetric, absmax / 127; the experts'
    # fused tensors row by row, the router too) gives tandem's tokens and logits.
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name:
                scale = p.abs().amax(-1, keepdim=True) / 127
                p.copy_(torch.where(scale > 0, (p / scale).round().clamp(-127, 127) * scale, p))
    refs8 = [reference(rounded, p) for p in PROMPTS]
    lf8 = os.path.join(work, f"{family}-int8.safetensors")
    int8 = generate(jobs, model_dir, PROMPTS, "--quantize", "int8", logits=lf8)

    # bfloat16 on disk, widened as it loads; transformers loads the same folder in float32.
    bf16_dir = os.path.join(work, family + "-bf16")
    model.to(torch.bfloat16).save_pretrained(bf16_dir, safe_serialization=True)
    wide = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    refs16 = [reference(wide, p) for p in PROMPTS]
    lf16 = os.path.join(work, f"{family}-bf16.safetensors")
    bf16 = generate(jobs, bf16_dir, PROMPTS, logits=lf16)
    # On disk: each block's bfloat16 weights read from the checkpoint and widened at its forward.
    bf16_disk = generate(jobs, bf16_dir, PROMPTS, "--max_memory", "1KB")

    def verify(outputs):
        for (name, _, lf), result in zip(runs, plain):
            tokens, out = result(outputs)
            if tokens != want:
                fail(f"{family}, {name}: tokens {tokens}, transformers' {want}")
            if "disk" in name and "disk reads" not in out:
                fail(f"{family}, {name}: no block was read from disk:\n{out}")
            d = largest_difference(lf, refs)
            if d > 1e-4:
                fail(f"{family}, {name}: logits differ from transformers' by {d:.3g}")
            print(f"{family}, {name}: transformers' tokens, logits within {d:.2e}")

        tokens, _ = two(outputs)
        if tokens != want:
            fail(f"{family}, two processes: tokens {tokens}, transformers' {want}")
        print(f"{family}, two processes: transformers' tokens for all {len(PROMPTS)} prompts")

        tokens, out = int8(outputs)
        if "int8:" not in out:
            fail(f"{family}, int8: generate_llm did not say what it quantized:\n{out}")
        if tokens != [r[0] for r in refs8]:
            fail(f"{family}, int8: tokens {tokens}, transformers' with int8-rounded weights "
                 f"{[r[0] for r in refs8]}")
        d = largest_difference(lf8, refs8)
        if d > 1e-4:
            fail(f"{family}, int8: logits differ from transformers' with int8-rounded weights by "
                 f"{d:.3g}")
        agree = sum(a == b for t, w in zip(tokens, want) for a, b in zip(t, w))
        print(f"{family}, int8 on the fly: the tokens and logits (within {d:.2e}) of "
              f"transformers' model with int8-rounded weights; {agree}/{NEW * len(PROMPTS)} tokens "
              f"as float32's")

        tokens, _ = bf16(outputs)
        if tokens != [r[0] for r in refs16]:
            fail(f"{family}, bfloat16 checkpoint: tokens {tokens}, transformers' "
                 f"{[r[0] for r in refs16]}")
        d = largest_difference(lf16, refs16)
        if d > 1e-4:
            fail(f"{family}, bfloat16 checkpoint: logits differ from transformers' by {d:.3g}")
        tokens, out = bf16_disk(outputs)
        if tokens != [r[0] for r in refs16] or "disk reads" not in out:
            fail(f"{family}, bfloat16 checkpoint on disk: tokens {tokens}:\n{out}")
        print(f"{family}, bfloat16 checkpoint widened to float32: transformers' tokens, logits "
              f"within {d:.2e}; on disk too")
    return verify


def main():
    gen, cli, work = sys.argv[1], sys.argv[2], fresh_dir(sys.argv[3])
    # Every family's runs of one size are jobs of one launch (common.launch_jobs).
    jobs = []
    checks = [check(jobs, work, family, config) for family, config in FAMILIES.items()]
    outputs = launch_jobs(cli, gen, jobs, work)
    for verify in checks:
        verify(outputs)


if __name__ == "__main__":
    main()
