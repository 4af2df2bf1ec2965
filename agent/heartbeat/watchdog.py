"""The launcher's own watch of its node's ranks: a stall kept with the run, diagnosed, and acted
on as ``job.on_stall`` says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback

from ..contract import (
    DIAGNOSE_S, DIAGNOSIS_BYTES, LAUNCHER_FILE, ON_STALL_ENV, SETTLE_S, STALL_RECORD_ENV, STALL_TIMEOUT_ENV, program,
    verdict,
)
from .directory import empty, remove
from .procs import read_beats, workers


def stall_setting(environ=os.environ):
    """``job.stall_timeout`` as the deploy tool passed it: ``auto``, seconds, or None (never)."""
    raw = environ.get(STALL_TIMEOUT_ENV, "auto")
    if raw == "None":
        return None
    try:
        return "auto" if raw == "auto" else float(raw)
    except ValueError:
        return "auto"


def main_thread_at(depth: int = 5) -> str:
    """Where this process's main thread is, its innermost ``depth`` frames innermost first: in the
    launcher, torchrun's agent."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    frames = traceback.extract_stack(frame)[-depth:]
    return " < ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in reversed(frames))


class Watchdog:
    """A node's own watch of its ranks, in its launcher: when none of them has beaten for the stall
    timeout, it keeps the stall with the run and acts on ``job.on_stall``.

    Kept (``record``: the node's directory of the run on the shared volume, runs.py): a line in
    ``stalls``, ``TIME STEP QUIET_S LIMIT_S ACTION`` (deploy/job/runs.py reads it), and in
    ``stall-TIME`` what the node program ``diagnose`` found: each worker's state and Python stacks, the
    diagnosis ``status --run`` gives later, when the hung processes may be long gone.

    ``report``: that, and a line in the log, once per stall. ``restart``: then it kills its workers
    (a hung rank cannot checkpoint) and empties the heartbeats; torchrun's agent starts them again,
    counted against ``--max-restarts``, in a new rendezvous round the other nodes' agents join, and
    the job resumes from its newest checkpoint. ``stop``: it kills its workers and ends the launcher
    with 0, so that nothing starts them again (a hang stalls every node: each one's launcher ends its
    part). A rank's clock starts when its worker starts (its hook's ``start``, :func:`verdict`); with
    ``auto``, a start-up is not judged until a rank shows an interval, unless a rank ended while the
    others wait on it. Before any worker's first line, and after a restart until the next one, there
    is nothing to judge: nothing is done."""

    def __init__(self, directory: str, setting, action: str = "report", record: str | None = None,
                 every: float = 1.0, out=sys.stderr, spy: str | None = None, end=None,
                 settle: float = SETTLE_S) -> None:
        self.directory, self.setting, self.action, self.record = directory, setting, action, record
        self.every, self.out, self.settle = every, out, settle
        self.end = end or self._end_here
        self.spy = spy or os.path.join(os.path.dirname(sys.executable), "py-spy")  # installed beside it
        self.actions = 0
        self.stopping = False
        """Set once it has decided to stop (job.on_stall: stop), before it kills: from then on the
        launcher ends with 0 however torchrun ends (another node's stop may fail these workers first)."""
        self._reported = False

    @classmethod
    def from_environ(cls, directory: str | None, environ=os.environ) -> "Watchdog | None":
        """None where nothing is watched: no heartbeats, no ``job.on_stall`` set by the deploy
        tool, or ``job.stall_timeout`` null."""
        action = environ.get(ON_STALL_ENV)
        if not directory or action not in ("report", "restart", "stop"):
            return None
        setting = stall_setting(environ)
        if setting is None:
            return None
        return cls(directory, setting, action, environ.get(STALL_RECORD_ENV) or None)

    def check(self, now: float | None = None) -> bool:
        """One look; True when it found a new stall (and acted on it)."""
        beats = read_beats(self.directory, now)
        seen = verdict(self.setting, beats)
        if seen is None:
            return False
        age, limit, left = seen
        if age <= limit:
            self._reported = False  # moving again: the next stall is a new one
            return False
        if self._reported:
            return False
        step = max((b[1] for b in beats if b[1] is not None), default=None)
        kept = self.keep(int(time.time() if now is None else now), step, age, limit)
        what = f"no rank on this node moved for {age:.0f} s (last step {'?' if step is None else step}; " \
               f"job.stall_timeout {limit:g} s)" if left is None else \
               f"{left} ended {age:.0f} s ago while the others on this node never formed the process group or " \
               "wait in their first collective"
        if not workers(self.directory):  # they ended, and nothing started them again: the agent hangs
            what += f"; no worker of it runs, and torchrun's agent is in {main_thread_at()}"
        if self.action == "report":
            self.out.write(f"agent.launch: stalled: {what}: {kept} (job.on_stall: report)\n")
            self.out.flush()
            self._reported = True
            self.actions += 1
            return True
        self.stopping = self.action == "stop"
        time.sleep(self.settle)  # the other nodes' launchers read their stacks before these workers' end shakes them
        pids = workers(self.directory)
        then = ("which torchrun starts again from the newest checkpoint (job.on_stall: restart)"
                if self.action == "restart" else "and ending this node's part of the job, which nothing starts "
                "again (job.on_stall: stop): launch again to resume from the newest checkpoint")
        self.out.write(f"agent.launch: stalled: {what}: {kept}; killing its {len(pids)} workers, {then}\n")
        self.out.flush()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        empty(self.directory, keep=(LAUNCHER_FILE,))  # the next beats are the new workers'
        self.actions += 1
        if self.action == "stop":
            self.end()
        return True

    def _end_here(self) -> None:
        """``stop``: this launcher ends at once, with 0, so that neither torchrun's agent nor Docker's
        restart policy nor the host supervisor starts the job again; the kept stall says why
        (``status`` shows the node stopped, stalled)."""
        remove(self.directory)
        os._exit(0)

    def keep(self, when: int, step: int | None, age: float, limit: float) -> str:
        """The stall and its diagnosis kept with the run; what the log says of it."""
        if not self.record:
            return "not kept (no run directory)"
        try:
            found = subprocess.run(["sh", "-c", program("diagnose"), "sh", self.directory, self.spy], stdin=subprocess.DEVNULL,
                                   capture_output=True, timeout=DIAGNOSE_S).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            found = f"problem {exc}\n".encode()
        try:
            with open(os.path.join(self.record, f"stall-{when}"), "wb") as fh:
                fh.write(found[:DIAGNOSIS_BYTES])
            with open(os.path.join(self.record, "stalls"), "a") as fh:
                fh.write(f"{when} {'-' if step is None else step} {int(age)} {int(limit)} {self.action}\n")
        except OSError as exc:
            return f"not kept ({exc.strerror or exc})"
        return "the stacks of its workers are kept with the run (ddp-deploy status --run)"

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
