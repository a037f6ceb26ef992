"""PyTorch's own sharding on the sharding benchmark's model (bench/sharding_bench.cpp): 24 Linear
layers of 1024 x 1024 with ReLU, AdamW, batch 16 per rank, 1 thread, Gloo. Started by
`tandem launch` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Modes: ddp (DistributedDataParallel),
zero1 (ZeroRedundancyOptimizer over DDP: optimizer state sharded), fsdp (FSDP2 fully_shard on
every Linear and the root: parameters, gradients and optimizer state sharded). Prints
"RESULT sharding <mode> samples_per_s=<x> rss_peak_kb=<y>" on rank 0 (the largest RSS peak over
the ranks; PyTorch has no CPU allocator statistics)."""
import argparse
import resource
import time

import torch
import torch.distributed as dist

WIDTH, LAYERS, ROWS = 1024, 24, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["ddp", "zero1", "fsdp"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers)
    if a.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
        for m in net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(net, mesh=mesh)
        model = net
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=8)
        if a.mode == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = 0.0
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            dist.barrier()
            start = time.perf_counter()
        g = torch.Generator().manual_seed(i * world + rank + 1)
        x = torch.randn(ROWS, WIDTH, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    s = time.perf_counter() - start
    rss = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"RESULT sharding {a.mode} samples_per_s={ROWS * a.steps * world / s:.1f} "
              f"rss_peak_kb={int(rss.item())}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
