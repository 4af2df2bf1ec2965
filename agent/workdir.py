"""The program's working directory with train.code: its own, writable and kept, beside its code.

The code snapshot (deploy/job/codesync.py) is read-only and shared by every run of that code, so
it cannot be where a program writes: a tutorial's ``torch.save(state, "checkpoint.pth")`` or
``FashionMNIST(root="data", download=True)`` would fail there. Before torchrun starts, the
launcher makes the node's own working directory, ``$DDP_CKPT_DIR/work/<node>``, and runs the job
there:

- every directory of the code is a real directory there, every file a symbolic link to the
  snapshot's: reading works as in the project directory, a new file (or one renamed over a
  link) is the program's own, and a write through a link fails, as the snapshot is read-only;
- at every launch the links are made again for the snapshot of that launch: a link to a file the
  new code no longer has goes, and what the program wrote stays. A file or directory the program
  made where the code now has one is kept too, and named in a warning (it hides the code's);
- it is the node's: on a shared volume each node's rank 0 saving "its own" ``checkpoint.pth``
  writes its own file, never one file with another node at once.

The directory and everything in it is the job's: the launcher runs as the job's user, and it
never writes through a link found there. Every directory is opened one level at a time with
``O_NOFOLLOW`` and every change made relative to it, so a link the program left where a directory
of the code is (or the working directory itself replaced by a link) is skipped or refused, never
followed. Which links are the launcher's is kept beside the directory (``.<node>.links``), so that
a link the program made itself is never taken for one of them.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys

from .contract import CKPT_ENV, NODE_ENV, SNAPSHOT_ENV, WORK_SUBDIR as SUBDIR

MANIFEST = ".ddp-manifest.json"
"""The snapshot's own record (deploy/programs/node_code.py): not part of the code."""
RECORD_BYTES = 64 << 20
"""A record of links longer than this is not read (it is the job's file): every link is then
made anew and none is removed."""
SHOWN = 3
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class WorkDirError(Exception):
    """The working directory cannot be made or entered (its message names the path and why)."""


def path(environ=os.environ) -> str | None:
    """The node's working directory, ``$DDP_CKPT_DIR/work/<node>``; None without a checkpoint
    directory."""
    ckpt = environ.get(CKPT_ENV)
    if not ckpt:
        return None
    return os.path.join(ckpt, SUBDIR, node_name(environ))


def node_name(environ=os.environ) -> str:
    name = environ.get(NODE_ENV) or socket.gethostname()
    if name in (".", "..") or "/" in name or "\0" in name:
        raise WorkDirError(f"the node's name {name!r} cannot name a directory")
    return name


def enter(environ=os.environ, out=sys.stderr) -> str | None:
    """With ``$DDP_CODE_SNAPSHOT`` set (the launch put the working directory at the snapshot):
    makes the node's working directory from the current directory's tree (:func:`refresh`), enters
    it, and returns the snapshot's path. Without, or without ``$DDP_CKPT_DIR``: None, nothing
    changes. Raises WorkDirError (its message names the path) when it cannot."""
    if not environ.get(SNAPSHOT_ENV):
        return None
    where = path(environ)
    if where is None:
        return None
    snapshot = os.getcwd()
    try:
        fd = refresh(where, snapshot, out)
    except OSError as exc:  # a full or read-only volume, a directory of the code the job took away
        raise WorkDirError(f"cannot make the working directory {where}: {exc.strerror or exc}") from exc
    try:
        os.chdir(fd)
    finally:
        os.close(fd)
    environ["PWD"] = where
    return snapshot


def refresh(where: str, snapshot: str, out=sys.stderr) -> int:
    """Makes ``where`` the link tree of ``snapshot`` (module docstring) and returns a descriptor of
    it, opened without following a link. Raises WorkDirError when ``where`` or a directory above it
    under the checkpoint directory is a link or not a directory."""
    parent, name = os.path.split(os.path.normpath(where))
    top, base = os.path.split(parent)
    try:
        root = os.open(top, os.O_RDONLY | os.O_DIRECTORY)  # the checkpoint directory: the job's mount
    except OSError as exc:
        raise WorkDirError(f"cannot open {top}: {exc.strerror or exc}") from exc
    try:
        work = _subdir(root, base, parent)
    finally:
        os.close(root)
    try:
        node = _subdir(work, name, where)
        record = "." + name + ".links"
        before = _read_record(work, record)
        files = _tree(snapshot)
        tree = _Tree(node, where)
        try:
            made, shadowed = {}, []
            for rel in files:
                target = os.path.join(snapshot, rel)
                state = tree.link(rel, target)
                if state == "theirs":
                    shadowed.append(rel)
                elif state:
                    made[rel] = target
            for rel, target in before.items():
                if rel not in files:
                    tree.unlink(rel, target)
        finally:
            tree.close()
        _write_record(work, record, made)
    finally:
        os.close(work)
    if shadowed or tree.skipped:
        _say_kept(shadowed, tree.skipped, where, out)
    return node


