"""This machine's processes as /proc shows them (the test cluster's nodes share its pid space)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def command_name(pid: int) -> str | None:
    """Its command name (/proc/PID/comm), or None once it has ended."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def parent_of(pid: int) -> int | None:
    try:
        return int(_stat_fields(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def children_of(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and parent_of(int(p.name)) == pid]


def descendants_of(pid: int) -> list[int]:
    """Its children, theirs, and so on (a launcher's zygote and the workers it forked)."""
    found, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def with_environ(match: Callable[[list[bytes]], bool]) -> list[int]:
    """The pids of the other processes whose environment (its ``NAME=VALUE`` entries) ``match`` accepts."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(env):
            found.append(int(p.name))
    return found


def kill_runs_under(directory: Path) -> list[int]:
    """SIGKILLs every process of a run kept under ``directory`` (the host runtime marks each process
    of a run with ``DDP_DEPLOY_RUN=<its run directory>``, deploy/job/runtime.py); their pids."""
    prefix = f"DDP_DEPLOY_RUN={directory}/".encode()
    return kill(with_environ(lambda env: any(v.startswith(prefix) for v in env)))


def kill(pids: list[int]) -> list[int]:
    """SIGKILLs each of ``pids``, in order; those it reached."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    return killed
