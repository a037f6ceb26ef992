"""transformers' Llama, Mistral, Qwen2 and Qwen3 against tandem::models::LlamaForCausalLM, on small
random models made here with fixed seeds (every parameter perturbed, so that norms and biases
count) and saved by save_pretrained, no hub access:
  - logits within 1e-4 (relative to the largest), transformers' causal-LM loss within 1e-5, and
    every parameter's gradient within 1e-4 of PyTorch autograd's;
  - the logits of the key/value cache, fed one token at a time, equal the last position's;
  - what each family adds: grouped-query attention, llama3 and linear rotary scaling, tied and
    untied heads, attention and MLP biases, Qwen2's q/k/v biases, Qwen3's q/k norms and own
    head_dim, Mistral's sliding window and Qwen2's on some layers (both shorter than the batch);
    a sharded checkpoint, and one stored in bfloat16; Mixtral's and Qwen3-MoE's experts (top-2
    of 4, renormalised or not, a dense layer among sparse ones) with the load-balancing loss in
    the loss and equal to transformers' aux_loss;
  - the folder tandem writes back loads in transformers with equal logits (float32), or equal
    bfloat16 weights (saved as bfloat16), with the right architectures;
  - LlamaConfig::parameter_count() equals transformers' count;
  - config keys the port does not compute are refused by name.

Usage: llama_oracle.py ORACLE_TOOL WORK_DIR LIBTORCH_VERSION
"""
import json
import os
import re
import subprocess
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig,  # noqa: E402
                          Qwen2Config, Qwen3Config, Qwen3MoeConfig)

from common import fail, fresh_dir, run  # noqa: E402

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64)
T = 12

CASES = {
    # GQA 4:2, llama3 frequencies, head tied to the embedding.
    "llama": lambda: LlamaConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                  "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 16}),
    # Multi-head, biases everywhere, linear scaling, untied; a sharded checkpoint.
    "llama_bias": lambda: LlamaConfig(**SHAPE, num_key_value_heads=4, attention_bias=True,
                                      mlp_bias=True, hidden_act="gelu_pytorch_tanh",
                                      rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                       "factor": 2.0}),
    # One key/value head, a window of 5 over 12 positions.
    "mistral": lambda: MistralConfig(**SHAPE, num_key_value_heads=1, sliding_window=5),
    # q/k/v biases; layer 1 slides (window 4), layer 0 does not; stored in bfloat16.
    "qwen2": lambda: Qwen2Config(**SHAPE, num_key_value_heads=2, use_sliding_window=True,
                                 sliding_window=4, max_window_layers=1,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # q/k norms, head_dim 16 (not hidden / heads), tied head.
    "qwen3": lambda: Qwen3Config(**SHAPE, num_key_value_heads=2, head_dim=16,
                                 tie_word_embeddings=True),
    # 4 experts, top 2 (renormalised), the load-balancing loss in the loss (coefficient 0.1).
    "mixtral": lambda: MixtralConfig(**SHAPE, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, output_router_logits=True,
                                     router_aux_loss_coef=0.1),
    # Layer 0 dense, layer 1 sparse: 4 experts of width 24, top 2 not renormalised; q/k norms.
    "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPE, num_key_value_heads=2, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=24,
                                        mlp_only_layers=[0], norm_topk_prob=False,
                                        output_router_logits=True, router_aux_loss_coef=0.1),
}


def make(name, path, seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CASES[name](), attn_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.02))
    model.eval()
    kw = {}
    if name == "llama_bias":
        kw["max_shard_size"] = "40KB"
    if name == "qwen2":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True, **kw)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    return ref


def file_gradients(name, ref):
    """The gradients of `ref` under the names its files use: transformers holds a mixture's
    experts fused (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) and Mixtral's
    block as `mlp`, but save_pretrained writes one tensor per expert (Mixtral: block_sparse_moe,
    w1 gate, w3 up, w2 down; Qwen3-MoE: gate_proj, up_proj, down_proj)."""
    mixtral = name == "mixtral"
    out = {}
    for pname, p in ref.named_parameters():
        g = p.grad
        m = re.match(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", pname)
        if m:
            prefix = m.group(1) + (".block_sparse_moe" if mixtral else ".mlp")
            gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            for e in range(g.shape[0]):
                if m.group(2) == "gate_up_proj":
                    half = g.shape[1] // 2
                    out[f"{prefix}.experts.{e}.{gate}.weight"] = g[e, :half]
                    out[f"{prefix}.experts.{e}.{up}.weight"] = g[e, half:]
                else:
                    out[f"{prefix}.experts.{e}.{down}.weight"] = g[e]
            continue
        if mixtral:
            pname = pname.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        out[pname] = g
    return out


def rel(a, b):
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-12)


