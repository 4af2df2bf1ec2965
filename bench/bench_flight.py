"""The cost of torch's flight recorder (trainer/flight.py) per collective, against the cheapest step.

The built-in trainer lets torch record its collectives whenever the job has heartbeats, so that
`doctor` can name the collective each rank is in. The recorder is one per process, so the
comparison is between two processes started alike, one with ``TORCH_FR_BUFFER_SIZE`` set and one
without (two of each), each in its own one-rank gloo group; the parent asks them in turn
(interleaved rounds) for the time of ``--calls`` all-reduces of one number. Reported: the per-call difference, and that
difference times the collectives of one step of the built-in trainer on the smallest model (its
gradient bucket and the stop flag: 2) against that step (lenet, batch 16, CPU), as
bench_heartbeat.py measures it.

Run: python bench/bench_flight.py [--rounds 7] [--calls 3000] [--smoke]
Writes bench/results/flight.json (not with --smoke, which only proves that it runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_heartbeat import step_seconds  # noqa: E402

from trainer import flight  # noqa: E402

WORKER = r"""
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.zeros(1)
for _ in range(50):
    dist.all_reduce(t)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    print((time.perf_counter() - start) / n, flush=True)
"""
COLLECTIVES_PER_STEP = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(recording: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in flight.BUFFER_ENVS}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), WORLD_SIZE="1", RANK="0")
    if recording:
        env[flight.buffer_env()] = flight.BUFFER
    proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _ask(proc: subprocess.Popen, calls: int) -> float:
    proc.stdin.write(f"{calls}\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--workers", type=int, default=2, help="processes of each kind")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, nothing written")
    a = p.parse_args()
    if a.smoke:
        a.rounds, a.calls, a.steps, a.workers = 1, 20, 2, 1
    if flight.dumper("gloo") is None:
        print(f"torch {torch.__version__} keeps no flight record of gloo's collectives: nothing to measure")
        return
    # Two processes of each kind, asked in turn: a process's own luck (its core, its memory) is not
    # taken for the recorder's cost.
    plain, recording = [_worker(False) for _ in range(a.workers)], [_worker(True) for _ in range(a.workers)]
    try:
        step_seconds(5)  # warm-up
        rounds = []
        for _ in range(a.rounds):
            offs, ons = [], []
            for off_proc, on_proc in zip(plain, recording):
                offs.append(_ask(off_proc, a.calls))
                ons.append(_ask(on_proc, a.calls))
            rounds.append((statistics.mean(offs), statistics.mean(ons), step_seconds(a.steps)))
    finally:
        for proc in (*plain, *recording):
            proc.stdin.close()
            proc.wait(timeout=60)
    off = statistics.median(r[0] for r in rounds)
    on = statistics.median(r[1] for r in rounds)
    extra = statistics.median(r[1] - r[0] for r in rounds)
    step = statistics.median(r[2] for r in rounds)
    share = statistics.median(COLLECTIVES_PER_STEP * (r[1] - r[0]) / r[2] for r in rounds)
    print(f"all_reduce {off * 1e6:.1f} us without the recorder, {on * 1e6:.1f} us with it: {extra * 1e6:+.1f} us per "
          f"collective; x{COLLECTIVES_PER_STEP} per lenet step of {step * 1e3:.2f} ms: {share:+.5f} of a step "
          f"(per round: {', '.join(f'{(r[1] - r[0]) * 1e6:+.1f}' for r in rounds)} us)")
    if a.smoke:
        return
    record = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "torch": torch.__version__,
              "rounds": a.rounds, "calls": a.calls, "workers": a.workers, "all_reduce_us_without": off * 1e6, "all_reduce_us_with": on * 1e6,
              "extra_us_per_collective": extra * 1e6, "lenet_step_ms": step * 1e3, "share_of_step": share,
              "per_round_us": [[r[0] * 1e6, r[1] * 1e6] for r in rounds]}
    out = Path(__file__).resolve().parent / "results" / "flight.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
