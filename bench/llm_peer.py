"""PyTorch's own training of the LLM benchmark's model (bench/sections/48-llm.sh): transformers'
LlamaForCausalLM made from the same config.json, AdamW, the same token windows of the same .bin
(uint16 ids, windows of --seq_len + 1 cut as train_llm cuts them: sample i of step s is window
(s * world + rank) * batch + i), 1 thread per process, PyTorch eager. One process, or several
under `tandem launch` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with DistributedDataParallel
over Gloo. Prints "RESULT llm_peer <mode> tokens_per_s=<x> step_s=<y> rss_peak_kb=<z>" on rank 0:
tokens of every rank over the timed steps (after --warmup steps), the median step time, the
largest RSS peak over the ranks."""
import argparse
import os
import resource
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    cfg = AutoConfig.from_pretrained(a.config)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.train()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ids = np.fromfile(a.data, dtype=np.uint16).astype(np.int64)
    window = a.seq_len + 1
    windows = len(ids) // window
    times = []
    for s in range(a.warmup + a.steps):
        rows = []
        for i in range(a.batch_size):
            w = ((s * world + rank) * a.batch_size + i) % windows
            rows.append(torch.from_numpy(ids[w * window:(w + 1) * window]))
        batch = torch.stack(rows)
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
        if s >= a.warmup:
            times.append(time.perf_counter() - start)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.int64)
    if world > 1:
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        step = statistics.median(times)
        tokens = world * a.batch_size * a.seq_len
        mode = "ddp" if world > 1 else "eager"
        print(f"RESULT llm_peer {mode} tokens_per_s={tokens / step:.1f} step_s={step:.3f} "
              f"rss_peak_kb={int(rss.item())}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
