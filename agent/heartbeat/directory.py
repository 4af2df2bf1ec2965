"""The heartbeat directory's life: made empty and private to a run by its launcher, which names
itself in it, and removed after; and the workers' path to the progress hook."""

from __future__ import annotations

import contextlib
import os
import stat
import sys

from ..contract import LAUNCHER_FILE, WORKERS_DIR
from .procs import proc_stat


HOOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "progress_hook")
"""The ``sitecustomize`` and the hook it installs (agent/progress_hook): first on the workers' path."""


def hooked_path(python_path: str | None) -> str:
    """``PYTHONPATH`` for the workers: :data:`HOOK_DIR` first, then what it was."""
    return os.pathsep.join([HOOK_DIR, *(p for p in (python_path or "").split(os.pathsep) if p and p != HOOK_DIR)])


def prepare(directory: str | None) -> str | None:
    """The launcher's part: ``directory`` made (or emptied: a run's beats are its own), private to
    this user, and this process named in it (:data:`LAUNCHER_FILE`); None (beats off, with a warning)
    where it is not ours to use: another user's, a link."""
    if not directory:
        return None
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        try:
            st = os.lstat(directory)
        except OSError as exc:
            return _off(directory, exc.strerror or str(exc))
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return _off(directory, "it exists and is not this user's directory")
        empty(directory)
    except OSError as exc:
        return _off(directory, exc.strerror or str(exc))
    _name_launcher(directory)
    return directory


def _name_launcher(directory: str) -> None:
    """This process named in ``directory`` as the one the job's workers descend from: how `doctor`
    tells them from any other process that sets the same environment."""
    here = proc_stat(os.getpid())
    why = "this system has no /proc" if here is None else None
    if here is not None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            with os.fdopen(os.open(os.path.join(directory, LAUNCHER_FILE), flags, 0o644), "w") as fh:
                fh.write(f"{os.getpid()} {here[1]}\n")
        except OSError as exc:
            why = exc.strerror or str(exc)
    if why is not None:
        sys.stderr.write(f"agent.launch: warning: the launcher is not named in {directory} ({why}): "
                         "`ddp-deploy doctor` finds no worker of this node\n")


def empty(directory: str, workers_too: bool = True, keep: tuple[str, ...] = ()) -> None:
    """Every file in ``directory`` but those named in ``keep`` removed, as far as it can be; and,
    ``workers_too``, in its ``workers/`` (agent/zygote.py: which worker the launcher's zygote forked
    for each local rank)."""
    for name in os.listdir(directory):
        if name in keep:
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except IsADirectoryError:
            if name == WORKERS_DIR and workers_too:
                empty(os.path.join(directory, name), False)
        except OSError:
            pass


def remove(directory: str | None) -> None:
    if not directory:
        return
    try:
        empty(directory)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(os.path.join(directory, WORKERS_DIR))
        os.rmdir(directory)
    except OSError:
        pass


def _off(directory: str, why: str) -> None:
    sys.stderr.write(f"agent.launch: warning: heartbeats off ({directory}: {why}); `ddp-deploy status` reads "
                     "this node's output instead\n")
    return None
