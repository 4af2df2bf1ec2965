"""Whether a running job still makes progress: a node is stalled when none of its ranks has moved
for longer than ``job.stall_timeout``. Nothing here connects anywhere.

The evidence is what the node's status script read (deploy/job/runtime.py, PROGRESS): each rank's
heartbeat (agent/heartbeat/: its step and phase, and its age by the node's own clock, so that
no clock of two machines is compared; the launcher's progress hook writes one for any program, from
its worker's start), or, where they tell nothing, the age of the run's log.

``auto`` derives the timeout from the job itself: ten times the longest interval between two
beats that any rank of the node has shown (a checkpoint or an evaluation included), and never
less than :data:`FLOOR_S`, so that a slow but healthy job is not called stalled. Before any rank
has shown an interval (its start-up) and without heartbeats, output alone says less (a program may
print once an epoch): the node is called stalled only after :data:`QUIET_S` of silence, unless the
inventory sets a number, or a rank ended while the others wait on it (agent/heartbeat/, verdict).
"""

from __future__ import annotations

import re
import time
from dataclasses import astuple, dataclass

from agent.contract import FLOOR_S, GAP_FACTOR, QUIET_S, stall_limit, verdict  # noqa: F401 (the node's watchdog judges alike)


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
    phase: str | None = None
    """Where its worker is, as the progress hook says (agent/heartbeat/, PHASES); None: a line
    the program wrote itself."""


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
    left: str | None = None
    """``rank N``: the rank that ended while the node's others never formed the process group or
    wait in their first collective (agent/heartbeat/, verdict)."""


def timeout(setting, beats: tuple[Beat, ...]) -> float | None:
    """The timeout a node is judged by; None: never (``stall_timeout: null``)."""
    return stall_limit(setting, [b.gap_s for b in beats], bool(beats))


def judge(state: str, beats: tuple[Beat, ...], quiet_s: float | None, setting, now: float | None = None,
          started: bool = True) -> Stall | None:
    """A running node's stall, or None (it moves, it is not running, or nothing tells). Its
    heartbeats judged as its launcher's watchdog judges them (agent/heartbeat/, verdict: each
    rank's clock starts with its worker); where they tell nothing (none, or with ``auto`` a start-up
    that has shown no interval yet), its output. ``started``: the program has shown progress (a
    METRICS line); before that its silence is its start (a container, imports, a dataset, the
    rendezvous), judged against :data:`QUIET_S` at least, whatever the setting."""
    if state != "running" or setting is None:
        return None
    seen = verdict(setting, [astuple(b) for b in beats])
    left = None
    if seen is not None:
        (age, limit, left), step, evidence = seen, _furthest(beats), "heartbeats"
    elif quiet_s is not None:
        age, step, evidence = quiet_s, None, "output"
        limit = stall_limit(setting, [], False)
        limit = limit if started else max(limit, QUIET_S)
    else:
        return None
    if age <= limit:
        return None
    now = time.time() if now is None else now
    return Stall(for_s=age, timeout_s=limit, last_step=step, since=now - age, evidence=evidence, left=left)


def _furthest(beats: tuple[Beat, ...]) -> int | None:
    return max((b.step for b in beats if b.step is not None), default=None)


_STALL = re.compile(r"([0-9]{1,11}) (-|[0-9]{1,18}) ([0-9]{1,9}) ([0-9]{1,9}) (report|restart|stop)")


@dataclass(frozen=True)
class StallRecord:
    """A stall as the node's launcher kept it (agent/heartbeat/, Watchdog): ``<node>/stalls``,
    one line ``TIME STEP QUIET_S LIMIT_S ACTION`` each; its diagnosis in ``<node>/stall-TIME``. The
    job can write these files too: a line that is not exactly that is no record."""

    time: int
    """When the launcher found it, UNIX seconds on the node's clock."""
    step: int | None
    """The last step any rank of the node beat at; None: none said one."""
    quiet_s: int
    """How long no rank of the node had moved."""
    limit_s: int
    """The stall timeout it was judged against."""
    action: str
    """``report``, ``restart`` or ``stop`` (job.on_stall)."""

    @classmethod
    def parse(cls, line: str) -> "StallRecord | None":
        m = _STALL.fullmatch(line.strip())
        if m is None:
            return None
        when, step, quiet, limit, action = m.groups()
        return cls(int(when), None if step == "-" else int(step), int(quiet), int(limit), action)

    def as_data(self) -> dict:
        return {"time": self.time, "step": self.step, "quiet_s": self.quiet_s, "limit_s": self.limit_s,
                "action": self.action}


STOPPED = "stopped (stalled)"
"""The state of a node whose launcher ended its part of the job on a stall (job.on_stall: stop):
it exited 0 (so that nothing starts it again), and its last kept stall says stop."""


def ended_state(code: int | None, last: StallRecord | None) -> str | None:
    """:data:`STOPPED` for a node that ended with ``code`` after ``last`` (its last kept stall), where
    that stall stopped it; None otherwise."""
    return STOPPED if code == 0 and last is not None and last.action == "stop" else None
