"""A rank's heartbeat file, written in place at each step (a few microseconds)."""

from __future__ import annotations

import contextlib
import os
import sys
import time

from ..contract import HEARTBEAT_DIR_ENV


class Heartbeat:
    """One rank's beats; a no-op where the directory is not set or cannot be written."""

    def __init__(self, directory: str | None, local_rank: int = 0, rank: int = 0, clock=time.monotonic) -> None:
        self.path = os.path.join(directory, str(local_rank)) if directory else None
        self.rank, self.clock = rank, clock
        self.gap = 0.0
        self.step = 0
        self._fd: int | None = None
        self._last: float | None = None

    @classmethod
    def from_environ(cls, environ=os.environ, rank: int | None = None) -> "Heartbeat":
        local = environ.get("LOCAL_RANK", "0")
        return cls(environ.get(HEARTBEAT_DIR_ENV) or None, int(local) if local.isdigit() else 0,
                   rank if rank is not None else int(environ.get("RANK", "0") or 0))

    def beat(self, step: int | None = None) -> None:
        """Progress now, at ``step`` (None: the step of the last beat, as in an evaluation)."""
        if step is not None:
            self.step = step
        if self.path is None:
            return
        now = self.clock()
        if self._last is not None:
            self.gap = max(self.gap, now - self._last)
        self._last = now
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                sys.stderr.write(f"trainer: warning: no heartbeat ({self.path}: {exc.strerror or exc}); "
                                 "`ddp-deploy status` cannot tell a stall from progress on this rank\n")
                self.path = None
                return
        line = f"{self.step:20d} {self.rank:10d} {min(int(self.gap * 1000), 10 ** 13 - 1):13d}\n".encode()
        try:
            os.pwrite(self._fd, line, 0)
        except OSError:
            pass  # never the job's end: status falls back to the node's output

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def finish(self) -> None:
        """This rank is done (trained, evaluated, saved; or stopped as planned, its checkpoint
        written): its beat goes, so that the seconds it still takes to end (the process group's
        teardown, the interpreter's exit, a peer's final save) are never judged a stall. Under load
        these took over a short job.stall_timeout, and the launcher's watchdog killed a job that had
        finished (on_stall restart ran its last step again)."""
        self.close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None