def _subdir(parent: int, name: str, shown: str) -> int:
    """``name`` in ``parent``, made if absent, opened without following a link."""
    try:
        os.mkdir(name, 0o755, dir_fd=parent)
    except FileExistsError:
        pass
    except OSError as exc:
        raise WorkDirError(f"cannot make {shown}: {exc.strerror or exc}") from exc
    try:
        return os.open(name, _DIR, dir_fd=parent)
    except OSError as exc:
        raise WorkDirError(f"{shown} is a link or not a directory ({exc.strerror or exc}); "
                           "move it aside and launch again") from exc


def _tree(snapshot: str) -> list[str]:
    """The snapshot's files, relative, '/'-separated, in order (its own record left out)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(snapshot):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, snapshot)
        for name in sorted(filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            if rel != MANIFEST:
                found.append(rel)
    return found


class _Tree:
    """Directories of the working directory, each opened once, never through a link."""

    def __init__(self, node: int, where: str) -> None:
        self.fds = {"": node}
        self.where = where
        self.skipped: list[str] = []
        """Directories of the code the program made something else (a file, a link)."""

    def dir(self, rel_dir: str, create: bool) -> int | None:
        if rel_dir in self.fds:
            return self.fds[rel_dir]
        up, _, name = rel_dir.rpartition("/")
        parent = self.dir(up, create)
        if parent is None:
            return None
        fd = None
        if create:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except FileNotFoundError:
            pass
        except OSError:  # a link or a file the program put there: not entered
            if create and rel_dir not in self.skipped:
                self.skipped.append(rel_dir)
        self.fds[rel_dir] = fd
        return fd

    def link(self, rel: str, target: str) -> str:
        """Makes ``rel`` a link to ``target``: "made", "kept" (already so), "" (its directory is
        not one) or "theirs" (a file or directory of the program's is there)."""
        rel_dir, _, name = rel.rpartition("/")
        fd = self.dir(rel_dir, create=True)
        if fd is None:
            return ""
        try:
            st = os.lstat(name, dir_fd=fd)
        except FileNotFoundError:
            os.symlink(target, name, dir_fd=fd)
            return "made"
        if not stat.S_ISLNK(st.st_mode):
            return "theirs"
        if os.readlink(name, dir_fd=fd) == target:
            return "kept"
        # a link of an earlier snapshot, or one the program made where the code has a file: the
        # rename replaces the link itself, never what it points to
        temporary = f".{name}.ddp-link-{os.getpid()}"
        try:
            os.unlink(temporary, dir_fd=fd)
        except FileNotFoundError:
            pass
        os.symlink(target, temporary, dir_fd=fd)
        os.replace(temporary, name, src_dir_fd=fd, dst_dir_fd=fd)
        return "made"

    def unlink(self, rel: str, target: str) -> None:
        """Removes ``rel`` where it is still the launcher's link to ``target``, then the
        directories above it that it leaves empty."""
        rel_dir, _, name = rel.rpartition("/")
        fd = self.dir(rel_dir, create=False)
        if fd is None:
            return
        try:
            if not stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode) or os.readlink(name, dir_fd=fd) != target:
                return
            os.unlink(name, dir_fd=fd)
        except OSError:
            return
        while rel_dir:
            up, _, base = rel_dir.rpartition("/")
            parent = self.fds.get(up)
            if parent is None:
                return
            try:
                os.rmdir(base, dir_fd=parent)  # only an empty one
            except OSError:
                return
            closing = self.fds.pop(rel_dir, None)
            if closing is not None:
                os.close(closing)
            rel_dir = up

    def close(self) -> None:
        for rel_dir, fd in self.fds.items():
            if rel_dir and fd is not None:
                os.close(fd)


def _read_record(work: int, name: str) -> dict[str, str]:
    """The launcher's links of the last launch (none when the record is missing, a link, too
    long or not ours in shape)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=work)
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {}
            data = f.read(RECORD_BYTES + 1)
    except OSError:
        return {}
    try:
        links = json.loads(data) if len(data) <= RECORD_BYTES else {}
    except ValueError:
        return {}
    if not isinstance(links, dict):
        return {}
    return {k: v for k, v in links.items() if isinstance(k, str) and isinstance(v, str)
            and k and not k.startswith("/") and ".." not in k.split("/")}


def _write_record(work: int, name: str, links: dict[str, str]) -> None:
    temporary = f"{name}.{os.getpid()}.tmp"
    try:
        os.unlink(temporary, dir_fd=work)
    except FileNotFoundError:
        pass
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=work)
    with os.fdopen(fd, "w") as f:
        json.dump(links, f, separators=(",", ":"))
    os.replace(temporary, name, src_dir_fd=work, dst_dir_fd=work)


def _say_kept(shadowed: list[str], skipped: list[str], where: str, out) -> None:
    names = [*skipped, *shadowed]
    shown = ", ".join(json.dumps(n) for n in names[:SHOWN]) + (f" and {len(names) - SHOWN} more"
                                                               if len(names) > SHOWN else "")
    own = "is the program's own" if len(names) == 1 else "are the program's own"
    out.write(f"agent.launch: warning: {shown} in the working directory {where} {own}, where the code "
              "has a file or directory of that name: kept, and the code's is not there (remove it to get "
              "the code's)\n")
    out.flush()
