"""LoRA against Python's peft: a Llama (grouped-query attention, untied head) with adapters on
q_proj, v_proj and down_proj made by peft (B not zero, so that every adapter computes from the
first step) and saved in PEFT's files; examples/train_llm starts from that adapter and trains four
AdamW steps (warm-up, cosine, weight decay, clipping that binds) with the base frozen, on one
process, data parallel on 2, ZeRO-2 on 2, FSDP (ZeRO-3) on 2, tensor parallel on 2 (q/v column-
and down row-parallel, each adapter split as its layer), FSDP x tensor parallel 2 on 4, pipeline
stages on 2 (each stage with its layers' adapters; 1F1B and zero bubble, whose deferred weight
pass then computes the adapters' gradients only) and pipeline 2 x data parallel 2 on 4. Checked:
  - the adapter tandem saves equals peft's own four steps within 1e-4 (relative), and only the
    adapters changed;
  - peft loads tandem's adapter onto the transformers model, and `tandem merge-lora` gives a
    folder transformers loads with the logits of that model and the weights of peft's
    merge_and_unload (1e-5);
  - refusals: an adapter_config.json with use_dora, a target that matches no module, LoRA on
    pipeline stages that are tensor parallel too.

Usage: llama_lora_oracle.py TRAIN_LLM_JOBS TANDEM_CLI WORK_DIR (TRAIN_LLM_JOBS: tests/train_llm_jobs)
"""
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from common import fail, fresh_dir, launch_jobs, run  # noqa: E402
from llama_common import perturb, train_like_train_llm, write_rows  # noqa: E402

STEPS, GLOBAL_BATCH, SEQ, LR, WD, CLIP = 4, 4, 16, 2e-2, 0.01, 0.05
TARGETS = ["q_proj", "v_proj", "down_proj"]


def base_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager")


def rel(a, b):
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-12)


