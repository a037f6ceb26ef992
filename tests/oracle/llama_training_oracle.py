"""Fine-tuning a transformers Qwen3 (tied head, grouped-query attention, q/k norms), and a
Qwen3-MoE (a dense layer and a layer of four experts, top 2), with
examples/train_llm under every layout equals PyTorch's own training of the same model: four
AdamW steps (weight decay, one warm-up step then cosine decay to 10% with transformers'
get_cosine_with_min_lr_schedule_with_warmup, gradient clipping that binds) on the same JSONL
batches, from the same save_pretrained folder. Each step's gradient norm (train_llm's grad_norm,
over every shard and stage) equals PyTorch's within 1e-5, and the folder train_llm saves holds
PyTorch's weights: each tensor within 1% of how far the training moved it (AdamW gives an
element whose gradient is near zero a full step of either sign, so float rounding alone moves a
few elements by a fraction of a step; a wrong gradient moves them by whole steps), for one process, data
parallel on 2, ZeRO-1 on 2, FSDP (ZeRO-3) on 2 with activation checkpointing, tensor parallel on 2,
and ZeRO-3 x tensor parallel on 4; and on pipeline stages (pp 2, pp 2 x dp 2 and pp 2 x tp 2 on
4), the Qwen3-MoE (untied) and a Qwen3 with an untied head (Note [Llama pipeline stages]); and a
Qwen3-MoE of 32 experts (top 1), some chosen on one replica only, on dp 2 and pp 2 x dp 2; and
both mixtures under expert parallel (ep 2 on 2, ep 2 x dp 2 on 4, ep 4 on 4, and ZeRO on the
rest: FSDP under ep 2, ZeRO-2 under ep 2 x dp 2; ep 2 x tp 2 on 4). For
the mixtures, train_llm's tokens per expert of every step (over every rank) are the reference's
(PyTorch's routers' top-k choices, counted by hooks).

With a fourth argument `context_parallel`, the same against the layouts that split every
sequence (Note [Context parallel]): cp 2 (by the ring, by allgather and by Ulysses), cp 4 (and by Ulysses), dp 2 x cp 2,
ZeRO-3 over dp_shard x cp, and cp 2 x tp 2, for the Qwen3 and the Qwen3-MoE; and for the
Qwen3-MoE with its experts split over ep ranks carved from dp x cp (cp 2 with ep 2, dp 2 x cp 2
with ep 4, FSDP over dp_shard 2 x cp 2 with ep 2).

Usage: llama_training_oracle.py TRAIN_LLM_JOBS TANDEM_CLI WORK_DIR [context_parallel]
(TRAIN_LLM_JOBS: tests/train_llm_jobs, examples/train_llm that runs a launch's jobs)
"""
import os
import re
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig  # noqa: E402

