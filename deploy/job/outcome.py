"""How a run ended, in words every verb shares: the operator's stop as ``stop`` kept it, and
whether anything shows that the job trained.

A stop is kept beside the node's directory of the run (``runs/<id>/<node>.stopped``, written by
scripts.RECORD_STOP): ``status`` shows a node it stopped as ``stopped (graceful, checkpoint at
step 40)``, as ``runs`` and ``status --run`` do, ``stopping`` while the stop is under way, and
``launch --wait`` ends as a stop, not a failure.

A run trained when one of its ranks formed the process group (its heartbeat, agent/heartbeat/,
seen by the node's launcher, which keeps the finding in the node's directory of the run as
:data:`agent.formed.MARKER`) or a rank printed a METRICS line. A run whose every node exited 0
with neither is not called a success: nothing shows it trained.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from agent.contract import FORMED_MARKER  # noqa: F401 (the node programs' name of the finding)

STOPPING = "stopping"
"""A node whose job a ``stop`` has begun to end: its processes may still write their checkpoint."""

NOTHING_TRAINED = "exited 0, but no process group formed and no METRICS line: nothing shows it trained"

_STOP = re.compile(r"([0-9]{1,11}) (node|job) (graceful|now) (-|[0-9]{1,18}) "
                   r"([A-Za-z0-9_.?-]{1,64}@[A-Za-z0-9_.?-]{1,64})")


@dataclass(frozen=True)
class Stop:
    """A stop of the run on a node, as ``stop`` kept it: ``<node>.stopped`` (scripts.RECORD_STOP),
    one line ``TIME SCOPE MODE STEP BY``. The job can write that file too: a line that is not
    exactly that is no record."""

    time: int
    """When the stop began, UNIX seconds on the node's clock."""
    by: str
    """Who stopped it: the operator's user@host."""
    graceful: bool
    """SIGTERM and time for a checkpoint; False: ``stop --now``."""
    step: int | None = None
    """The step the program said it checkpointed at; None: it said none."""
    found_running: bool = True
    """The stop found the job running on the node (docker, host). False (Slurm): the job was
    active, but this node's part may have ended before."""

    @classmethod
    def parse(cls, line: str) -> "Stop | None":
        m = _STOP.fullmatch(line.strip())
        if m is None:
            return None
        when, scope, mode, step, by = m.groups()
        return cls(int(when), by, mode == "graceful", None if step == "-" else int(step), scope == "node")

    def ended(self, exits) -> bool:
        """Whether this stop ended the node's part: it found it running, or the node had not
        ended before it began (an exit since is the stop's)."""
        last = exits[-1][0] if exits else None
        return self.found_running or last is None or last >= self.time - 1

    def how(self) -> str:
        """``graceful, checkpoint at step 40`` | ``graceful, no checkpoint reported`` | ``--now``."""
        if not self.graceful:
            return "--now"
        return "graceful, no checkpoint reported" if self.step is None else f"graceful, checkpoint at step {self.step}"

    def state(self) -> str:
        """A node's state once this stop ended it: ``stopped (graceful, checkpoint at step 40)``."""
        return f"stopped ({self.how()})"

    def as_data(self) -> dict:
        return {"time": self.time, "by": self.by, "graceful": self.graceful, "step": self.step}


STOPPED_UNREAD = "stopped (how: unknown)"
"""A node a stop ended whose record of it could not be read."""


def is_stopped(state: str) -> bool:
    """The node's part ended by the operator's ``stop`` (not the launcher's own on a stall)."""
    return state.startswith("stopped (") and state != "stopped (stalled)"


def _clock(t: float, day_of: float | None) -> str:
    """``t`` in local time: the time of day, with the date when it is not the day of ``day_of``."""
    try:
        same_day = day_of is not None and time.localtime(t)[:3] == time.localtime(day_of)[:3]
        return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "?"


def describe_stop(stops: list[Stop], day_of: float | None = None) -> str:
    """``stopped by root@op at 12:01:03 (graceful, checkpoint at step 40)``: the first of ``stops``
    (one per node; the same ``stop`` on each), with the step each program said (``day_of``: the
    run's start; the date shows when the stop was on another day)."""
    first = min(stops, key=lambda s: s.time)
    steps = sorted({s.step for s in stops if s.step is not None})
    if not all(s.graceful for s in stops):
        how = "--now, no checkpoint" if not any(s.graceful for s in stops) else "--now on some nodes"
    elif len(steps) == 1:
        how = f"graceful, checkpoint at step {steps[0]}"
    elif steps:
        how = f"graceful, checkpoints at steps {', '.join(map(str, steps))}"
    else:
        how = "graceful, no checkpoint reported"
    return f"stopped by {first.by} at {_clock(first.time, day_of)} ({how})"


def trained(nodes) -> bool:
    """Whether anything shows the job trained: of ``nodes`` (each with ``formed``, whether its
    launcher saw a rank's heartbeat, and ``metrics``, its last METRICS line), one formed the
    process group or printed a METRICS line."""
    return any(n.formed or n.metrics.startswith("METRICS ") for n in nodes)


__all__ = ["Stop", "STOPPING", "STOPPED_UNREAD", "NOTHING_TRAINED", "describe_stop", "is_stopped", "trained"]
