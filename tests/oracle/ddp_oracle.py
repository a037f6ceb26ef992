"""PyTorch's DistributedDataParallel and tandem train the same model from the same weights on the
same data and batches, on 2 processes over Gloo; the final weights agree. With `bn` the model has a
BatchNorm1d: DDP broadcasts rank 0's buffers before every forward, tandem after every optimizer
step; the weights and the saved BatchNorm statistics (rank 0's) agree too.

Usage: ddp_oracle.py ORACLE_TOOL TANDEM_CLI WORK_DIR [bn]
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from common import fresh_dir, fail, run

STEPS, WORLD, BATCH = 8, 2, 8


BATCHNORM = len(sys.argv) > 4 and sys.argv[4] == "bn"


class Net(torch.nn.Module):  # oracle_tool's Net
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 16)
        if BATCHNORM:
            self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.fc1(x)
        if BATCHNORM:
            h = self.bn(h)
        return self.fc2(torch.tanh(h))


def worker(rank, work, store):
    torch.set_num_threads(1)
    # A file store: no port to pick and lose to another test between picking and binding.
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=WORLD)
    net = Net()
    net.load_state_dict(load_file(os.path.join(work, "init.safetensors")))
    model = torch.nn.parallel.DistributedDataParallel(net)
    data = load_file(os.path.join(work, "data.safetensors"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(STEPS):
        rows = torch.arange(s * BATCH + rank, (s + 1) * BATCH, WORLD)
        opt.zero_grad()
        F.cross_entropy(model(data["x"][rows]), data["y"][rows]).backward()
        opt.step()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in net.state_dict().items()},
                  os.path.join(work, "pytorch.safetensors"))
    # PyTorch's own rank aborted now and then at teardown ("terminate called without an active
    # exception", about 1 run in 10, with or without a barrier first): a Gloo thread still
    # joinable when the interpreter's exit destroys what holds it. DDP (whose reducer holds the
    # group) goes first, both ranks tear Gloo down together, and the worker leaves without the
    # interpreter's teardown: its file is written and closed, and mp.start_processes reads exit
    # code 0.
    del model, opt
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    tool, cli, work = sys.argv[1], sys.argv[2], fresh_dir(sys.argv[3])
    torch.manual_seed(1)
    save_file(Net().state_dict(), os.path.join(work, "init.safetensors"))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(STEPS * BATCH, 10, generator=g)
    save_file({"x": x, "y": torch.randint(0, 3, (STEPS * BATCH,), generator=g)},
              os.path.join(work, "data.safetensors"))
    # Forked, not spawned: each spawned rank imported torch again (2 s of CPU); the ranks' math is
    # the same either way. This process has started no threads to lose in a fork (tensors this
    # small run on the calling thread).
    mp.start_processes(worker, args=(work, os.path.join(work, "store")), nprocs=WORLD, join=True,
                       start_method="fork")
    run([cli, "launch", "--num_processes", str(WORLD), "--cpu", "--num_cpu_threads_per_process", "1",
         tool, "train-ddp", work, str(STEPS)] + (["bn"] if BATCHNORM else []))
    ours = load_file(os.path.join(work, "tandem", "model.safetensors"))
    theirs = load_file(os.path.join(work, "pytorch.safetensors"))
    init = load_file(os.path.join(work, "init.safetensors"))
    if set(ours) != set(theirs):
        fail(f"tandem saved {sorted(ours)}, PyTorch {sorted(theirs)}")
    worst = 0.0
    for name in theirs:
        if torch.equal(theirs[name], init[name]):
            fail(f"PyTorch's {name} did not train")
        if not theirs[name].is_floating_point():  # num_batches_tracked
            if not torch.equal(ours[name], theirs[name]):
                fail(f"{name}: tandem {ours[name].tolist()}, PyTorch DDP {theirs[name].tolist()}")
            continue
        diff = (ours[name] - theirs[name]).abs().max().item()
        worst = max(worst, diff)
        if not torch.allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6):
            fail(f"{name}: tandem and PyTorch DDP differ by up to {diff}")
    print(f"tandem == PyTorch {torch.__version__} DDP{' with BatchNorm' if BATCHNORM else ''} "
          f"after {STEPS} steps on {WORLD} processes "
          f"(largest difference {worst:.3g})")
