"""Helpers of the tests against the Python tools: run a command, compare described tensors."""
import json
import os
import re
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


# Variables that say where a rank is in a launch, not how it is configured (the one real launch
# of launch_jobs sets them, never a job), and those of what the launcher itself does (a job
# cannot have its own inside a shared launch): as tests/common/launch.h has them.
_LAUNCH_KEYS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TANDEM_LAUNCHER", "TANDEM_RESTART_COUNT",
                "TANDEM_ERROR_FILE", "TANDEM_HEARTBEAT_FILE", "CUDA_VISIBLE_DEVICES"}
_LAUNCHER_KEYS = {"TANDEM_HEARTBEAT_INTERVAL_S", "TANDEM_PREEMPTION_SIGNAL", "TANDEM_CPU_AFFINITY"}


_ASKED = {}


def _launcher_env(cli, n, flags, program):
    """The variables `tandem launch --dry_run` gives every rank for these flags, less the launch's
    own (a variable whose value differs between ranks is the launch's too). Asked once per
    command line, as tests/common/launch.h does."""
    key = (cli, n, tuple(flags), program)
    if key not in _ASKED:
        _ASKED[key] = _ask_launcher_env(cli, n, flags, program)
    return dict(_ASKED[key])


def _ask_launcher_env(cli, n, flags, program):
    out = run([cli, "launch", "--dry_run", "--num_processes", str(n), "--cpu"] + flags + [program])
    ranks = []
    for line in out.splitlines():
        if line.startswith("rank ") and "(local " in line:
            ranks.append({})
        elif ranks and line.startswith("    ") and "=" in line:
            key, value = line[4:].split("=", 1)
            ranks[-1][key] = value
    if len(ranks) != n:
        fail(f"tandem launch --dry_run did not describe {n} ranks:\n{out}")
    return {k: v for k, v in ranks[0].items()
            if k not in _LAUNCH_KEYS and not k.startswith("TORCHELASTIC_")
            and all(r.get(k) == v for r in ranks)}


def launch_jobs(cli, program, jobs, work):
    """Runs jobs [(n, launch flags, program args)] of `program`, a test build of an example that
    takes `--jobs FILE` (tests/common/example_jobs.cpp), with one launch per number of ranks
    instead of one per job: starting LibTorch is most of a short job's time. Each job gets the
    variables `tandem launch --dry_run` gives its flags, as tests/common/launch.h's launch_jobs
    does. Fails the test when a job fails (with its launch's output); returns each job's lines:
    its ranks' and the launcher's."""
    outputs = [""] * len(jobs)
    by_n = {}
    for i, (n, _, _) in enumerate(jobs):
        by_n.setdefault(n, []).append(i)
    for n, indices in sorted(by_n.items()):
        base = _launcher_env(cli, n, [], program)
        lines = []
        for i in indices:
            env = _launcher_env(cli, n, jobs[i][1], program)
            for k, v in env.items():
                if k in _LAUNCHER_KEYS and base.get(k) != v:
                    fail(f"launch_jobs: {k}={v} acts on the launcher itself; launch that job alone")
            lines.append("job")
            lines += [f"unset {k}" for k in base if k not in env]
            lines += [f"env {k}={v}" for k, v in sorted(env.items())]
            lines += [f"arg {a}" for a in jobs[i][2]]
        path = os.path.join(work, f"jobs-{n}.txt")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        # The program starts once and forks its ranks (Note [Fork start]), as in tests/common/launch.h.
        out = run([cli, "launch", "--num_processes", str(n), "--cpu", "--start_method", "fork",
                   program, "--jobs", path])
        job_of = [0] * n  # the job each rank last announced
        ended = [set() for _ in indices]
        for line in out.splitlines():
            m = re.match(r"\[rank (\d+)\] tandem-job(-exit)? (\d+)(?: (-?\d+))?$", line)
            if m and int(m.group(1)) < n and int(m.group(3)) < len(indices):
                rank, k = int(m.group(1)), int(m.group(3))
                if m.group(2):
                    if m.group(4) == "0":
                        ended[k].add(rank)
                else:
                    job_of[rank] = k
                continue
            m = re.match(r"\[rank (\d+)\]", line)
            if m and int(m.group(1)) < n:
                outputs[indices[job_of[int(m.group(1))]]] += line + "\n"
            else:
                for k in range(min(job_of), len(indices)):
                    outputs[indices[k]] += line + "\n"
        for k, i in enumerate(indices):
            if len(ended[k]) != n:
                fail(f"launch_jobs: job {k} ({jobs[i][1]} {jobs[i][2]}) did not end on every rank "
                     f"of {n}:\n{out}")
    return outputs


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


def whole_libtorch_env(env=None):
    """`env` (os.environ by default) without the folder of the leaner libtorch_cpu that ctest puts
    first on LD_LIBRARY_PATH (Note [A leaner LibTorch for the tests], tests/CMakeLists.txt): for
    the runs whose resident memory is compared with what users see."""
    env = dict(os.environ if env is None else env)
    slim = env.pop("TANDEM_TEST_SLIM_LIBTORCH", "")
    if slim and "LD_LIBRARY_PATH" in env:
        kept = [p for p in env["LD_LIBRARY_PATH"].split(":") if p and p != slim]
        if kept:
            env["LD_LIBRARY_PATH"] = ":".join(kept)
        else:
            del env["LD_LIBRARY_PATH"]
    return env


def fresh_dir(path):
    """An empty directory at path (what an earlier run left there is removed)."""
    import shutil
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path

