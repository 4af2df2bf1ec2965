"""This machine's processes as /proc shows them (the test cluster's nodes share its pid space)."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


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
