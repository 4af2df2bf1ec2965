"""Each rank's progress, kept where `status` reads it cheaply: one small file per local rank in a
node-local directory, never on the shared volume. No torch here (the deploy tool reads these too).

``ddp-deploy launch`` sets ``DDP_HEARTBEAT_DIR`` on every node (``/dev/shm/ddp-heartbeat-RUNTIME-JOB@NODE``:
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
import signal
import stat
import sys
import threading
import time

HEARTBEAT_DIR_ENV = "DDP_HEARTBEAT_DIR"
ON_STALL_ENV = "DDP_ON_STALL"
"""Set for the started job when ``job.on_stall`` acts (``restart``): the launcher's :class:`Watchdog`."""
STALL_TIMEOUT_ENV = "DDP_STALL_TIMEOUT"
"""``job.stall_timeout`` for the watchdog: ``auto`` or seconds."""
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


# --- when a node is stalled ----------------------------------------------------------------------

FLOOR_S = 300.0
"""``stall_timeout: auto`` is never less than this."""
GAP_FACTOR = 10
"""``auto`` is this many times the longest interval between two beats a rank has shown."""
QUIET_S = 1800.0
"""``auto`` for a program without heartbeats: seconds of silence in its output."""


def stall_limit(setting, gaps: list[float | None], beating: bool) -> float | None:
    """The seconds without progress after which a node is stalled, under ``job.stall_timeout``
    (``setting``: ``auto``, a number, None for never), from its ranks' longest intervals (``gaps``;
    None where a rank does not say) when they beat, else for its output (``beating`` False)."""
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    if not beating:
        return QUIET_S
    return max(FLOOR_S, GAP_FACTOR * max((g for g in gaps if g is not None), default=0.0))


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


# --- the node's own watch (job.on_stall: restart) ---------------------------------------------------

def read_beats(directory: str, now: float | None = None) -> list[tuple[int, int | None, int | None, float | None, float]]:
    """The beats in ``directory`` as :func:`parse_beat` reads them (ages by this machine's clock)."""
    now = time.time() if now is None else now
    found = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            with open(path, "rb") as fh:
                first = fh.read(64).split(b"\n")[0].decode("ascii", "replace")
        except OSError:
            continue
        beat = parse_beat(name, str(max(0, int(now - st.st_mtime))), first)
        if beat is not None:
            found.append(beat)
    return found


def workers(directory: str) -> list[int]:
    """The pids of this node's workers of the job, by exact identity: their environment holds
    ``DDP_HEARTBEAT_DIR=directory`` and a ``LOCAL_RANK`` (torchrun's workers; not the launcher)."""
    marker = f"{HEARTBEAT_DIR_ENV}={directory}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if marker in env and any(v.startswith(b"LOCAL_RANK=") for v in env):
            found.append(int(entry))
    return found


class Watchdog:
    """``job.on_stall: restart`` on one node: when none of its ranks has beaten for the stall
    timeout, kills its workers (a hung rank cannot checkpoint) and empties the heartbeats; torchrun's
    agent then starts them again, counted against ``--max-restarts``, in a new rendezvous round the
    other nodes' agents join, and the job resumes from its newest checkpoint. Before the first
    beat, and after an action until the next one, there is nothing to judge: nothing is done."""

    def __init__(self, directory: str, setting, every: float = 1.0, out=sys.stderr) -> None:
        self.directory, self.setting, self.every, self.out = directory, setting, every, out
        self.actions = 0

    @classmethod
    def from_environ(cls, directory: str | None, environ=os.environ) -> "Watchdog | None":
        if not directory or environ.get(ON_STALL_ENV) != "restart":
            return None
        raw = environ.get(STALL_TIMEOUT_ENV, "auto")
        try:
            setting = "auto" if raw == "auto" else float(raw)
        except ValueError:
            setting = "auto"
        return cls(directory, setting)

    def check(self, now: float | None = None) -> bool:
        """One look; True when it acted."""
        beats = read_beats(self.directory, now)
        if not beats:
            return False
        limit = stall_limit(self.setting, [b[3] for b in beats], True)
        age = min(b[4] for b in beats)
        if limit is None or age <= limit:
            return False
        step = max((b[1] for b in beats if b[1] is not None), default=None)
        pids = workers(self.directory)
        self.out.write(f"trainer.launch: stalled: no rank on this node moved for {age:.0f} s (last step "
                       f"{'?' if step is None else step}; job.stall_timeout {limit:g} s): killing its {len(pids)} "
                       "workers, which torchrun starts again from the newest checkpoint (job.on_stall: restart)\n")
        self.out.flush()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for name in os.listdir(self.directory):
            try:
                os.unlink(os.path.join(self.directory, name))
            except OSError:
                pass
        self.actions += 1
        return True

    def start(self) -> threading.Thread:
        def run():
            while True:
                time.sleep(self.every)
                try:
                    self.check()
                except OSError:
                    pass
        thread = threading.Thread(target=run, name="stall-watchdog", daemon=True)
        thread.start()
        return thread
