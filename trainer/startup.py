"""Where a process's time went before its first step: from its launcher's start (the
agent that spawned it: torchrun or agent.launch, started by the container or the node's
supervisor) to the process's own start, its imports, the process group (the rendezvous of the
workers), the data, the model and the resume. Each node's first process prints it in one line:

    trainer: ready to train 7.4 s after the launcher started: launcher to this process 2.9 s,
    imports 2.1 s, process group 1.2 s, data 0.6 s, model 0.4 s, resume 0.2 s

Start times come from /proc (the kernel's clock ticks since boot); where it cannot be read (not
Linux), those phases are left out.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from agent.contract import LAUNCHER_PID_ENV

NAMES = {"process": "launcher to this process", "imports": "imports", "process_group": "process group",
         "data": "data", "model": "model", "resume": "resume"}
"""Each phase by the moment that ends it (:meth:`Startup.mark`)."""


def started_at(pid: int | str = "self") -> float | None:
    """The wall-clock time process ``pid`` started (seconds since the epoch), from /proc, to a
    clock tick (10 ms)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime: clock ticks after boot
        return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


@functools.cache  # once: two readings differ by microseconds, and starts in one tick must compare equal
def _boot_time() -> float:
    """When this machine booted, in seconds since the epoch. /proc/stat's ``btime`` has it only
    to the whole second (so a start time from it was up to a second early); the clock that
    /proc's start times count on, CLOCK_BOOTTIME, read beside the wall clock has it exactly."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))


class Startup:
    """The moments a process reached, in order; :meth:`line` says how long each phase took."""

    def __init__(self) -> None:
        launcher = os.environ.get(LAUNCHER_PID_ENV, "")  # a worker forked by the zygote
        self.marks: list[tuple[str, float | None]] = [("launcher", started_at(int(launcher) if launcher.isdigit()
                                                                              else os.getppid())),
                                                      ("process", started_at())]

    def mark(self, name: str) -> None:
        """The phase ``name`` ended now."""
        self.marks.append((name, time.time()))

    def moments(self) -> dict[str, float]:
        """Each moment reached so far (seconds since the epoch), by name, where known: the
        ``resumed`` record keeps them, so that a recovery can be split into its phases."""
        return {name: round(t, 3) for name, t in self.marks if t is not None}

    def phases(self) -> dict[str, float]:
        """Seconds of each phase, named by the moment that ended it, where both its ends are known
        (a start time read from /proc has a clock tick's grain: never below 0)."""
        out = {}
        for (_, start), (name, end) in zip(self.marks, self.marks[1:]):
            if start is not None and end is not None:
                out[name] = max(0.0, end - start)
        return out

    def line(self) -> str:
        phases = self.phases()
        known = self.marks[0][1] if self.marks[0][1] is not None else self.marks[1][1]
        since = "the launcher started" if self.marks[0][1] is not None else "this process started"
        total = f" {self.marks[-1][1] - known:.1f} s after {since}" if known is not None else ""
        parts = ", ".join(f"{NAMES.get(name, name)} {s:.1f} s" for name, s in phases.items())
        return f"trainer: ready to train{total}: {parts}"
