"""What is measured, and who writes it.

Loss and accuracy are summed on the device during training (no host synchronisation per step)
and all-reduced in a single collective per logging interval. Rank 0 alone prints one
``METRICS {json}`` line per interval and appends the same object to ``metrics.jsonl`` on the
shared volume.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path

import torch

from .dist import DistEnv, all_reduce_sum
from .output import PREFIX

log = logging.getLogger(__name__)


class RunningStats:
    """Sums of loss, correct predictions and samples, kept on the device between reductions."""

    def __init__(self, device: torch.device) -> None:
        self._sums = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, count: int) -> None:
        self._sums[0] += loss_sum.detach().to(torch.float64)
        self._sums[1] += correct.to(torch.float64)
        self._sums[2] += count

    def reduce(self, env: DistEnv) -> dict:
        """Totals over all ranks (one all-reduce), then resets the sums."""
        totals = all_reduce_sum(env, self._sums.clone()).tolist()
        self._sums.zero_()
        loss_sum, correct, count = totals
        count = max(count, 1.0)
        return {"loss": loss_sum / count, "acc": correct / count, "samples": int(totals[2])}


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MetricsWriter:
    """Rank 0's printed lines and JSON-lines file; other ranks write nothing."""

    def __init__(self, env: DistEnv, directory: str) -> None:
        self.enabled = env.is_main
        self.path = Path(directory) / "metrics.jsonl"
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        line = json.dumps(record, sort_keys=False)
        print(PREFIX + line, file=sys.stdout, flush=True)
        try:
            with open(self.path, "a") as handle:
                handle.write(line + "\n")
        except OSError as exc:  # rank 0 alone must not die here while the others wait in a collective
            log.warning("metrics line not appended to %s: %s", self.path, exc.strerror or exc)


class IntervalTimer:
    """Wall time and samples between two logging points (the all-reduce there syncs the device)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.steps = 0

    def tick(self) -> None:
        self.steps += 1

    def rates(self, samples: int) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rates = {"samples_per_s": samples / elapsed, "step_time_s": elapsed / max(self.steps, 1)}
        self.reset()
        return rates