def check_case(tool, work, name, seed, attention):
    d = fresh_dir(os.path.join(work, f"{name}-{attention}"))
    ref = make(name, os.path.join(d, "model"), seed)
    if name == "llama_bias" and not os.path.exists(
            os.path.join(d, "model", "model.safetensors.index.json")):
        fail("llama_bias: the checkpoint was meant to be sharded")
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 7] = -100
    save_file({"ids": ids, "labels": labels}, os.path.join(d, "batch.safetensors"))
    save_dtype = "bfloat16" if name == "qwen3" else ""
    out = run([tool, "llama", d, attention] + ([save_dtype] if save_dtype else []))
    got = load_file(os.path.join(d, "tandem.safetensors"))

    count = int(out.split(": ", 1)[1].split(" parameters")[0])
    want_count = sum(p.numel() for p in ref.parameters())  # a tied head once
    if count != want_count:
        fail(f"{name}: LlamaConfig::parameter_count() is {count}, transformers has {want_count}")
    res = ref(input_ids=ids, labels=labels)
    res.loss.backward()
    worst = {"logits": rel(got["logits"], res.logits.detach())}
    if worst["logits"] > 1e-4:
        fail(f"{name} ({attention}): logits differ from transformers by {worst['logits']:.3g}")
    loss_diff = abs(got["loss"].item() - res.loss.item()) / abs(res.loss.item())
    if loss_diff > 1e-5:
        fail(f"{name}: loss {got['loss'].item()} vs transformers' {res.loss.item()}")
    grads = 0
    for pname, grad in file_gradients(name, ref).items():
        key = "grad." + pname
        if key not in got:
            fail(f"{name}: tandem has no gradient for {pname}")
        r = rel(got[key], grad)
        if r > 1e-4:
            fail(f"{name} ({attention}): gradient of {pname} differs by {r:.3g}")
        worst["grad"] = max(worst.get("grad", 0.0), r)
        grads += 1
    if "aux_loss" in got:
        if res.aux_loss is None:
            fail(f"{name}: transformers computed no load-balancing loss")
        aux = abs(got["aux_loss"].item() - res.aux_loss.item()) / abs(res.aux_loss.item())
        if aux > 1e-5:
            fail(f"{name}: load-balancing loss {got['aux_loss'].item()} vs {res.aux_loss.item()}")
    r = rel(got["cached_logits"], res.logits[:, -1].detach())
    if r > 1e-4:
        fail(f"{name} ({attention}): the key/value cache's last logits differ by {r:.3g}")

    # The folder written back.
    saved = os.path.join(d, "saved")
    cfg = json.load(open(os.path.join(saved, "config.json")))
    want_arch = type(ref).__name__
    if cfg.get("architectures") != [want_arch]:
        fail(f"{name}: saved architectures {cfg.get('architectures')}, expected [{want_arch}]")
    back = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    if save_dtype == "bfloat16":
        if cfg.get("dtype") != "bfloat16":
            fail(f"{name}: saved dtype {cfg.get('dtype')}, expected bfloat16")
        files = load_file(os.path.join(saved, "model.safetensors"))
        for pname, p in ref.named_parameters():
            if not torch.equal(files[pname], p.detach().to(torch.bfloat16)):
                fail(f"{name}: saved bfloat16 {pname} is not the weight rounded to bfloat16")
    else:
        with torch.no_grad():
            r = rel(back(input_ids=ids).logits, res.logits.detach())
        if r > 1e-6:
            fail(f"{name}: the saved folder's logits in transformers differ by {r:.3g}")
    print(f"{name} ({attention}): logits {worst['logits']:.2e}, {grads} gradients within "
          f"{worst['grad']:.2e}, saved folder loads as {want_arch}; {out.strip()}")


def check_refusals(tool, work):
    base = CASES["llama"]().to_dict()
    variants = {
        "quantization_config": dict(base, quantization_config={"quant_method": "gptq"}),
        "yarn": dict(base, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
        "model_type": dict(base, model_type="gemma"),
        "foo_bar": dict(base, foo_bar=3),
        "num_key_value_heads": dict(base, num_key_value_heads=3),
    }
    for needle, cfg in variants.items():
        d = fresh_dir(os.path.join(work, "refuse-" + needle))
        os.makedirs(os.path.join(d, "model"))
        json.dump(cfg, open(os.path.join(d, "model", "config.json"), "w"))
        r = subprocess.run([tool, "llama", d], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        if r.returncode == 0 or needle not in r.stdout:
            fail(f"a config with {needle} was not refused by name:\n{r.stdout}")
    print(f"refused by name: {', '.join(variants)}")


def main():
    tool, work, version = sys.argv[1], sys.argv[2], sys.argv[3]
    fresh_dir(work)
    attentions = ["manual"] + (["sdpa"] if not version.startswith("1.") else [])
    for i, name in enumerate(CASES):
        for attention in attentions:
            check_case(tool, work, name, 100 + i, attention)
    check_refusals(tool, work)


if __name__ == "__main__":
    main()
