"""bench/sections/70-inference.sh: a GPT-2 of the shape of the 124M one (random weights, fixed
seed, saved by save_pretrained), 20 greedy tokens after a 3-token prompt: transformers' own
generate() (the Python peer), generate_gpt2 in memory (the plain LibTorch loop), under a memory
cap with disk offload, and int8 / int4 weight-only quantized; weights in memory, peak resident
memory, tokens/s, and the error against fp32 (largest logit difference, greedy tokens agreeing).
Usage: inference_peer.py GENERATE_GPT2 TANDEM_CLI WORK_DIR REPS"""
import os
import re
import resource
import statistics
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

PROMPT = [464, 2068, 7586]
NEW = 20


def main():
    gen, cli, work, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.makedirs(work, exist_ok=True)
    model_dir = os.path.join(work, "gpt2-124m-random")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        model.save_pretrained(model_dir, safe_serialization=True)
    weights = sum(p.numel() * 4 for p in model.parameters()) / 1e6
    ids = torch.tensor([PROMPT])
    speeds = []
    for _ in range(reps):
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        speeds.append(NEW / (time.time() - t0))
    ref_tokens = out.sequences[0, len(PROMPT):].tolist()
    ref_steps = torch.stack([l[0] for l in out.logits])
    py_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    rows = [("transformers generate (PyTorch 2, 1 thread)", f"{weights:.0f}", f"{py_peak:.0f}",
             statistics.median(speeds), "-", "-")]
    del model

    def tandem(label, directory, *flags):
        speeds, peak, text = [], None, ""
        lf = os.path.join(work, "logits.safetensors")
        for _ in range(reps):
            r = subprocess.run([gen, directory, "--prompt_ids", ",".join(map(str, PROMPT)),
                                "--max_new_tokens", str(NEW), "--logits_out", lf, *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
            if r.returncode != 0:
                rows.append((label, "failed", r.stdout.strip().splitlines()[-1][:80], 0, "", ""))
                return
            text = r.stdout
            speeds.append(float(re.search(r"\(([\d.]+) tokens/s\)", text).group(1)))
            peak = float(re.search(r"peak resident memory ([\d.]+) MB", text).group(1))
        tokens = [int(t) for t in re.search(r"tokens: ([\d,]+)", text).group(1).split(",")]
        steps = load_file(lf)["prompt0.steps"]
        err = (steps - ref_steps).abs().max().item()
        agree = sum(a == b for a, b in zip(tokens, ref_tokens))
        m = re.search(r"weights (.*)", text)
        kept = re.search(r"weights cpu ([\d.]+) MB", text)
        disk = re.search(r"disk ([\d.]+) MB \(", text)
        resident = f"{float(kept.group(1)) if kept else 0:.0f}"
        if disk:
            resident += f" (+ {float(disk.group(1)):.0f} on disk)"
        rows.append((label, resident, f"{peak:.0f}", statistics.median(speeds),
                     f"{err:.1e}", f"{agree}/{NEW}"))
        print(f"  {label}: {m.group(1) if m else ''}", file=sys.stderr)

    tandem("generate_gpt2, in memory (--attention auto)", model_dir)
    tandem("generate_gpt2, in memory (--attention manual)", model_dir, "--attention", "manual")
    tandem("generate_gpt2, --max_memory 300MB (8 of 12 blocks on disk)", model_dir,
           "--max_memory", "300MB")
    tandem("generate_gpt2, --max_memory 300MB, --no_prefetch", model_dir, "--max_memory", "300MB",
           "--no_prefetch")
    for method, extra in (("int8", []), ("int4", ["--group_size", "128"]),
                          ("int4", ["--group_size", "32"])):
        name = method + ("" if not extra else f"-g{extra[1]}")
        qdir = os.path.join(work, f"gpt2-124m-{name}")
        if not os.path.exists(os.path.join(qdir, "model.safetensors")):
            subprocess.run([cli, "quantize", model_dir, qdir, f"--{method}"] + extra, check=True,
                           stdout=subprocess.DEVNULL)
        tandem(f"generate_gpt2, {name} checkpoint", qdir)
        tandem(f"generate_gpt2, {name} checkpoint, --max_memory 200MB", qdir, "--max_memory",
               "200MB")
    print("| run | weights in memory (MB) | peak resident (MB) | tokens/s | largest logit "
          "difference vs fp32 | greedy tokens as fp32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        speed = f"{r[3]:.1f}" if isinstance(r[3], float) else str(r[3])
        print(f"| {r[0]} | {r[1]} | {r[2]} | {speed} | {r[4]} | {r[5]} |")


if __name__ == "__main__":
    main()
