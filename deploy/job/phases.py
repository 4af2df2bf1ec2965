"""Where a launch's time went, on the operator's side: each part of ``launch`` timed in order (the
job's lock, the nodes' states, the code sync, the preflight checks, the image check, the run's
record, the start on the nodes). ``launch`` prints them in one line once the job has started;
those before the start are kept in the run's record (``launch_phases``), which ``status --run``
shows again. Then, for any program, the job's first step (:class:`FirstStep`): ``launch --wait``
prints when it came and keeps it in the run's record beside them (``first_step``).

A record is data from the shared volume: :func:`describe` and :func:`describe_first` show only
names and finite numbers of seconds from it, as text.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

from agent.contract import METRICS_PREFIX as PREFIX

from ..text import safe

NAMES = {"lock": "lock", "states": "node states", "code": "code sync", "checks": "checks",
         "image": "image check", "cleanup": "previous run removed", "record": "record", "start": "start"}


class Phases:
    """Seconds of each phase, in the order they ran."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Times the block as phase ``name`` (added to it, where it ran before)."""
        start = self._clock()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self._clock() - start

    def data(self) -> dict[str, float]:
        return {name: round(s, 2) for name, s in self.seconds.items()}


def describe(phases: object) -> str | None:
    """``took 4.2 s: lock 0.01 s, node states 0.3 s, ...`` from a phases mapping (of a record:
    anything); None where it holds no phase. A name the tool does not know is shown escaped; a
    value that is no finite, non-negative number is left out."""
    if not isinstance(phases, dict):
        return None
    shown = [(str(name), float(s)) for name, s in phases.items()
             if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0]
    if not shown:
        return None
    total = sum(s for _, s in shown)
    parts = ", ".join(f"{safe(NAMES.get(name, name))} {_seconds(s)}" for name, s in shown)
    return f"took {_seconds(total)}: {parts}"


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else f"{s:.1f} s" if s < 1e6 else f"{s:.3g} s"


NO_FIRST_STEP = ("no first step seen: no node printed a METRICS line, and no rank's heartbeat showed a step or a "
                 "collective while `launch --wait` watched (docs/own-code.md: Metrics)")


class FirstStep:
    """The job's first step, as ``launch --wait`` sees the nodes' states at each poll
    (deploy/job/plan.py ``NodeState``): a node's first METRICS line (docs/own-code.md, Metrics),
    or a rank's first heartbeat that shows a step (agent/heartbeat/: the program's own, with its
    step; or the progress hook's, which every rank of any program writes when its process group
    forms and after each collective, once a collective has returned), whichever a poll shows
    first. When: the
    poll that first shows one, less the age of the oldest such heartbeat, and never before the poll
    before it, which showed none: to within a poll's second. ``note`` is told it once, as a line;
    ``keep`` once, as the run record's ``first_step`` (:func:`describe_first` reads it back)."""

    def __init__(self, note: Callable[[str], None], keep: Callable[[dict], None] = lambda found: None,
                 clock: Callable[[], float] = time.time) -> None:
        self._note, self._keep, self._clock = note, keep, clock
        self.start = clock()
        """The start: when the launch had started the job on every node."""
        self._none_at = self.start
        self.found: dict | None = None

    def see(self, states: dict) -> None:
        """One poll's states (node -> NodeState)."""
        if self.found is not None:
            return
        now = self._clock()
        seen = first_evidence(states)
        if seen is None:
            self._none_at = now
            return
        node, by, age = seen
        at = max(self._none_at, now - age)
        self.found = {"after_s": round(at - self.start, 1), "time": round(at, 3), "node": node, "by": by}
        self._note(describe_first(self.found) or "")
        self._keep(self.found)

    def end(self) -> None:
        """The job has ended: says so where no poll showed a step."""
        if self.found is None:
            self._note(NO_FIRST_STEP)


def first_evidence(states: dict) -> tuple[str, str, float] | None:
    """The earliest sign of a step the states show: (node, what, its age in seconds: 0 for a
    METRICS line, whose time of printing the node does not say); None where there is none. Only
    a running or ended node's: another's ``metrics`` says why it is not known."""
    found = None
    for node, s in states.items():
        if not (s.running or s.ended):
            continue
        signs = [(b.age_s, _beat_sign(b)) for b in s.beats if b.step is not None or b.gap_s is not None]
        if s.metrics.startswith(PREFIX):
            signs.append((0.0, "a METRICS line"))
        for age, by in signs:
            if found is None or age > found[2]:
                found = (node, by, max(0.0, float(age)))
    return found


def _beat_sign(beat) -> str:
    """What a heartbeat that shows a step says: the program's own beat names its step; the progress
    hook's (agent/progress_hook, no step) has an interval only once a collective returned after
    its process group formed, its first beat."""
    rank = "?" if beat.rank is None else beat.rank
    return f"rank {rank}'s heartbeat at step {beat.step}" if beat.step is not None else f"rank {rank}'s collectives"


def describe_first(found: object) -> str | None:
    """``first step after 12.3 s (node1: a METRICS line)`` from a ``first_step`` (of a record:
    anything); None where it is not one this tool keeps."""
    if not isinstance(found, dict):
        return None
    after, node, by = found.get("after_s"), found.get("node"), found.get("by")
    if not (isinstance(after, (int, float)) and not isinstance(after, bool) and math.isfinite(after) and after >= 0
            and isinstance(node, str) and isinstance(by, str)):
        return None
    return safe(f"first step after {after:.1f} s ({node}: {by})" if after < 1e6 else
                f"first step after {_seconds(after)} ({node}: {by})")
