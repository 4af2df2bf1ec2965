"""Whether a process group formed on this node in this run: the launcher's finding, kept with the run.

A rank's heartbeat file (``$DDP_HEARTBEAT_DIR/$LOCAL_RANK``, agent/heartbeat/) exists once the
rank has formed the process group or made a step. The launcher looks for one each second while
its workers run, and once more at its end (a rank may remove its file as it finishes, as the
built-in trainer does), and keeps the first it sees as an empty file :data:`MARKER` in the node's
directory of the run. ``status``, ``runs`` and ``launch --wait`` read it there: a run that exited
0 with no such file on any node and no METRICS line is not called a success (deploy/job/outcome.py).
"""

from __future__ import annotations

import os
import threading

from . import heartbeat
from .contract import FORMED_MARKER as MARKER

EVERY_S = 1.0


def seen(beats: str) -> bool:
    """A rank's heartbeat file is in ``beats`` (named by its local rank: digits)."""
    return heartbeat.group_formed(beats)  # not a worker's start, which its hook marks too


def keep(record: str) -> bool:
    """The finding kept in ``record`` (an empty file, never through a link); False where it cannot be."""
    try:
        os.close(os.open(os.path.join(record, MARKER), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
    except OSError:
        return False
    return True


class Watch:
    """Looks for a heartbeat in ``beats`` every :data:`EVERY_S` until one is seen, then keeps the
    finding in ``record``; :meth:`end` looks a last time. Nothing where either is None."""

    def __init__(self, beats: str | None, record: str | None) -> None:
        self.beats, self.record = beats, record
        self.found = False
        self._done = threading.Event()

    def start(self) -> "Watch":
        if self.beats and self.record:
            threading.Thread(target=self._run, name="group-formed", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._done.wait(EVERY_S):
            if self._look():
                return

    def _look(self) -> bool:
        if not self.found and self.beats and self.record and seen(self.beats):
            self.found = keep(self.record)
        return self.found

    def end(self) -> None:
        """A last look, before the launcher removes the heartbeats."""
        self._done.set()
        self._look()
