"""Where a run's wall time went: its goodput (the share of its wall time spent in training steps
that count) and its incidents (each restart, resize and stop: when, how many steps were done
again, how long until training went on), from the built-in trainer's records of that run
(metrics.jsonl: ``train`` records with their step and ``step_time_s``, ``resumed``, ``stopped``).

A ``train`` record stands for the steps since the one before it (or since the step the attempt
resumed at, or 0), each taking its ``step_time_s``. A ``resumed`` record at step C inside a run
means the steps past C were lost and are done again: their time does not count. Time before the
first step (the launch, the rendezvous, loading), evaluation, the end of an epoch's checkpoint and
the waits of a fault count as wall time only; a checkpoint taken inside an epoch (``ckpt_every``)
falls in its interval's steps. What no record shows is not seen: steps after the last train
record of an attempt, and an attempt that ended before its first train record (its restart is
then no incident). A resize resumes at the start of the checkpoint's epoch (trainer/loop.py): the
batches it trains again there count as steps. The records are data from the shared volume: a
record whose numbers are missing, of another type, not finite or out of range is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LARGEST_STEP = 2 ** 53  # beyond it a step count is no count this job could have made


@dataclass(frozen=True)
class Incident:
    """A restart or resize (training went on from a checkpoint inside the run) or a stop."""

    kind: str  # "restart" | "resize" | "stop"
    time: float  # when training resumed, or the stop's checkpoint was written
    last_step: int | None  # the last step logged before it
    step: int  # the step it resumed at, or stopped at
    redone: int | None  # the steps done again (at least: steps after the last log are not seen)
    gap_s: float | None  # from the last step logged before it to training resumed
    world: tuple[int, int] | None = None  # a resize: (from, to) processes

    def describe(self) -> str:
        if self.kind == "stop":
            return f"stopped at step {self.step}"
        what = (f"resized {self.world[0]} -> {self.world[1]} processes (its epoch replayed from its start)"
                if self.world else "restarted")
        redone = f", {self.redone} steps redone" if self.redone else ""
        gap = f", training again {self.gap_s:.1f} s after the last step logged" if self.gap_s is not None else ""
        return f"{what} at step {self.step}{redone}{gap}"

    def as_data(self) -> dict:
        return {"kind": self.kind, "time": self.time, "last_step": self.last_step, "step": self.step,
                "redone": self.redone, "gap_s": self.gap_s, "world": list(self.world) if self.world else None}


@dataclass(frozen=True)
class Goodput:
    training_s: float  # the logged training steps that count
    wall_s: float  # the run's start to its end (or to now, while it runs)
    redone_steps: int
    incidents: tuple[Incident, ...]

    @property
    def share(self) -> float:
        return min(1.0, self.training_s / self.wall_s) if self.wall_s > 0 else 0.0

    def text(self) -> str:
        return f"{self.share:.0%}"

    def describe(self) -> str:
        """``goodput 87% (41.2 s of 47.4 s in steps that count; 1 restart ...)`` for ``status --run``."""
        said = f"goodput {self.text()} ({self.training_s:.1f} s of {self.wall_s:.1f} s in training steps that count"
        if self.redone_steps:
            said += f", {self.redone_steps} steps redone"
        return said + ")" + "".join(f"\n  {i.describe()}" for i in self.incidents)

    def as_data(self) -> dict:
        return {"share": round(self.share, 4), "training_s": round(self.training_s, 3), "wall_s": round(self.wall_s, 3),
                "redone_steps": self.redone_steps, "incidents": [i.as_data() for i in self.incidents]}


def _number(value, low: float = 0.0, high: float = 1e12) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int of hundreds of digits, as JSON allows
        return None
    return value if math.isfinite(value) and low <= value <= high else None


def _step(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= LARGEST_STEP else None


def _usable(records) -> list[dict]:
    """The records this reckoning can use, in the order they were written (one writer at a time:
    rank 0 of the attempt; never re-sorted by a time from another node's clock): a known kind, a
    finite time, a step in range."""
    kept = []
    for r in records if isinstance(records, list) else ():
        if not isinstance(r, dict) or r.get("kind") not in ("train", "resumed", "stopped"):
            continue
        if _number(r.get("time"), 0.0, 1e11) is None or _step(r.get("step")) is None:
            continue
        kept.append(r)
    return kept


def last_time(records) -> float | None:
    """When the run's last record (of any kind) was written (None: no record has a usable time)."""
    times = [_number(r.get("time"), 0.0, 1e11) for r in records if isinstance(r, dict)] if isinstance(records, list) else []
    return max((t for t in times if t is not None), default=None)


def of_run(records, start: float | None, end: float | None, now: float) -> Goodput | None:
    """The goodput of one run from its records (None where it has no train record, or its start
    is unknown): ``end`` None while it runs (then up to ``now``)."""
    usable = _usable(records)
    if start is None or not any(r["kind"] == "train" for r in usable):
        return None
    intervals: list[tuple[int, int, float]] = []  # (from step, to step, seconds): steps (from, to]
    incidents: list[Incident] = []
    last_step: int | None = None  # the attempt's last step: logged, or resumed at
    last_time: float | None = None  # when the last train record was written
    redone_steps = 0
    after_train = False  # the record before was a train record

    def resumed(t: float, step: int, world: tuple[int | None, int | None]) -> None:
        nonlocal last_step, redone_steps
        if last_step is not None:  # inside the run: a restart or a resize
            resized = None not in world and world[0] != world[1]
            incidents.append(Incident("resize" if resized else "restart", t, last_step, step, max(0, last_step - step),
                                      None if last_time is None else max(0.0, t - last_time),
                                      world if resized else None))
        while intervals and intervals[-1][1] > step:  # in step order: those past the checkpoint are last
            lo, hi, seconds = intervals.pop()
            if lo < step:  # the part up to the checkpoint counts
                intervals.append((lo, step, seconds * (step - lo) / (hi - lo)))
                redone_steps += hi - step
                break
            redone_steps += hi - lo
        last_step = step

    for r in usable:
        t, step = float(r["time"]), r["step"]
        if r["kind"] == "resumed":
            resumed(t, step, (_step(r.get("from_world_size")), _step(r.get("world_size"))))
        elif r["kind"] == "stopped":
            incidents.append(Incident("stop", t, last_step, step, None, None))
        else:
            if after_train and step <= last_step:
                resumed(t, 0, (None, None))  # started again with no checkpoint: from step 0
            begun = last_step if last_step is not None else 0
            each = _number(r.get("step_time_s"), 0.0, 1e6)
            if step > begun and each is not None:
                intervals.append((begun, step, each * (step - begun)))
            last_step, last_time = step, t
        after_train = r["kind"] == "train"
    wall = (end if end is not None else now) - start
    return Goodput(sum(s for _, _, s in intervals), max(0.0, wall), redone_steps, tuple(incidents))


__all__ = ["Goodput", "Incident", "last_time", "of_run"]
