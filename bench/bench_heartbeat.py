"""The cost of a rank's heartbeat (agent/heartbeat/) against the cheapest training step there is.

In one run, interleaved: (h) ``Heartbeat.beat`` into a directory in /dev/shm, as the built-in
trainer calls it once per optimizer step; (s) one optimizer step of the smallest model (``lenet``,
batch 16, on the CPU: forward, backward, SGD). The cost is h/s, the median of the per-round
ratios: the share of a step that its beat adds.

Run: python bench/bench_heartbeat.py [--rounds 5] [--beats 20000] [--steps 50] [--smoke]
Writes bench/results/heartbeat.json (not with --smoke, which only proves that it runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.heartbeat import Heartbeat  # noqa: E402
from trainer.models import build_model  # noqa: E402


def beat_seconds(directory: str, beats: int) -> float:
    hb = Heartbeat(directory, 0, 0)
    start = time.perf_counter()
    for step in range(beats):
        hb.beat(step)
    took = time.perf_counter() - start
    hb.close()
    return took / beats


def step_seconds(steps: int) -> float:
    model = build_model("lenet", 1, 28, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    start = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--beats", type=int, default=20000)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, nothing written")
    a = p.parse_args()
    if a.smoke:
        a.rounds, a.beats, a.steps = 1, 100, 2
    torch.manual_seed(0)
    directory = tempfile.mkdtemp(prefix="bench-heartbeat-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    try:
        step_seconds(5)  # warm-up
        rounds = []
        for _ in range(a.rounds):
            rounds.append((beat_seconds(directory, a.beats), step_seconds(a.steps)))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    beat = statistics.median(h for h, _ in rounds)
    step = statistics.median(s for _, s in rounds)
    share = statistics.median(h / s for h, s in rounds)
    print(f"beat {beat * 1e6:.2f} us, lenet step {step * 1e3:.2f} ms, beat/step {share:.5f} "
          f"(per round: {', '.join(f'{h / s:.5f}' for h, s in rounds)})")
    if a.smoke:
        return
    record = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "torch": torch.__version__,
              "rounds": a.rounds, "beats": a.beats, "steps": a.steps, "beat_us": beat * 1e6,
              "lenet_step_ms": step * 1e3, "beat_per_step": share, "per_round": [h / s for h, s in rounds]}
    out = Path(__file__).resolve().parent / "results" / "heartbeat.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
