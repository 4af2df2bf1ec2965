"""The job's workers on this node, found by what the kernel says of them (uid, ancestry, /proc),
never by a string alone; and their beats, read here."""

from __future__ import annotations

import os
import stat
import time

from ..contract import HEARTBEAT_DIR_ENV, LAUNCHER_FILE, WORKERS_DIR, Beat, parse_beat


def read_beats(directory: str, now: float | None = None) -> list[Beat]:
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


def group_formed(directory: str) -> bool:
    """A rank of this node formed the process group or made a step: a heartbeat file in
    ``directory`` past its hook's start (:data:`PHASES`), or one the program wrote itself."""
    return any(b[5] not in ("start", "init", "left") for b in read_beats(directory))


def workers(directory: str) -> list[int]:
    """The pids of this node's workers of the job, by identity (:func:`_marked`): those whose
    environment holds a ``LOCAL_RANK`` (torchrun's workers and what they started; not the launcher),
    or the launcher's zygote named them (:func:`ranked`)."""
    marked = _marked(directory)
    found = [m.pid for m in marked if m.local is not None]
    return found + [pid for _, pid in _named(directory, marked) if pid not in found]


def ranked(directory: str) -> dict[int, int]:
    """This node's workers of the job by local rank: the process torchrun's agent (or the launcher's
    zygote) started for each, not the processes it started itself; pids as this machine's /proc
    numbers them (a container's zygote names its own, which :func:`_named` maps)."""
    marked = _marked(directory)
    ranked_pids = {m.pid for m in marked if m.local is not None}
    found = {m.local: m.pid for m in marked if m.local is not None and m.parent not in ranked_pids}
    found.update(_named(directory, marked))
    return found


class _Marked:
    __slots__ = ("pid", "local", "parent", "inner", "uid", "start")

    def __init__(self, pid: int, local: int | None, parent: int, inner: int, uid: int | None, start: int) -> None:
        self.pid, self.local, self.parent, self.inner, self.uid, self.start = pid, local, parent, inner, uid, start


def _marked(directory: str) -> list[_Marked]:
    """This node's processes of the job, by what the kernel says of them: each runs with the job's uid
    alone (:func:`_job_uid`) and descends from the launcher named in ``directory`` (:data:`LAUNCHER_FILE`)
    or from this process (the launcher's own watchdog), and its /proc environment holds
    ``DDP_HEARTBEAT_DIR=directory``. Any process may set that environment: it only narrows the search.
    For each: its LOCAL_RANK (None without one), its parent, and its pid in its own pid namespace."""
    every = _with_marker(directory)
    launcher = _launcher(directory, every)
    uid = _job_uid(launcher)
    if uid is None:
        return []
    roots = {os.getpid()} | ({launcher.pid} if launcher is not None and launcher.uid == uid else set())
    parents = {m.pid: m.parent for m in every}
    return [m for m in every if m.uid == uid and _descends(m.pid, roots, parents)]


def _with_marker(directory: str) -> list[_Marked]:
    """Every process but this one whose /proc environment holds ``DDP_HEARTBEAT_DIR=directory``."""
    marker = f"{HEARTBEAT_DIR_ENV}={directory}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            if marker not in env:
                continue
            rank = next((v[11:] for v in env if v.startswith(b"LOCAL_RANK=")), b"")
            with open(f"/proc/{entry}/status", "rb") as fh:
                status = dict(line.split(b":", 1) for line in fh.read().splitlines() if b":" in line)
            inner = status.get(b"NSpid", b"").split() or [entry.encode()]
            here = proc_stat(int(entry))
            if here is None:
                continue
            found.append(_Marked(int(entry), int(rank) if rank.isdigit() else None, here[0], int(inner[-1]),
                                 _one_uid(status.get(b"Uid", b"")), here[1]))
        except (OSError, ValueError):
            continue
    return found


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent, start) of process ``pid`` from /proc/PID/stat: its parent's pid and its start in clock
    ticks after boot; None once it has ended. Read after the command name, which may hold anything."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _one_uid(field: bytes) -> int | None:
    """The uid of a /proc/PID/status ``Uid:`` line (real, effective, saved, filesystem) where all four
    are one; None where they differ (a setuid program), which is no job's process."""
    uids = field.split()
    return int(uids[0]) if len(uids) == 4 and len(set(uids)) == 1 and uids[0].isdigit() else None


