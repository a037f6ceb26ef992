"""Fine-tuning a transformers Qwen3 (tied head, grouped-query attention, q/k norms), and a
Qwen3-MoE (a dense layer and a layer of four experts, top 2), with
examples/train_llm under every layout equals PyTorch's own training of the same model: four
AdamW steps (weight decay, one warm-up step then cosine decay to 10% with transformers'
get_cosine_with_min_lr_schedule_with_warmup, gradient clipping that binds) on the same JSONL
batches, from the same save_pretrained folder. The folder train_llm saves is compared with
PyTorch's weights within 1e-4 (relative to each tensor's largest value), for one process, data
parallel on 2, ZeRO-1 on 2, FSDP (ZeRO-3) on 2 with activation checkpointing, tensor parallel on 2,
and ZeRO-3 x tensor parallel on 4.

Usage: llama_training_oracle.py TRAIN_LLM TANDEM_CLI WORK_DIR
"""
import os
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig  # noqa: E402

from common import fail, fresh_dir, run  # noqa: E402
from llama_common import perturb, train_like_train_llm, write_rows  # noqa: E402

STEPS, GLOBAL_BATCH, SEQ, LR, WD, CLIP = 4, 4, 16, 1e-2, 0.01, 0.5


def main():
    train_llm, cli, root = sys.argv[1], sys.argv[2], fresh_dir(sys.argv[3])
    dense = Qwen3Config(vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        tie_word_embeddings=True, max_position_embeddings=64)
    # Layer 0 dense, layer 1 four experts (top 2): experts no token of a rank's batch chose get
    # no gradient there. The load-balancing loss is left out: each data-parallel rank computes it
    # over its own tokens (as Megatron and torchtitan do), which one process does not.
    moe = Qwen3MoeConfig(vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0],
                         norm_topk_prob=True, max_position_embeddings=64)
    for name, config in (("qwen3", dense), ("qwen3_moe", moe)):
        check(train_llm, cli, fresh_dir(os.path.join(root, name)), name, config)


def check(train_llm, cli, work, family, config):
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    perturb(model)
    model_dir = os.path.join(work, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    data = os.path.join(work, "data.jsonl")
    ids = write_rows(data, config.vocab_size, 8, SEQ, seed=6)
    train_like_train_llm(model, list(model.parameters()), ids, STEPS, GLOBAL_BATCH, LR, WD, CLIP)
    # By the files' names (transformers holds a mixture's experts fused).
    model.save_pretrained(os.path.join(work, "pytorch"), safe_serialization=True)
    want = load_file(os.path.join(work, "pytorch", "model.safetensors"))

    layouts = [
        ("one process", 1, [], GLOBAL_BATCH),
        ("data parallel 2", 2, [], GLOBAL_BATCH // 2),
        ("ZeRO-1 on 2", 2, ["--use_deepspeed", "--zero_stage", "1"], GLOBAL_BATCH // 2),
        ("FSDP on 2, activation checkpointing", 2, ["--use_fsdp", "--activation_checkpointing"],
         GLOBAL_BATCH // 2),
        ("tensor parallel 2", 2, ["--tp_size", "2"], GLOBAL_BATCH),
        ("ZeRO-3 x tensor parallel 2 on 4", 4, ["--use_fsdp", "--tp_size", "2"], GLOBAL_BATCH // 2),
    ]
    for name, n, flags, batch in layouts:
        out_dir = os.path.join(work, "out-" + name.replace(" ", "_").replace(",", ""))
        run([cli, "launch", "--num_processes", str(n), "--cpu"] + flags +
            [train_llm, "--model", model_dir, "--data", data, "--seq_len", str(SEQ),
             "--batch_size", str(batch), "--steps", str(STEPS), "--lr", str(LR),
             "--warmup_steps", "1", "--min_lr_ratio", "0.1", "--weight_decay", str(WD),
             "--clip", str(CLIP), "--log_every", "1", "--save", out_dir])
        got = load_file(os.path.join(out_dir, "model.safetensors"))
        worst = 0.0
        for pname, p in want.items():
            if pname not in got:
                fail(f"{family}, {name}: the saved folder has no {pname}")
            d = (got[pname] - p).abs().max().item() / p.abs().max().item()
            if d > 1e-4:
                fail(f"{family}, {name}: {pname} differs from PyTorch's by {d:.3g} after "
                     f"{STEPS} steps")
            worst = max(worst, d)
        back = AutoModelForCausalLM.from_pretrained(out_dir)
        if type(back).__name__ != type(model).__name__:
            fail(f"{family}, {name}: the saved folder loads as {type(back).__name__}")
        print(f"{family}, {name}: {len(want)} tensors within {worst:.2e} of PyTorch's after "
              f"{STEPS} steps")


if __name__ == "__main__":
    main()
