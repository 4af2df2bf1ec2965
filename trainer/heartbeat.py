"""Each rank's progress, kept where `status` reads it cheaply: one small file per local rank in a
node-local directory, never on the shared volume. No torch here (the deploy tool reads these too).

``ddp-deploy launch`` sets ``DDP_HEARTBEAT_DIR`` on every node (``/dev/shm/ddp-heartbeat-JOB@NODE``:
memory, and a container with ``--ipc host`` shares it with its node); the launcher makes it empty
and private to the run. A rank writes ``$DDP_HEARTBEAT_DIR/$LOCAL_RANK`` whenever it makes
progress: one line, ``STEP [RANK [GAP_MS]]``, the file's modification time being when. The
built-in trainer writes it at every optimizer step, evaluation batch and checkpoint, in place
(``pwrite`` of a fixed-width line: a few microseconds). A user program may opt in with one line
and no import of this bundle (README, "When a job hangs")::

    open(f"{os.environ['DDP_HEARTBEAT_DIR']}/{os.environ['LOCAL_RANK']}", "w").write(f"{step} {os.environ['RANK']}\\n")

``GAP_MS`` is the longest time between two of the rank's beats so far: what the default
``job.stall_timeout`` is derived from, so that a slow but healthy job is never called stalled.
"""

from __future__ import annotations

import os
import stat
import sys
import time

HEARTBEAT_DIR_ENV = "DDP_HEARTBEAT_DIR"
LINE_BYTES = 46
"""A beat's line: step (20 digits), rank (10), gap in ms (13), the spaces and the newline: fixed,
so that a write in place never leaves a longer line's end behind."""


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


def prepare(directory: str | None) -> str | None:
    """The launcher's part: ``directory`` made (or emptied: a run's beats are its own), private to
    this user; None (beats off, with a warning) where it is not ours to use: another user's, a link."""
    if not directory:
        return None
    try:
        os.mkdir(directory, 0o755)
        return directory
    except FileExistsError:
        pass
    except OSError as exc:
        return _off(directory, exc.strerror or str(exc))
    try:
        st = os.lstat(directory)
    except OSError as exc:
        return _off(directory, exc.strerror or str(exc))
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return _off(directory, "it exists and is not this user's directory")
    for name in os.listdir(directory):
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass
    return directory


def remove(directory: str | None) -> None:
    if not directory:
        return
    try:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    except OSError:
        pass


def _off(directory: str, why: str) -> None:
    sys.stderr.write(f"trainer.launch: warning: heartbeats off ({directory}: {why}); `ddp-deploy status` reads "
                     "this node's output instead\n")
    return None


# --- what `status` reads ------------------------------------------------------------------------

LARGEST = 2 ** 53


def _whole(word: str) -> int | None:
    return int(word) if word.isascii() and word.isdigit() and len(word) <= 16 and int(word) <= LARGEST else None


def parse_beat(name: str, age: str, text: str) -> tuple[int, int | None, int | None, float | None, float] | None:
    """A heartbeat file as the node's status script printed it (its name, its age in seconds, its
    first line): (local rank, step, rank, gap in seconds, age in seconds), or None where it is not
    one. A file written after the node's clock read (a negative age) is new: 0. The file is the job's: any field that is not a plain number is None."""
    local, seconds = _whole(name), _whole("0" if age[:1] == "-" and _whole(age[1:]) is not None else age)
    if local is None or seconds is None:
        return None
    words = text.split()[:3]
    step, rank, gap = (*(_whole(w) for w in words), None, None, None)[:3]
    return local, step, rank, None if gap is None else gap / 1000, float(seconds)
