"""The Python peer of async_save_bench: the same model and loop in PyTorch, saving with
torch.distributed.checkpoint (DCP) synchronously (dcp.save) or asynchronously (dcp.async_save,
whose future is waited on before the next save), on a one-process Gloo group.

    python async_save_peer.py sync|async [--layers L] [--width W] [--batch B] [--steps S]
                                         [--every E] [--dir D]

Prints a "RESULT async_save ..." line with the keys of async_save_bench.
"""
import argparse
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["sync", "async"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--dir", default="/tmp/tandem-async-peer")
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x, y = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    plain, in_flight, blocked, to_disk = [], [], [], []
    future, began, last = None, 0.0, None
    start = time.perf_counter()
    for s in range(1, a.steps + 1):
        t = time.perf_counter()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        (in_flight if future is not None else plain).append(time.perf_counter() - t)
        if future is not None and future.done():
            future.result()
            to_disk.append(time.perf_counter() - began)
            future = None
        if s % a.every != 0 or s == a.steps:
            continue
        b = time.perf_counter()
        last = os.path.join(a.dir, "checkpoint_%d" % (s // a.every))
        state = {"model": net.state_dict(), "optim": opt.state_dict()}
        if a.mode == "sync":
            dcp.save(state, checkpoint_id=last)
            blocked.append(time.perf_counter() - b)
            to_disk.append(blocked[-1])
        else:
            if future is not None:
                future.result()
                to_disk.append(time.perf_counter() - began)
            began = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=last)
            blocked.append(time.perf_counter() - b)
    if future is not None:
        future.result()
        to_disk.append(time.perf_counter() - began)
    total = time.perf_counter() - start
    med = lambda v: statistics.median(v) if v else 0
    print("RESULT async_save mode=dcp-%s step_s=%g step_in_flight_s=%g blocked_first_s=%g "
          "blocked_s=%g to_disk_s=%g saves=%d total_s=%g checkpoint_mb=%g" % (
              a.mode, med(plain), med(in_flight), blocked[0] if blocked else 0,
              med(blocked[1:] if len(blocked) > 1 else blocked), med(to_disk), len(blocked), total,
              dir_bytes(last) / 1e6 if last else 0), flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
