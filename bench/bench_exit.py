"""What a torch process spends after its last line: the interpreter's teardown, against ending by
``agent.exits`` (the launcher, the probe, the trainer and the zygote's workers end that way).

Each case runs as a fresh ``python -c`` twice per round, once ending as the interpreter ends a
program and once through ``exits.main``, alternating round by round so that both see the same
machine; its CPU is the user + system time the child used (``getrusage(RUSAGE_CHILDREN)``, one
child at a time). The cases: ``import torch`` (a probe), ``torch.distributed.run`` (a launcher
and its torchrun agent), ``torch._dynamo`` (what DDP's constructor imports: a worker), and a
standalone launch (``agent.launch``, 2 workers forked from its zygote, a short synthetic job),
its ``main`` called as the module's ``__main__`` block calls it, or called plainly: the launcher's
own CPU (its zygote and the workers that zygote reaps are not children it waits for; both end
through ``agent.exits`` either way).

Run: python bench/bench_exit.py [--rounds 8] [--out bench/results/exit.json] [--smoke]
Prints JSON: per case, every round's CPU seconds of each ending and their medians, and the
median saved.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cli_start import cpu_children  # noqa: E402

CASES = {
    "import torch": "import torch",
    "torch.distributed.run": "from torch.distributed.run import main",
    "torch._dynamo": "import torch, torch._dynamo",
}
JOB = ["--dataset", "synthetic", "--synthetic-size", "256", "--batch-size", "32", "--epochs", "1",
       "--log-every", "2", "--eval-batch-size", "128", "--model", "lenet"]
LAUNCH = "import sys; from agent import exits, launch; sys.argv[0] = 'agent.launch'; "


def programs(case: str) -> dict[str, str]:
    """The case's two programs: ending by the interpreter, and by ``agent.exits``."""
    if case == "standalone launch":
        return {"teardown": LAUNCH + "launch.main()", "exits": LAUNCH + "exits.main(launch.main)"}
    body = CASES[case]
    return {"teardown": body, "exits": f"{body}\nfrom agent import exits; exits.main(lambda: None)"}


def run_once(code: str, args: list[str], env: dict, cwd: str) -> float:
    before = cpu_children()
    subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return cpu_children() - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="one round of the first case, no --out")
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    cases = [*CASES, "standalone launch"][:1 if args.smoke else None]
    got = {case: {"teardown": [], "exits": []} for case in cases}
    with tempfile.TemporaryDirectory(prefix="bench-exit-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NPROC_PER_NODE": "2", "DDP_PREFORK": "1",
               "OMP_NUM_THREADS": "1", "DDP_DATA_DIR": f"{tmp}/data"}
        for r in range(rounds):
            for case in cases:
                order = ("teardown", "exits") if r % 2 == 0 else ("exits", "teardown")
                for ending in order:
                    ckpt = f"{tmp}/ckpt-{r}-{case.replace(' ', '_')}-{ending}"
                    job = [*JOB, "--ckpt-dir", ckpt] if case == "standalone launch" else []
                    got[case][ending].append(round(run_once(programs(case)[ending], job, env, tmp), 3))
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} ({os.cpu_count()} cores)",
           "python": platform.python_version(), "rounds": rounds, "cases": {}}
    for case, endings in got.items():
        medians = {e: round(statistics.median(v), 3) for e, v in endings.items()}
        out["cases"][case] = {"core_s": endings, "median_core_s": medians,
                              "median_saved_core_s": round(medians["teardown"] - medians["exits"], 3)}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out and not args.smoke:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
