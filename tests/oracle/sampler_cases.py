"""Writes, with the installed PyTorch's own torch.utils.data.DistributedSampler, the order of every
case of tests/data/pytorch_sampler_cases.json (recorded with PyTorch 1.13), in the same format:
the sampler test then checks tandem against this PyTorch too.

Usage: sampler_cases.py RECORDED_JSON OUT_JSON
"""
import json
import os
import sys

import torch
from torch.utils.data import DistributedSampler

recorded, out = sys.argv[1], sys.argv[2]
with open(recorded) as f:
    cases = json.load(f)["cases"]
fresh = []
for c in cases:
    ranks = []
    for r in range(c["num_replicas"]):
        s = DistributedSampler(range(c["size"]), num_replicas=c["num_replicas"], rank=r,
                               shuffle=c["shuffle"], seed=c["seed"], drop_last=c["drop_last"])
        s.set_epoch(c["epoch"])
        ranks.append(list(iter(s)))
    fresh.append({k: c[k] for k in ("size", "num_replicas", "shuffle", "drop_last", "seed", "epoch")}
                 | {"ranks": ranks})
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
with open(out, "w") as f:
    json.dump({"generator": f"torch.utils.data.DistributedSampler, PyTorch {torch.__version__}",
               "cases": fresh}, f)
print(f"{len(fresh)} cases from PyTorch {torch.__version__}")
