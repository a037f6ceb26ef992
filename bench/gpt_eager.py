"""PyTorch eager training throughput of the GPT of examples/common/gpt.h (bench/ddp_peer.py's GPT),
on one device, for the figure next to tandem's train_gpt in scripts/gpu-check.sh.

    python3 bench/gpt_eager.py --device cuda --context 1024 --layers 12 --heads 12 --width 768 \
        --batch 8 --steps 30 --bf16

Prints "RESULT pytorch_eager gpt tokens_per_s=<x> params=<n>".
"""
import argparse
import time

import torch

from ddp_peer import GPT

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--context", type=int, default=1024)
ap.add_argument("--layers", type=int, default=12)
ap.add_argument("--heads", type=int, default=12)
ap.add_argument("--width", type=int, default=768)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--warmup", type=int, default=5)
ap.add_argument("--bf16", action="store_true")
a = ap.parse_args()
dev = torch.device(a.device)
torch.manual_seed(0)
model = GPT(256, a.context, a.layers, a.heads, a.width).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
params = sum(p.numel() for p in model.parameters())
x = torch.randint(256, (a.batch, a.context), device=dev)
y = torch.randint(256, (a.batch, a.context), device=dev)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


for k in range(a.warmup + a.steps):
    if k == a.warmup:
        sync()
        start = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
        loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
sync()
secs = time.perf_counter() - start
print(f"RESULT pytorch_eager gpt tokens_per_s={a.steps * a.batch * a.context / secs:.0f} params={params}", flush=True)