from common import fail, fresh_dir, launch_jobs  # noqa: E402
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
    untied = Qwen3Config(**{**dense.to_dict(), "tie_word_embeddings": False})
    # 32 experts, top 1, 32 tokens per replica and layer: experts one replica's tokens chose and
    # the other's did not (Note [Pipeline gradient sync]), and experts no token chose in a step.
    # Held to tandem's own one process: an expert no token chose keeps no gradient and AdamW
    # leaves it (as PyTorch's DistributedDataParallel and per-module experts do), where
    # transformers 5's fused experts give it zeros, which AdamW's momentum and decay move.
    # (Top 1 without renormalising: renormalised, the one weight is 1 and the router learns
    # nothing but rounding.)
    sparse = Qwen3MoeConfig(**{**moe.to_dict(), "num_experts": 32, "num_experts_per_tok": 1,
                               "moe_intermediate_size": 8, "norm_topk_prob": False})
    layouts = [
        ("one process", 1, [], GLOBAL_BATCH),
        ("data parallel 2", 2, [], GLOBAL_BATCH // 2),
        ("ZeRO-1 on 2", 2, ["--use_deepspeed", "--zero_stage", "1"], GLOBAL_BATCH // 2),
        ("FSDP on 2, activation checkpointing", 2, ["--use_fsdp", "--activation_checkpointing"],
         GLOBAL_BATCH // 2),
        ("tensor parallel 2", 2, ["--tp_size", "2"], GLOBAL_BATCH),
        ("ZeRO-3 x tensor parallel 2 on 4", 4, ["--use_fsdp", "--tp_size", "2"], GLOBAL_BATCH // 2),
    ]
    # Two micro-batches per batch (the default: one per stage).
    pipelines = [
        ("pipeline 2", 2, ["--pp_size", "2"], GLOBAL_BATCH),
        ("pipeline 2 x data parallel 2 on 4", 4, ["--pp_size", "2"], GLOBAL_BATCH // 2),
        ("pipeline 2 x tensor parallel 2 on 4", 4, ["--pp_size", "2", "--tp_size", "2"],
         GLOBAL_BATCH),
        # The launcher's other schedules: 2 stages per rank (interleaved), and the backward split
        # into input and weight gradients (zero bubble).
        ("pipeline 2, interleaved 1F1B with 2 stages per rank", 2,
         ["--pp_size", "2", "--pp_schedule", "interleaved_1f1b", "--pp_virtual_stages", "2"],
         GLOBAL_BATCH),
        ("pipeline 2, zero bubble", 2, ["--pp_size", "2", "--pp_schedule", "zero_bubble"],
         GLOBAL_BATCH),
    ]
    # Every sequence (16 tokens) split over the cp ranks: 2 chunks of 4 per rank on cp 2, of 2 on
    # cp 4; loaders shard over dp only, so a cp group reads one batch.
    contexts = [
        ("context parallel 2", 2, ["--cp_size", "2"], GLOBAL_BATCH),
        ("context parallel 2 by allgather", 2,
         ["--cp_size", "2", "--cp_comm_strategy", "allgather"], GLOBAL_BATCH),
        # Ulysses: the heads swapped with the sequence; on cp 4 the 2 KV heads are expanded to 4.
        ("context parallel 2 by Ulysses", 2, ["--cp_size", "2", "--cp_comm_strategy", "ulysses"],
         GLOBAL_BATCH),
        ("context parallel 4 by Ulysses", 4, ["--cp_size", "4", "--cp_comm_strategy", "ulysses"],
         GLOBAL_BATCH),
        ("context parallel 4", 4, ["--cp_size", "4"], GLOBAL_BATCH),
        ("data parallel 2 x context parallel 2 on 4", 4, ["--cp_size", "2"], GLOBAL_BATCH // 2),
        ("FSDP over dp_shard 2 x cp 2 on 4", 4, ["--use_fsdp", "--cp_size", "2"],
         GLOBAL_BATCH // 2),
        ("context parallel 2 x tensor parallel 2 on 4", 4, ["--cp_size", "2", "--tp_size", "2"],
         GLOBAL_BATCH),
    ]
    # Note [Expert parallel]: each layer's experts split over ep data-parallel ranks, tokens sent
    # to them and back by all-to-all.
    experts = [
        ("expert parallel 2", 2, ["--ep_size", "2"], GLOBAL_BATCH // 2),
        ("expert parallel 2 x data parallel 2 on 4", 4, ["--ep_size", "2"], GLOBAL_BATCH // 4),
        ("expert parallel 4", 4, ["--ep_size", "4"], GLOBAL_BATCH // 4),
        # ZeRO shards the rest over dp; the experts stay whole on their ranks.
        ("expert parallel 2, FSDP (ZeRO-3) on the rest", 2, ["--ep_size", "2", "--use_fsdp"],
         GLOBAL_BATCH // 2),
        ("expert parallel 2 x data parallel 2, ZeRO-2 on the rest on 4", 4,
         ["--ep_size", "2", "--use_deepspeed", "--zero_stage", "2"], GLOBAL_BATCH // 4),
        # Every tp rank holds its experts whole: ep over the dp ranks of each tp coordinate.
        ("expert parallel 2 x tensor parallel 2 on 4", 4, ["--ep_size", "2", "--tp_size", "2"],
         GLOBAL_BATCH // 2),
    ]
    # Note [Expert parallel]: ep carved from dp x cp: a token goes to its expert wherever its
    # chunk is.
    context_experts = [
        ("context parallel 2, experts over ep 2", 2, ["--cp_size", "2", "--ep_size", "2"],
         GLOBAL_BATCH),
        ("data parallel 2 x context parallel 2, experts over ep 4 on 4", 4,
         ["--cp_size", "2", "--ep_size", "4"], GLOBAL_BATCH // 2),
        ("FSDP over dp_shard 2 x cp 2, experts over ep 2 on 4", 4,
         ["--use_fsdp", "--cp_size", "2", "--ep_size", "2"], GLOBAL_BATCH // 2),
    ]
    if len(sys.argv) > 4 and sys.argv[4] == "context_parallel":
        for name, config, runs in (("qwen3", dense, contexts),
                                   ("qwen3_moe", moe, contexts + context_experts)):
            check(train_llm, cli, fresh_dir(os.path.join(root, name.replace(" ", "_"))), name,
                  config, runs)
        return
    for name, config, runs in (("qwen3", dense, layouts),
                               ("qwen3_moe", moe, layouts + pipelines + experts),
                               ("qwen3 untied", untied, pipelines),
                               ("qwen3_moe 32 experts", sparse,
                                [layouts[0], layouts[1], pipelines[1]] + experts)):
        check(train_llm, cli, fresh_dir(os.path.join(root, name.replace(" ", "_"))), name, config,
              runs, against_pytorch=name != "qwen3_moe 32 experts")


def check(train_llm, cli, work, family, config, layouts, against_pytorch=True):
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    perturb(model)
    model_dir = os.path.join(work, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    data = os.path.join(work, "data.jsonl")
    ids = write_rows(data, config.vocab_size, 8, SEQ, seed=6)
    before = load_file(os.path.join(model_dir, "model.safetensors"))  # by the files' names
    experts = getattr(config, "num_experts", 0) or 0
    routed = [] if experts else None
    norms = train_like_train_llm(model, list(model.parameters()), ids, STEPS, GLOBAL_BATCH, LR,
                                 WD, CLIP, routed)
    # By the files' names (transformers holds a mixture's experts fused).
    model.save_pretrained(os.path.join(work, "pytorch"), safe_serialization=True)
    want = load_file(os.path.join(work, "pytorch", "model.safetensors"))
    whose = "PyTorch's"

    def out_dir_of(name):
        return os.path.join(work, "out-" + name.replace(" ", "_").replace(",", ""))

    # The layouts of one size train as jobs of one launch (common.launch_jobs).
    outputs = launch_jobs(cli, train_llm, [
        (n, flags, ["--model", model_dir, "--data", data, "--seq_len", str(SEQ),
                    "--batch_size", str(batch), "--steps", str(STEPS), "--lr", str(LR),
                    "--warmup_steps", "1", "--min_lr_ratio", "0.1", "--weight_decay", str(WD),
                    "--clip", str(CLIP), "--log_every", "1", "--save", out_dir_of(name)])
        for name, n, flags, batch in layouts], work)
    for (name, n, flags, batch), out in zip(layouts, outputs):
        out_dir = out_dir_of(name)
        if "--cp_size" in flags:  # the model itself splits its sequences, not only the mesh
            cp = flags[flags.index("--cp_size") + 1]
            said = f"context parallel: cp {cp} ("
            if said not in out or f"{SEQ // int(cp)} of every {SEQ} positions per rank" not in out:
                fail(f"{family}, {name}: train_llm does not say its model splits every "
                     f"sequence over cp {cp}:\n{out}")
        if "--ep_size" in flags:  # the experts are split, not only the mesh
            ep = int(flags[flags.index("--ep_size") + 1])
            said = f"expert parallel: ep {ep}, {config.num_experts // ep} of every layer's " \
                   f"{config.num_experts} experts per rank"
            if said not in out:
                fail(f"{family}, {name}: train_llm does not say it split the experts over ep "
                     f"{ep}:\n{out}")
        logged = [float(x) for x in re.findall(r"step \d+ loss \S+ lr \S+ grad_norm (\S+)", out)]
        if len(logged) != STEPS:
            fail(f"{family}, {name}: {len(logged)} grad_norm reports, expected {STEPS}:\n{out}")
        got = load_file(os.path.join(out_dir, "model.safetensors"))
        counts = []
        if experts:
            # Each step's tokens per expert, over every rank: dropless, each sparse layer's
            # counts sum to top-k x the step's tokens, and they are the reference's.
            for line in re.findall(r"step \d+ tokens per expert:(.*)", out):
                counts.append([[int(c) for c in layer.split()]
                               for layer in re.findall(r"layer \d+ \[([^]]*)\]", line)])
            if len(counts) != STEPS:
                fail(f"{family}, {name}: {len(counts)} tokens-per-expert reports, expected "
                     f"{STEPS}:\n{out}")
            for k, step in enumerate(counts):
                for layer in step:
                    if len(layer) != experts or sum(layer) != \
                            config.num_experts_per_tok * GLOBAL_BATCH * SEQ:
                        fail(f"{family}, {name}: step {k + 1}'s tokens per expert {layer} are not "
                             f"{config.num_experts_per_tok} x {GLOBAL_BATCH * SEQ} tokens over "
                             f"{experts} experts")
        if not against_pytorch and whose == "PyTorch's":  # the first layout is the reference
            norms, want, whose, routed = logged, got, f"tandem's {name}'s", counts
            print(f"{family}, {name}: the reference of the layouts that follow")
            continue
        for k, (a, b) in enumerate(zip(logged, norms)):
            if abs(a - b) > 1e-5 * b:
                fail(f"{family}, {name}: step {k + 1}'s gradient norm is {a}, {whose} {b}")
        if experts and counts != routed:
            fail(f"{family}, {name}: tokens per expert {counts}, {whose} {routed}")
        worst = 0.0
        for pname, p in want.items():
            if pname not in got:
                fail(f"{family}, {name}: the saved folder has no {pname}")
            if pname not in before:
                fail(f"{family}, {name}: the initial folder has no {pname}")
            moved = (p - before[pname]).abs().max().item()
            diff = (got[pname] - p).abs().max().item()
            d = diff / moved if moved > 0 else (0.0 if diff == 0 else float("inf"))
            if d > 1e-2:
                fail(f"{family}, {name}: {pname} differs from {whose} by {d:.3g} of how far "
                     f"training moved it after {STEPS} steps")
            worst = max(worst, d)
        back = AutoModelForCausalLM.from_pretrained(out_dir)
        if type(back).__name__ != type(model).__name__:
            fail(f"{family}, {name}: the saved folder loads as {type(back).__name__}")
        print(f"{family}, {name}: gradient norms within 1e-5, {len(want)} tensors within "
              f"{worst:.2e} of the distance {whose} training moved them, after {STEPS} steps" +
              (f"; tokens per expert equal to {whose} at every step" if experts else ""))


if __name__ == "__main__":
    main()
