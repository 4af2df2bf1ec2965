"""What a small test job costs in CPU with each model: the trainer's launcher on this machine alone
(``python -m agent.launch --standalone``, 2 processes forked from its zygote, gloo), one job shape
the deploy tests use (48 steps of 32 samples) and the fault tests' (128 steps of 4 samples with a
checkpoint every 8), once per model in turn, ``--rounds`` times, so that every model sees the same
machine. The figure is the machine's busy CPU seconds over the job (/proc/stat: the launcher, its
zygote and its workers, all of which end with it), and the job's wall time.

Given ``--old TREE`` (a checkout of another commit: ``git worktree add /tmp/job-old HEAD~1``), every
job also runs from that tree, right before or after this one's (the order alternating round by
round), so that a change to the trainer is measured side by side on the same machine.

Run: python bench/bench_job_cpu.py [--rounds 3] [--models convnet,lenet] [--old TREE] [--out results/job_cpu.json]
Prints JSON: per shape and model (and tree: ``this``, ``old``), every round's busy CPU and wall
seconds and their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "deploy_48x32": ["--synthetic-size", "1536", "--batch-size", "32", "--epochs", "2", "--log-every", "2",
                     "--eval-batch-size", "128"],
    "faults_128x4": ["--synthetic-size", "512", "--batch-size", "4", "--epochs", "2", "--log-every", "1",
                     "--ckpt-every", "8", "--eval-batch-size", "256"],
}


def busy_cpu_seconds() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_job(work: Path, model: str, shape: list[str], root: Path = ROOT) -> tuple[float, float, int]:
    """(busy CPU s, wall s, training steps recorded) of one job of the trainer in ``root``, in an
    empty directory."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "DDP_PREFORK": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    argv = [sys.executable, "-m", "agent.launch", "--standalone", "--nproc-per-node", "2", "--",
            "--dataset", "synthetic", "--model", model, *shape,
            "--ckpt-dir", str(work / "ckpt"), "--data-dir", str(work / "data")]
    before, start = busy_cpu_seconds(), time.perf_counter()
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    wall, busy = time.perf_counter() - start, busy_cpu_seconds() - before
    if proc.returncode != 0:
        raise SystemExit(f"the {model} job failed:\n{proc.stderr[-3000:]}")
    steps = sum('"kind": "train"' in line for line in (work / "ckpt" / "metrics.jsonl").read_text().splitlines())
    return busy, wall, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="convnet,lenet")
    p.add_argument("--old", type=Path, default=None, help="another tree whose trainer runs the same jobs")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    models = args.models.split(",")
    trees = {"this": ROOT, **({"old": args.old.resolve()} if args.old else {})}
    rows: dict = {shape: {m: {t: {"busy_cpu_s": [], "wall_s": []} for t in trees} for m in models} for shape in SHAPES}
    with tempfile.TemporaryDirectory(prefix="ddp-bench-job-") as tmp:
        for r in range(args.rounds):
            for shape, flags in SHAPES.items():
                for model in models:
                    for tree in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                        busy, wall, steps = run_job(Path(tmp) / "job", model, flags, trees[tree])
                        row = rows[shape][model][tree]
                        row["busy_cpu_s"].append(round(busy, 2))
                        row["wall_s"].append(round(wall, 2))
                        row["steps_logged"] = steps
    for shape in rows.values():
        for model, by_tree in shape.items():
            for row in by_tree.values():
                row["median_busy_cpu_s"] = statistics.median(row["busy_cpu_s"])
                row["median_wall_s"] = statistics.median(row["wall_s"])
            if args.old is None:
                shape[model] = by_tree["this"]  # one tree: the record's shape as before
    record = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} cores)",
              "python": platform.python_version(), "rounds": args.rounds, "shapes": rows}
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
