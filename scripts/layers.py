#!/usr/bin/env python3
"""The house's layers, checked on the includes (../DESIGN.md's "The house").

Every library file (include/tandem/, src/) belongs to one layer, from the ground up; a file may
include files of its own layer and of lower ones, and of a higher one only when that file is a
plain table of names (the TANDEM_* variables). Prints the layers with their files and every
include that runs up a layer; exits 1 when there is one, or when a file belongs to no layer.

  scripts/layers.py            # check; prints the layers and what breaks them
  scripts/layers.py --quiet    # only what breaks them
"""
import os
import re
import sys

# From the ground up. A file's layer is the first rule whose pattern matches its path below
# include/tandem/ or src/ (without the extension).
LAYERS = [
    ("compat, state, data", [r"compat/", r"detail/", r"data/", r"state$", r"version$", r"error$", r"preemption$",
                              r"host_allocator$"]),
    ("comm, nn, runtime", [r"comm/", r"nn/", r"runtime$", r"torch_runtime$", r"optimizer$"]),
    ("checkpoint", [r"checkpoint/"]),
    ("precision", [r"precision/"]),
    ("parallel", [r"parallel/"]),
    ("track", [r"track/"]),
    ("run configuration", [r"config/run_config$", r"config/run_env$", r"config/env_readers?$",
                           r"accelerator_options$"]),
    ("accelerator", [r"accelerator$", r"accelerator_state$", r"accelerator_replicas$"]),
    ("inference", [r"inference/"]),
    ("models, peft", [r"models/", r"peft/"]),
    ("config files", [r"config/"]),
    ("launch, trials", [r"launch/", r"trials/"]),
    ("tools", [r"tandem$"]),
]
# Plain tables of names that any layer may include.
NAME_TABLES = {"include/tandem/config/run_env.h"}


def layer_of(path):
    rel = re.sub(r"^(include/tandem|src)/", "", path).rsplit(".", 1)[0]
    for i, (_, patterns) in enumerate(LAYERS):
        if any(re.match(p, rel) for p in patterns):
            return i
    return None


def library_files(root):
    for base in ("include/tandem", "src"):
        for d, _, names in sorted(os.walk(os.path.join(root, base))):
            for n in sorted(names):
                if n.endswith((".h", ".cpp", ".cu")):
                    yield os.path.relpath(os.path.join(d, n), root)


def resolve(root, include, frm):
    if include.startswith("tandem/"):
        return "include/" + include
    for cand in (os.path.normpath(os.path.join(os.path.dirname(frm), include)), "src/" + include):
        if os.path.exists(os.path.join(root, cand)):
            return cand
    return None


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    quiet = "--quiet" in sys.argv
    files = list(library_files(root))
    by_layer = {}
    broken = []
    for f in files:
        lf = layer_of(f)
        if lf is None:
            broken.append(f"{f}: belongs to no layer (add it to LAYERS in scripts/layers.py)")
            continue
        by_layer.setdefault(lf, []).append(f)
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                if not m:
                    continue
                target = resolve(root, m.group(1), f)
                if target is None or target in NAME_TABLES:
                    continue
                lt = layer_of(target)
                if lt is not None and lt > lf:
                    broken.append(f"{f}:{n}: includes {target}, a higher layer "
                                  f"({LAYERS[lf][0]} -> {LAYERS[lt][0]})")
    if not quiet:
        for i, (name, _) in enumerate(LAYERS):
            print(f"{i:2d} {name}: {len(by_layer.get(i, []))} files")
    for b in broken:
        print(b)
    print(f"layers: {len(files)} files, {len(broken)} includes running up a layer")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
