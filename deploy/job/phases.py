"""Where a launch's time went, on the operator's side (issue 25): each part of ``launch`` timed in
order (the fleet lock, the nodes' states, the code sync, the preflight checks, the image check,
the run's record, the start on the nodes). ``launch`` prints them in one line once the job has
started; those before the start are kept in the run's record (``launch_phases``), which
``status --run`` shows again.

A record is data from the shared volume: :func:`describe` shows only names and finite numbers of
seconds from it, as text.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

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
