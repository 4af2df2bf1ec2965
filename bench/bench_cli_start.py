"""What one ``ddp-deploy`` invocation costs before it does anything: the CPU seconds of a fresh
``python -m deploy --help``, of ``python -c "import deploy.cli"``, of ``validate`` (which also
reads hosts.example.yaml, SSH nodes: the inventory's models are built and used) and of
``status --json`` on a one-node ``connection: local`` inventory (which runs its commands on the
node, here), almost all imports.

Each command runs N times in a fresh interpreter; its CPU is the user + system time the child
used (``resource.getrusage(RUSAGE_CHILDREN)`` before and after: the runs are one at a time).
Given ``--old TREE`` (a checkout of another commit, e.g. ``git worktree add /tmp/cli-old HEAD``),
the same commands run from that tree too, alternating with this one's run by run, so that both
see the same machine; each tree's commands run in its root (``python -m``/``-c`` put the working
directory first on sys.path) with PYTHONPATH set to it.

Run: python bench/bench_cli_start.py [--runs 20] [--old /tmp/cli-old] [--smoke]
Prints JSON: per tree and command, the median CPU and wall seconds of the runs (and old/new).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

COMMANDS = {
    "help": ["-m", "deploy", "--help"],
    "import": ["-c", "import deploy.cli"],
    "validate": ["-m", "deploy", "--hosts", "hosts.example.yaml", "validate"],
    "status_local": ["-m", "deploy", "--hosts", "{local}", "status", "--json"],
}


def local_hosts(directory: Path, python: str) -> Path:
    """A one-node inventory (``here``, 127.0.0.1, connection: local, host runtime) in ``directory``."""
    hosts = directory / "hosts.yaml"
    hosts.write_text(json.dumps({  # JSON is YAML
        "job": {"name": "bench-cli-start", "runtime": "host"},
        "rendezvous": {"node": "here", "port": 29400},
        "nodes": [{"name": "here", "address": "127.0.0.1", "connection": "local"}],
        "storage": {"data": {"host": str(directory / "nas/data"), "container": "/data"},
                    "checkpoints": {"host": str(directory / "nas/ckpt"), "container": "/ckpt"}},
        "train": {"python": python},
    }))
    return hosts


def cpu_children() -> float:
    """User + system CPU seconds of this process's children that ended and were waited for."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(tree: Path, args: list[str], python: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``python ARGS`` run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "DDP_DEPLOY_LOG": os.devnull}
    cpu, wall = cpu_children(), time.perf_counter()
    r = subprocess.run([python, *args], cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall, cpu = time.perf_counter() - wall, cpu_children() - cpu
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed: {r.stderr.decode(errors='replace')[-2000:]}")
    return cpu, wall


def measure(trees: dict[str, Path], runs: int, python: str, local: Path) -> dict:
    commands = {name: [a.replace("{local}", str(local)) for a in args] for name, args in COMMANDS.items()}
    samples = {(t, c): ([], []) for t in trees for c in COMMANDS}
    for tree in trees.values():  # compile the bytecode of both trees first: no run pays for it
        for args in commands.values():
            one_run(tree, args, python)
    for _ in range(runs):
        for name, args in commands.items():
            for t, tree in trees.items():
                cpu, wall = one_run(tree, args, python)
                samples[t, name][0].append(cpu)
                samples[t, name][1].append(wall)
    out: dict = {}
    for (t, name), (cpus, walls) in samples.items():
        out.setdefault(t, {})[name] = {"cpu_s": round(statistics.median(cpus), 4),
                                       "wall_s": round(statistics.median(walls), 4),
                                       "cpu_s_min": round(min(cpus), 4), "cpu_s_max": round(max(cpus), 4)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs per command and tree (default 20)")
    p.add_argument("--old", type=Path, default=None, help="another tree to compare with, run alternately")
    p.add_argument("--python", default=sys.executable, help="the interpreter (default: this one)")
    p.add_argument("--smoke", action="store_true", help="one run each: proves that it runs")
    a = p.parse_args(argv)
    trees = {"new": HERE}
    if a.old is not None:
        trees["old"] = a.old.resolve()
    runs = 1 if a.smoke else a.runs
    with tempfile.TemporaryDirectory(prefix="bench-cli-start-") as scratch:
        measured = measure(trees, runs, a.python, local_hosts(Path(scratch), a.python))
    result = {"runs": runs, "python": platform.python_version(), "cpus": os.cpu_count(),
              "trees": {t: str(path) for t, path in trees.items()}, **measured}
    if "old" in trees:
        result["old_over_new_cpu"] = {c: round(result["old"][c]["cpu_s"] / result["new"][c]["cpu_s"], 2)
                                      for c in COMMANDS}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
