#!/usr/bin/env python3
"""Reads a safetensors file with only json + numpy, independently of tandem, checks the layout
rules of the format, and prints {"metadata": {...}, "tensors": {name: {"dtype", "shape",
"values"}}} as JSON (values flattened, as floats; BF16 widened to F32; F8 as null).

Usage: read_safetensors.py FILE
"""
import json
import struct
import sys

import numpy as np

NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
         "I8": "i1", "U8": "u1", "BOOL": "?"}
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
         "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def fail(msg):
    sys.exit(f"read_safetensors.py: {msg}")


def main(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    if n % 8 != 0:
        fail(f"header length {n} is not a multiple of 8")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    metadata = header.pop("__metadata__", {})
    end = 0
    for name, e in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, stop = e["data_offsets"]
        if begin != end:
            fail(f"{name} begins at {begin}, expected {end}")
        if int(np.prod(e["shape"], dtype=np.int64)) * SIZES[e["dtype"]] != stop - begin:
            fail(f"{name}: shape and offsets disagree")
        end = stop
    if end != len(data):
        fail(f"tensors cover {end} of {len(data)} data bytes")

    out = {}
    for name, e in header.items():
        begin, stop = e["data_offsets"]
        raw = data[begin:stop]
        dtype = e["dtype"]
        if dtype == "BF16":
            arr = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view("<f4")
        elif dtype == "F8_E5M2":  # the top byte of an IEEE half
            arr = (np.frombuffer(raw, "u1").astype(np.uint16) << 8).view("<f2")
        elif dtype == "F8_E4M3":  # E4M3FN: bias 7, no infinities, S.1111.111 is NaN
            b = np.frombuffer(raw, "u1").astype(np.int32)
            sign = np.where(b & 0x80, -1.0, 1.0)
            exp, man = (b >> 3) & 0xF, b & 0x7
            normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
            sub = (man / 8.0) * np.exp2(-6.0)
            arr = sign * np.where(exp == 0, sub, normal)
            arr = np.where((exp == 15) & (man == 7), np.nan, arr)
        elif dtype in NUMPY:
            arr = np.frombuffer(raw, NUMPY[dtype])
        else:
            arr = None
        values = None if arr is None else [float(v) for v in arr.reshape(e["shape"]).ravel()]
        out[name] = {"dtype": dtype, "shape": e["shape"], "values": values}
    print(json.dumps({"metadata": metadata, "tensors": out}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
