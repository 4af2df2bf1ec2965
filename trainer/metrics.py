"""What is measured, and who writes it.

Loss and accuracy are summed on the device during training (no host synchronisation per step)
and all-reduced in a single collective per logging interval. Rank 0 alone prints one
``METRICS {json}`` line per interval, appends the same object to ``metrics.jsonl`` on the
shared volume and writes its measurements as TensorBoard scalars beside it, in
``tensorboard/<run id>/``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import sys
import time
from pathlib import Path

import torch

from agent.contract import METRICS_PREFIX as PREFIX, RUN_ID_ENV

from .dist import DistEnv, all_reduce_sum

log = logging.getLogger(__name__)


class RunningStats:
    """Each step's mean loss and correct predictions, kept on the device as they come (no host
    synchronisation per step, and no arithmetic either: a small model on a GPU is bound by the
    kernels it launches), summed once per logging interval."""

    FOLD = 256
    """Steps kept one by one before they are summed into the running totals (memory stays bounded)."""

    def __init__(self, device: torch.device) -> None:
        self._sums = torch.zeros(3, dtype=torch.float64, device=device)
        self._losses: list[torch.Tensor] = []
        self._correct: list[torch.Tensor] = []
        self._counts: list[int] = []

    def add(self, loss: torch.Tensor, correct: torch.Tensor, count: int) -> None:
        """A step: its batch's mean loss (0-d), its correct predictions (0-d) and its samples."""
        self._losses.append(loss.detach())
        self._correct.append(correct)
        self._counts.append(count)
        if len(self._counts) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        if not self._counts:
            return
        counts = torch.tensor(self._counts, dtype=torch.float64).to(self._sums.device)
        self._sums[0] += (torch.stack(self._losses).double() * counts).sum()
        self._sums[1] += torch.stack(self._correct).double().sum()
        self._sums[2] += float(sum(self._counts))
        self._losses, self._correct, self._counts = [], [], []

    def reduce(self, env: DistEnv) -> dict:
        """Totals over all ranks (one all-reduce), then resets the sums."""
        self._fold()
        totals = all_reduce_sum(env, self._sums.clone()).tolist()
        self._sums.zero_()
        loss_sum, correct, count = totals
        count = max(count, 1.0)
        return {"loss": loss_sum / count, "acc": correct / count, "samples": int(totals[2])}


def peak_memory_mb(device: torch.device, *more: torch.device) -> float:
    """The process's peak memory; on GPUs the largest of its devices' (a split model's stages)."""
    if device.type == "cuda":
        return max(torch.cuda.max_memory_allocated(d) for d in {device, *more}) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


TENSORBOARD_DIR = "tensorboard"
SCALARS = {
    "train": {"loss": "loss/train", "acc": "accuracy/train", "samples_per_s": "throughput/samples_per_s",
              "step_time_s": "throughput/step_time_s", "lr": "lr", "peak_mem_mb": "memory/peak_mb"},
    "eval": {"eval_loss": "loss/eval", "eval_acc": "accuracy/eval"},
}
"""Record kind -> {record key: TensorBoard tag}, at the record's ``step``. ``final`` repeats the
last ``eval`` at the same step; ``resumed`` and ``stopped`` measure nothing."""


def tensorboard_name(run: str | None, started: float) -> str:
    """The run's TensorBoard directory name: its run id, else the UTC start time (which never looks
    like a run id, so ``launch`` never prunes it with old runs)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", run or "")
    return name if name.strip(".") else time.strftime("%Y%m%d-%H%M%S", time.gmtime(started))


class TensorBoardScalars:
    """Rank 0's TensorBoard event files of one run, written by torch's ``SummaryWriter`` (imported
    at the first measurement: rank 0 alone pays for it). Any failure, the package missing or the
    volume full, is logged once and ends these files only: rank 0 must not die while the other
    ranks wait for it in a collective."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._writer = None
        self._failed = False
        self._purge_step: int | None = None

    def add(self, record: dict) -> None:
        if self._failed:
            return
        if record.get("kind") == "resumed" and self._writer is None:
            # a restarted attempt of the same run: TensorBoard hides what the earlier attempt
            # logged after the checkpoint, which this one logs again
            self._purge_step = record["step"] + 1
            return
        tags = SCALARS.get(record.get("kind"), {})
        scalars = {tag: record[key] for key, tag in tags.items() if isinstance(record.get(key), (int, float))}
        if not scalars or not isinstance(record.get("step"), int):
            return
        try:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter
                self._writer = SummaryWriter(str(self.directory), purge_step=self._purge_step)
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, record["step"], walltime=record.get("time"))
            self._writer.flush()  # `tensorboard --logdir` on the shared volume follows the running job
        except Exception as exc:  # noqa: BLE001 -- whatever tensorboard raises, training goes on
            self._fail(exc)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if not self._failed:
            self._failed = True
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            log.warning("TensorBoard files in %s are no longer written (training goes on; metrics.jsonl "
                        "keeps every record): %s: %s", self.directory, type(exc).__name__, reason)


class MetricsWriter:
    """Rank 0's printed lines, JSON-lines file and TensorBoard files; other ranks write nothing.
    With ``$DDP_LAUNCH_ID`` (agent.contract.RUN_ID_ENV) set, every record carries it as ``run``."""

    def __init__(self, env: DistEnv, directory: str) -> None:
        self.enabled = env.is_main
        self.path = Path(directory) / "metrics.jsonl"
        self._whole = False
        """Whether the file is known to end with a whole line (checked before this process's first append)."""
        self.run = os.environ.get(RUN_ID_ENV) or None
        self.tensorboard = TensorBoardScalars(Path(directory) / TENSORBOARD_DIR / tensorboard_name(self.run, time.time()))
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        head = {"time": round(time.time(), 3)}
        if self.run is not None:
            head["run"] = self.run
        record = {**head, **record}
        line = json.dumps(record, sort_keys=False)
        # One write: print() writes the text and its newline apart, and with PYTHONUNBUFFERED (the
        # image sets it) each is its own system call; torchrun's line prefixer (torch 2.5) reading
        # in between printed "[rank0]: METRICS {...}[rank0]: ", a line no reader can parse.
        sys.stdout.write(f"{PREFIX}{line}\n")
        sys.stdout.flush()
        try:
            with open(self.path, "a") as handle:
                # a rank 0 killed while it appended (SIGKILL ends a write between pages) left a torn
                # line: this record starts a line of its own, so that only the torn one is lost
                head = "" if self._whole or self._ends_whole() else "\n"
                handle.write(head + line + "\n")
                self._whole = True
        except OSError as exc:  # rank 0 alone must not die here while the others wait in a collective
            log.warning("metrics line not appended to %s: %s", self.path, exc.strerror or exc)
        self.tensorboard.add(record)

    def _ends_whole(self) -> bool:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                if handle.tell() == 0:
                    return True
                handle.seek(-1, os.SEEK_END)
                return handle.read(1) == b"\n"
        except OSError:
            return True  # absent (or unreadable: the append says why)

    def close(self) -> None:
        """Flushes and closes the TensorBoard files (the end of training, a stop or a failure)."""
        self.tensorboard.close()


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
