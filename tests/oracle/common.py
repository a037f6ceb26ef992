"""Helpers of the tests against the Python tools: run a command, compare described tensors."""
import json
import os
import subprocess
import sys

import torch

# safetensors' dtype names for torch dtypes.
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL"}


def fail(msg):
    sys.exit(f"{os.path.basename(sys.argv[0])}: {msg}")


def run(cmd, **kw):
    """Runs cmd; fails the test with its output when it exits non-zero. Returns stdout."""
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if r.returncode != 0:
        fail(f"{' '.join(map(str, cmd))} exited with {r.returncode}:\n{r.stdout}")
    return r.stdout


def describe(t):
    """{dtype, shape, values} as oracle_tool writes it: values as Python numbers, exactly."""
    flat = t.detach().reshape(-1)
    if t.dtype == torch.bool:
        values = [bool(v) for v in flat.tolist()]
    elif t.dtype.is_floating_point:
        values = flat.double().tolist()
    else:
        values = [int(v) for v in flat.tolist()]
    return {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "values": values}


def check_equal(where, tensor, want):
    have = describe(tensor)
    for key in ("dtype", "shape"):
        if have[key] != want[key]:
            fail(f"{where}: {key} {have[key]}, expected {want[key]}")
    if have["values"] != want["values"]:
        diff = next(i for i, (a, b) in enumerate(zip(have["values"], want["values"])) if a != b)
        fail(f"{where}: value {diff} is {have['values'][diff]}, expected {want['values'][diff]}")


def load_json(path):
    with open(path) as f:
        return json.load(f)


def fresh_dir(path):
    """An empty directory at path (what an earlier run left there is removed)."""
    import shutil
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path

