"""Accelerate's own config loader accepts what `tandem config` writes, and `tandem launch`
accepts what `accelerate config default` writes.

Usage: accelerate_config_oracle.py TANDEM_CLI WORK_DIR
"""
import os
import sys

from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.config.default import write_basic_config

from common import fresh_dir, fail, run

cli, work = sys.argv[1], fresh_dir(sys.argv[2])


def accelerate_loads(path, want):
    cfg = load_config_from_file(path)
    for key, value in want.items():
        have = getattr(cfg, key)
        have = getattr(have, "value", have)  # enums (DistributedType, ...) by their value
        if str(have) != str(value):
            fail(f"Accelerate reads {key}={have!r} from {path}, expected {value!r}:\n{open(path).read()}")


# tandem config default, with and without mixed precision.
for mp in ("no", "bf16", "fp16"):
    path = os.path.join(work, f"tandem_default_{mp}.yaml")
    run([cli, "config", "default", "--mixed_precision", mp, "--config_file", path])
    accelerate_loads(path, {"mixed_precision": mp, "compute_environment": "LOCAL_MACHINE"})
# accelerate config default -> tandem launch. `accelerate config default --mixed_precision MP
# --config_file PATH` is write_basic_config(MP, PATH) after its argument parsing; called here, not
# through a process of its own (3 s of CPU importing torch again).
for mp in ("no", "bf16"):
    path = os.path.join(work, f"accelerate_default_{mp}.yaml")
    if not write_basic_config(mp, path):
        fail(f"accelerate's write_basic_config did not write {path}")
    run([cli, "config", "validate", path])
    plan = run([cli, "launch", "--config_file", path, "--cpu", "--dry_run", "true"])
    want = {"no": "TANDEM_MIXED_PRECISION=no", "bf16": "TANDEM_MIXED_PRECISION=bf16"}[mp]
    if want not in plan:
        fail(f"tandem launch --dry_run with Accelerate's file does not show {want}:\n{plan}")
    # And a real launch of one process from that file.
    out = run([cli, "launch", "--config_file", path, "--cpu", "sh", "-c", "echo precision=$TANDEM_MIXED_PRECISION"])
    if f"precision={mp}" not in out:
        fail(f"the launched process did not get mixed_precision {mp}:\n{out}")
print("Accelerate loaded 3 files tandem wrote; tandem launched 2 files Accelerate wrote")