def main():
    train_llm, cli, work = sys.argv[1], sys.argv[2], fresh_dir(sys.argv[3])
    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    perturb(model)
    base_dir = os.path.join(work, "base")
    model.save_pretrained(base_dir, safe_serialization=True)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                      init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(base_model(base_dir), lora)
    adapter0 = os.path.join(work, "adapter0")
    peft_model.save_pretrained(adapter0)
    data = os.path.join(work, "data.jsonl")
    ids = write_rows(data, config.vocab_size, 8, SEQ, seed=12)

    # peft's own training.
    params = [p for p in peft_model.parameters() if p.requires_grad]
    train_like_train_llm(peft_model, params, ids, STEPS, GLOBAL_BATCH, LR, WD, CLIP)
    want = {k: v.detach() for k, v in get_peft_model_state_dict(peft_model).items()}
    want = {("base_model.model." + k if not k.startswith("base_model.model.") else k): v
            for k, v in want.items()}
    start = load_file(os.path.join(adapter0, "adapter_model.safetensors"))

    common = ["--model", base_dir, "--data", data, "--seq_len", str(SEQ), "--steps", str(STEPS),
              "--lr", str(LR), "--warmup_steps", "1", "--min_lr_ratio", "0.1", "--weight_decay",
              str(WD), "--clip", str(CLIP), "--log_every", "1"]
    layouts = [("one process", 1, [], GLOBAL_BATCH),
               ("data parallel 2", 2, [], GLOBAL_BATCH // 2),
               ("ZeRO-2 on 2", 2, ["--use_deepspeed", "--zero_stage", "2"], GLOBAL_BATCH // 2),
               ("FSDP on 2", 2, ["--use_fsdp"], GLOBAL_BATCH // 2),
               ("tensor parallel 2", 2, ["--tp_size", "2"], GLOBAL_BATCH),
               ("FSDP x tensor parallel 2 on 4", 4, ["--use_fsdp", "--tp_size", "2"],
                GLOBAL_BATCH // 2),
               ("pipeline 2", 2, ["--pp_size", "2"], GLOBAL_BATCH),
               ("pipeline 2, zero bubble", 2, ["--pp_size", "2", "--pp_schedule", "zero_bubble"],
                GLOBAL_BATCH),
               ("pipeline 2 x data parallel 2 on 4", 4, ["--pp_size", "2"], GLOBAL_BATCH // 2)]
    def out_of(name):
        return os.path.join(work, "out-" + name.replace(" ", "_"))

    # Fresh adapters (B zero, A drawn from the run's seed): under tensor parallel each adapter is
    # cut from the dense one the same seed makes, so tp 2 trains to one process's adapter.
    fresh_runs = (("one process", 1, []), ("tensor parallel 2", 2, ["--tp_size", "2"]))

    def fresh_of(name):
        return os.path.join(work, "fresh-" + name.replace(" ", "_"))

    # Every run of one size as jobs of one launch (common.launch_jobs).
    logs = launch_jobs(cli, train_llm, [
        (n, flags, ["--lora_adapter", adapter0, "--batch_size", str(batch), "--save", out_of(name)]
         + common) for name, n, flags, batch in layouts] + [
        (n, flags, ["--lora_r", "4", "--lora_alpha", "8", "--lora_targets", ",".join(TARGETS),
                    "--batch_size", str(GLOBAL_BATCH), "--save", fresh_of(name)] + common)
        for name, n, flags in fresh_runs], work)
    for (name, n, flags, batch), log in zip(layouts, logs):
        out = out_of(name)
        if "LoRA: r 4 alpha 8 on 6 layers" not in log:
            fail(f"{name}: train_llm did not say what it adapted:\n{log}")
        if "zero bubble" in name and "pipeline: schedule ZeroBubble" not in log:
            fail(f"{name}: the run did not use the zero-bubble schedule:\n{log}")
        got = load_file(os.path.join(out, "adapter_model.safetensors"))
        if set(got) != set(want):
            fail(f"{name}: adapter names {sorted(got)} differ from peft's {sorted(want)}")
        worst = 0.0
        for k, v in want.items():
            d = rel(got[k], v)
            if d > 1e-4:
                fail(f"{name}: {k} differs from peft's training by {d:.3g}")
            if torch.equal(got[k], start[k]):
                fail(f"{name}: {k} did not change")
            worst = max(worst, d)
        print(f"{name}: {len(want)} adapter tensors within {worst:.2e} of peft's {STEPS} steps")

    fresh = {name: load_file(os.path.join(fresh_of(name), "adapter_model.safetensors"))
             for name, _, _ in fresh_runs}
    worst = 0.0
    for k, v in fresh["one process"].items():
        d = rel(fresh["tensor parallel 2"][k], v)
        if d > 1e-4:  # as against peft: AdamW's steps on near-zero gradients
            fail(f"fresh adapters: {k} under tensor parallel 2 differs from one process's by {d:.3g}")
        worst = max(worst, d)
    print(f"fresh adapters: tensor parallel 2 within {worst:.2e} of one process after {STEPS} steps")

    # tandem's adapter in peft, and merged by tandem.
    out = os.path.join(work, "out-one_process")
    tuned = PeftModel.from_pretrained(base_model(base_dir), out).eval()
    merged_dir = os.path.join(work, "merged")
    run([cli, "merge-lora", base_dir, out, merged_dir])
    merged = base_model(merged_dir).eval()
    with torch.no_grad():
        d = rel(merged(input_ids=ids).logits, tuned(input_ids=ids).logits)
        if d > 1e-5:
            fail(f"merge-lora: the merged folder's logits differ from peft's by {d:.3g}")
        reference = tuned.merge_and_unload()
        theirs = dict(reference.named_parameters())
        for k, v in merged.named_parameters():
            if rel(v, theirs[k]) > 1e-5:
                fail(f"merge-lora: {k} differs from peft's merge_and_unload")
    print(f"peft loads tandem's adapter; merge-lora's folder has its logits (within {d:.2e}) "
          f"and merge_and_unload's weights")

    # Refusals.
    dora = os.path.join(work, "dora")
    fresh_dir(dora)
    cfg = json.load(open(os.path.join(adapter0, "adapter_config.json")))
    cfg["use_dora"] = True
    json.dump(cfg, open(os.path.join(dora, "adapter_config.json"), "w"))
    cases = [("use_dora", [train_llm, "--lora_adapter", dora] + common + ["--batch_size", "4"]),
             ("'nope', which matches no module",
              [train_llm, "--lora_r", "4", "--lora_targets", "q_proj,nope"] + common +
              ["--batch_size", "4"]),
             ("LoRA under --pp_size 2 x --tp_size 2",
              [cli, "launch", "--num_processes", "4", "--cpu", "--pp_size", "2", "--tp_size", "2",
               train_llm, "--lora_r", "4"] + common + ["--batch_size", "4"])]
    for needle, cmd in cases:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode == 0 or needle not in r.stdout:
            fail(f"expected a refusal naming {needle!r}:\n{r.stdout}")
    print("refused: use_dora, a target matching nothing, LoRA on pipeline stages x tensor parallel")


if __name__ == "__main__":
    main()
