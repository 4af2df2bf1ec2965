"""Whether a running job still makes progress: a node is stalled when none of its ranks has moved
for longer than ``job.stall_timeout``. Nothing here connects anywhere.

The evidence is what the node's status script read (deploy/runtime.py, PROGRESS): each rank's
heartbeat (trainer/heartbeat.py: its step, and its age by the node's own clock, so that no clock
of two machines is compared), or, for a program that writes none, the age of the run's log.

``auto`` derives the timeout from the job itself: ten times the longest interval between two
beats that any rank of the node has shown (a checkpoint or an evaluation included), and never
less than :data:`FLOOR_S`, so that a slow but healthy job is not called stalled. Output alone says
less (a program may print once an epoch), so a job without heartbeats is called stalled only after
:data:`QUIET_S` of silence, unless the inventory sets a number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from trainer.heartbeat import FLOOR_S, GAP_FACTOR, QUIET_S, stall_limit  # noqa: F401 (the node's watchdog judges alike)


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat on a node, as its status script read it."""

    local_rank: int
    step: int | None
    rank: int | None
    gap_s: float | None
    """The longest interval between two of its beats so far (None: the program does not say)."""
    age_s: float
    """Seconds since its last beat, by the node's clock."""


@dataclass(frozen=True)
class Stall:
    """A running node where nothing moved for longer than its timeout."""

    for_s: float
    """Seconds since the node's last progress."""
    timeout_s: float
    last_step: int | None
    """The furthest step any of its ranks reported (None: no heartbeat says)."""
    since: float
    """When that progress was, as a time of this machine (``time.time()``)."""
    evidence: str
    """``heartbeats``, or ``output`` for a program that writes none."""


def timeout(setting, beats: tuple[Beat, ...]) -> float | None:
    """The timeout a node is judged by; None: never (``stall_timeout: null``)."""
    return stall_limit(setting, [b.gap_s for b in beats], bool(beats))


def judge(state: str, beats: tuple[Beat, ...], quiet_s: float | None, setting, now: float | None = None,
          started: bool = True) -> Stall | None:
    """A running node's stall, or None (it moves, it is not running, or nothing tells). ``started``:
    the program has shown progress (a METRICS line); before that, and before any heartbeat, its
    silence is its start (a container, imports, a dataset, the rendezvous), judged against
    :data:`QUIET_S` at least, whatever the setting."""
    if state != "running":
        return None
    limit = timeout(setting, beats)
    if limit is None:
        return None
    if beats:
        age, step, evidence = min(b.age_s for b in beats), _furthest(beats), "heartbeats"
    elif quiet_s is not None:
        age, step, evidence = quiet_s, None, "output"
        limit = limit if started else max(limit, QUIET_S)
    else:
        return None
    if age <= limit:
        return None
    now = time.time() if now is None else now
    return Stall(for_s=age, timeout_s=limit, last_step=step, since=now - age, evidence=evidence)


def _furthest(beats: tuple[Beat, ...]) -> int | None:
    return max((b.step for b in beats if b.step is not None), default=None)