def _uid_of(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            line = next((line for line in fh if line.startswith(b"Uid:")), b"")
    except OSError:
        return None
    return _one_uid(line[4:])


def _launcher(directory: str, marked: list[_Marked]) -> _Marked | None:
    """The launcher named in ``directory`` (:data:`LAUNCHER_FILE`), while it runs: among ``marked``,
    the one process whose pid in its own namespace and start are those written there."""
    path = os.path.join(directory, LAUNCHER_FILE)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with open(path, "rb") as fh:
            words = fh.read(64).split()
    except OSError:
        return None
    if len(words) < 2 or not words[0].isdigit() or not words[1].isdigit():
        return None
    same = [m for m in marked if m.inner == int(words[0]) and m.start == int(words[1])]
    return same[0] if len(same) == 1 else None


def _job_uid(launcher: _Marked | None) -> int | None:
    """The uid the job's processes run with: this process's (doctor runs as the job's user, the
    watchdog in its launcher). As root: that of the first process of the launcher's pid namespace,
    where that namespace is this one or a container's made in this user namespace (only a privileged
    runtime makes one: a user without privileges makes a pid namespace only inside a user namespace
    of their own). A container's first process is its launcher (``docker exec -u 0`` runs doctor in
    it); this namespace's, on a node, is init: root."""
    me = os.getuid()
    if me != 0:
        return me
    first: int | None = 1
    if launcher is not None and _namespace(launcher.pid, "pid") != _namespace("self", "pid") \
            and _namespace(launcher.pid, "user") == _namespace("self", "user"):
        first = _first_in(_namespace(launcher.pid, "pid"))
    return None if first is None else _uid_of(first)


def _namespace(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _first_in(namespace: str | None) -> int | None:
    """The pid (as this machine's /proc numbers it) of the process that is 1 in pid namespace ``namespace``."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and namespace is not None and _namespace(entry, "pid") == namespace:
            try:
                with open(f"/proc/{entry}/status", "rb") as fh:
                    inner = next((line[6:].split() for line in fh if line.startswith(b"NSpid:")), [])
            except OSError:
                continue
            if inner and inner[-1] == b"1":
                return int(entry)
    return None


def _descends(pid: int, roots: set[int], parents: dict[int, int]) -> bool:
    """Whether one of ``roots`` is an ancestor of ``pid`` (its chain of parents, from ``parents`` or
    /proc). A process whose parent ended has been given to another (init, or a child subreaper):
    it descends from that one since."""
    seen = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        parent = parents.get(pid)
        if parent is None:
            here = proc_stat(pid)
            parent = here[0] if here is not None else 0
        if parent in roots:
            return True
        pid = parent
    return False


def _named(directory: str, marked: list[_Marked]) -> list[tuple[int, int]]:
    """(local rank, pid) of each worker the launcher's zygote named in ``workers/`` (agent/zygote.py):
    one of the job's marked processes (a forked worker's /proc environment is the launcher's), found
    by its pid in its own namespace, which is the one the zygote wrote (a container's, seen from its node)."""
    try:
        names = os.listdir(os.path.join(directory, WORKERS_DIR))
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(directory, WORKERS_DIR, name), "rb") as fh:
                words = fh.read(64).split()
        except OSError:
            continue
        if not words or not words[0].isdigit():
            continue
        said = int(words[0])
        same = [m.pid for m in marked if m.pid == said] or [m.pid for m in marked if m.inner == said]
        if len(same) == 1:
            found.append((int(name), same[0]))
    return found
