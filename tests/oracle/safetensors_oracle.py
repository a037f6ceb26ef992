"""Python's safetensors (and transformers' sharded layout) against tandem, both ways.

1. tandem writes a model with tensors of eight dtypes (one file, and shards + index) and a
   training state (Accelerator::save_state after an AdamW step); Python's safetensors reads every
   file to tensors equal to what the model and optimizer held.
2. Python's safetensors writes tensors of ten dtypes (0-d and empty ones too) with metadata, and
   transformers' save_pretrained writes a small GPT-2 in shards; tandem reads them to equal values.

Usage: safetensors_oracle.py ORACLE_TOOL WORK_DIR
"""
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common import fresh_dir, check_equal, describe, fail, load_json, run

tool, work = sys.argv[1], fresh_dir(sys.argv[2])

# 1. tandem writes, Python reads.
out = os.path.join(work, "written_by_tandem")
run([tool, "write-safetensors", out])
expected = load_json(os.path.join(out, "expected.json"))
model = expected["model"]
one = os.path.join(out, "model", "model.safetensors")
with safe_open(one, framework="pt") as f:
    if f.metadata() != {"format": "pt"}:
        fail(f"model.safetensors metadata {f.metadata()}, expected {{'format': 'pt'}}")
loaded = load_file(one)
if set(loaded) != set(model):
    fail(f"model.safetensors holds {sorted(loaded)}, expected {sorted(model)}")
for name, want in model.items():
    check_equal(f"model.safetensors {name}", loaded[name], want)

index = load_json(os.path.join(out, "sharded", "model.safetensors.index.json"))
files = sorted(set(index["weight_map"].values()))
if len(files) < 2:
    fail(f"the sharded save wrote {len(files)} file(s)")
if set(index["weight_map"]) != set(model):
    fail("the index does not name every tensor")
total = 0
for file in files:
    shard = load_file(os.path.join(out, "sharded", file))
    for name, t in shard.items():
        if index["weight_map"][name] != file:
            fail(f"{name} is in {file}, the index says {index['weight_map'][name]}")
        check_equal(f"{file} {name}", t, model[name])
        total += t.numel() * t.element_size()
if index["metadata"]["total_size"] != total:
    fail(f"index total_size {index['metadata']['total_size']}, the shards hold {total} bytes")

state_dir = expected["state_dir"]
for file, tensors in expected["state"].items():
    got = load_file(os.path.join(state_dir, file))
    if set(got) != set(tensors):
        fail(f"{file} holds {sorted(got)}, expected {sorted(tensors)}")
    for name, want in tensors.items():
        check_equal(f"state {file} {name}", got[name], want)
if not any(k.endswith(".exp_avg_sq") for k in expected["state"]["optimizer.safetensors"]):
    fail("the optimizer file has no AdamW moments")
print(f"Python's safetensors read {len(model)} model tensors (1 file and {len(files)} shards) "
      f"and the training state, equal")

# 2. Python writes, tandem reads.
inp = os.path.join(work, "written_by_python")
os.makedirs(inp, exist_ok=True)
g = torch.Generator().manual_seed(7)
plain = {
    "f32": torch.randn(3, 5, generator=g),
    "f16": torch.randn(4, generator=g).half(),
    "bf16": torch.randn(2, 3, generator=g).bfloat16(),
    "f64": torch.randn(2, generator=g).double(),
    "i64": torch.tensor([-(2**62), 0, 2**62 + 11]),
    "i32": torch.tensor([[-7, 8], [9, 2**31 - 1]], dtype=torch.int32),
    "i16": torch.tensor([-300, 300], dtype=torch.int16),
    "i8": torch.tensor([-128, 127, 0], dtype=torch.int8),
    "u8": torch.tensor([0, 255, 17], dtype=torch.uint8),
    "mask": torch.tensor([True, False, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 3),
}
metadata = {"format": "pt", "written_by": "safetensors " + __import__("safetensors").__version__}
save_file(plain, os.path.join(inp, "plain.safetensors"), metadata=metadata)

import transformers  # noqa: E402  (after torch, which it needs)

config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
torch.manual_seed(0)
gpt = transformers.GPT2LMHeadModel(config)
gpt.save_pretrained(os.path.join(inp, "hf"), max_shard_size="40KB")
hf_index = load_json(os.path.join(inp, "hf", "model.safetensors.index.json"))
hf = {}
for file in sorted(set(hf_index["weight_map"].values())):
    for name, t in load_file(os.path.join(inp, "hf", file)).items():
        hf[name] = describe(t)
with open(os.path.join(inp, "expected.json"), "w") as f:
    json.dump({"plain": {k: describe(v) for k, v in plain.items()}, "plain_metadata": metadata,
               "hf": hf}, f)
print(run([tool, "read-safetensors", inp]).strip())
print(f"tandem read {len(plain)} tensors from Python's safetensors and {len(hf)} from "
      f"transformers {transformers.__version__}'s {len(set(hf_index['weight_map'].values()))} shards")
