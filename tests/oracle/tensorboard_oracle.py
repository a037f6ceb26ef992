"""TensorBoard's own event reader loads tandem's event file: the same tags, steps and values.

Usage: tensorboard_oracle.py ORACLE_TOOL WORK_DIR
"""
import os
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common import fresh_dir, fail, load_json, run

tool, work = sys.argv[1], fresh_dir(sys.argv[2])
run([tool, "write-tensorboard", work])
expected = load_json(os.path.join(work, "expected.json"))
acc = EventAccumulator(os.path.join(work, "run"), size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
scalars = set(tags.get("scalars", []))
if scalars != set(expected):
    fail(f"TensorBoard sees scalar tags {sorted(scalars)} (all tags: {tags}), expected {sorted(expected)}")
f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]  # a scalar summary holds a float
for tag, points in expected.items():
    got = [(e.step, e.value) for e in acc.Scalars(tag)]
    want = [(step, f32(v)) for step, v in points]
    if got != want:
        fail(f"tag {tag}: TensorBoard reads {got}, expected {want}")
print(f"TensorBoard read {len(expected)} tags, {sum(len(p) for p in expected.values())} points, equal")
