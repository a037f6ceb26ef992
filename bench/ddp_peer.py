"""PyTorch's own DistributedDataParallel on the workloads of dp_bench.cpp: the column a user
would compare tandem with. Run one process per rank under `tandem launch` (which sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun does) with Debian's python3-torch, so that
both sides use the same LibTorch 1.13 and the same BLAS.

    tandem launch --num_processes 2 --cpu /usr/bin/python3 bench/ddp_peer.py --model mlp

Prints "RESULT pytorch_ddp <model> world=<n> samples_per_s=<x>" from rank 0.

With --accelerate the same loop runs through Hugging Face Accelerate (Accelerator.prepare and
accelerator.backward), launched by `accelerate launch --cpu --multi_gpu --num_processes N`; it
prints "RESULT accelerate ...".
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class MLP(nn.Module):  # examples/common/mlp.h
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 512), nn.Linear(512, 512), nn.Linear(512, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Attention(nn.Module):  # examples/common/gpt.h, CausalSelfAttention
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.heads
        q, k, v = (t.view(B, T, self.heads, hd).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = q.matmul(k.transpose(-2, -1)) / math.sqrt(hd)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
        return self.proj(att.matmul(v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln2, self.fc, self.fc_proj = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):  # ctx 128, 4 layers, 4 heads, width 128, head tied to the embedding
    def __init__(self, vocab=256, context=128, layers=4, heads=4, width=128):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.ln_f(x).matmul(self.wte.weight.t())
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--comm-hook", default="none", choices=["none", "fp16", "bf16"])
    ap.add_argument("--accelerate", action="store_true")
    a = ap.parse_args()
    batch = a.batch or (8 if a.model == "gpt" else 64)
    steps = a.steps or (60 if a.model == "gpt" else 600)
    torch.set_num_threads(int(os.environ.get("TANDEM_NUM_CPU_THREADS", "1")))
    if a.accelerate:
        import accelerate
        acc = accelerate.Accelerator(cpu=True)
        rank, world = acc.process_index, acc.num_processes
    else:
        acc = None
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    total = a.warmup + steps
    n = batch * total
    if a.model == "gpt":
        model = GPT()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        x, y = torch.randint(256, (n, 128)), torch.randint(256, (n, 128))
        loss_fn = lambda m, xb, yb: m(xb, yb)
    else:
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(n, 784), torch.randint(10, (n,))
        loss_fn = lambda m, xb, yb: F.cross_entropy(m(xb), yb)
    if acc is not None:
        model, opt = acc.prepare(model, opt)
    elif world > 1:
        model = nn.parallel.DistributedDataParallel(model)
        if a.comm_hook == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif a.comm_hook == "bf16":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    order = torch.randperm(n)
    start = None
    for k in range(total):
        if k == a.warmup:
            if world > 1 or acc is None:
                dist.barrier()
            start = time.perf_counter()
        idx = order[k * batch:(k + 1) * batch]
        opt.zero_grad()
        loss = loss_fn(model, x[idx], y[idx])
        if acc is not None:
            acc.backward(loss)
        else:
            loss.backward()
        opt.step()
    if world > 1 or acc is None:
        dist.barrier()
    secs = time.perf_counter() - start
    if rank == 0:
        tag = "pytorch_ddp" if a.comm_hook == "none" else "pytorch_ddp_" + a.comm_hook
        if acc is not None:
            tag = "accelerate"
        print(f"RESULT {tag} {a.model} world={world} samples_per_s={steps * batch * world / secs:.2f}", flush=True)


if __name__ == "__main__":
    main()
