"""Makes docs/plot.png, the README's example picture of deploy/observe/plot.py (``ddp-deploy plot``).

Two short runs of the real trainer on this machine's CPU (the launcher, 2 processes, gloo, the
synthetic dataset), each with its own run id as ``ddp-deploy launch`` gives one, at two learning
rates; their metrics.jsonl lines, one after the other, are what a job's file holds after two
launches. Then deploy.observe.plot renders them.

Run from the repository root: .venv/bin/python docs/make_plot.py [--out docs/plot.png]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.observe.plot import records_by_run, render  # noqa: E402
from agent.contract import RUN_ID_ENV  # noqa: E402

RUNS = (("0.02", "a1f3"), ("0.002", "7c0e"))  # learning rate, the run id's random part
FLAGS = ["--dataset", "synthetic", "--synthetic-size", "2048", "--batch-size", "32", "--epochs", "3",
         "--log-every", "4", "--device", "cpu", "--backend", "gloo"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "plot.png"))
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    text, names = "", []
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        for i, (lr, suffix) in enumerate(RUNS):
            run = time.strftime("%Y%m%d-%H%M%S", time.gmtime(start + 600 * i)) + "-" + suffix
            ckpt = Path(tmp) / f"ckpt-{i}"
            cmd = [sys.executable, "-m", "agent.launch", "--standalone", "--nproc-per-node", "2", "--",
                   "--data-dir", f"{tmp}/data", "--ckpt-dir", str(ckpt), *FLAGS, "--lr", lr]
            print(f"run {run}: lr {lr}", file=sys.stderr)
            subprocess.run(cmd, env={**env, RUN_ID_ENV: run}, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            text += (ckpt / "metrics.jsonl").read_text()
            names.append(f"{run}: lr {lr}")
    render(records_by_run(text), args.out, title="two launches of one job (" + "; ".join(names) + ")")
    print(f"{args.out}: {Path(args.out).stat().st_size} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
