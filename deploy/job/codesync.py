"""The user's code, synced without a rebuild: a local directory -> an immutable snapshot on the
shared volume, named by its content, read-only: the job runs in its node's working directory,
whose files of the code are links to it (agent/workdir.py).

``scan`` reads the directory on the operator's machine (no connection): every file not ignored
(the project's .gitignore files, hosts.yaml's ``train.code.ignore``, and .git/), its sha256 and
whether it is executable. The snapshot id is the sha256 of that manifest, so the same tree is the
same snapshot on every launch and a one-file edit is a new snapshot sharing every other file.

``sync`` asks each node which of the snapshot's files its store lacks and sends only those, in one
tar over SSH; the node checks each against its sha256 and builds the snapshot (deploy/programs/node_code.py).
Nodes are visited in order: on a shared volume the first node's copy is every node's, and the
others only confirm it; a node that does not share it gets its own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError, RemoteFailure
from ..inventory import Inventory
from ..programs import HERE
from ..nodes.remote import Remote, Result
from .runtime import CodeDir, runtime

if TYPE_CHECKING:
    import pathspec

STORE_SUBDIR = ".ddp-deploy/code"
"""Under storage.checkpoints.host: the shared volume every node mounts."""
NODE_PROGRAM = HERE / "node_code.py"


class CodeError(InputError):
    """The code directory cannot be read or snapshotted."""


@dataclass(frozen=True)
class FileEntry:
    path: str
    """Relative, '/'-separated."""
    key: str
    """sha256 hex of the content, with ``.x`` for an executable file."""
    size: int


@dataclass(frozen=True)
class Snapshot:
    root: Path
    files: tuple[FileEntry, ...]

    @property
    def id(self) -> str:
        return hashlib.sha256(self.manifest()).hexdigest()[:32]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def manifest(self) -> bytes:
        return json.dumps([[f.path, f.key, f.size] for f in self.files], separators=(",", ":")).encode()


@dataclass(frozen=True)
class Sent:
    """What one node's sync did."""

    files: int = 0
    bytes: int = 0
    present: bool = False
    """The snapshot was already there (sent by an earlier launch, or via another node's copy)."""
    moved: tuple[str, ...] = ()
    """The node's word on a snapshot it found differing from its code and moved aside before
    building it again: where it is now and what differed (paths JSON-quoted: they are the
    program's names, not ours)."""


class _Ignore:
    """The project's .gitignore files (each applies below its own directory, deeper ones later)
    and then hosts.yaml's patterns: the last pattern that matches decides, as in git."""

    def __init__(self, extra: Sequence[str]) -> None:
        import pathspec  # here: only a job with train.code reads ignore files

        self._gitignores: list[tuple[str, pathspec.GitIgnoreSpec]] = []
        self._extra = pathspec.GitIgnoreSpec.from_lines(extra)

    def add_dir(self, root: Path, rel: str) -> None:
        import pathspec

        gitignore = root / rel / ".gitignore"
        if gitignore.is_file():
            self._gitignores.append((rel, pathspec.GitIgnoreSpec.from_lines(gitignore.read_text(errors="replace").splitlines())))

    def ignored(self, rel: str, is_dir: bool) -> bool:
        if rel == ".git" or rel.endswith("/.git"):
            return True
        verdict = False
        for base, spec in [*self._gitignores, ("", self._extra)]:
            if base and not rel.startswith(base + "/"):
                continue
            sub = rel[len(base) + 1:] if base else rel
            result = spec.check_file(sub + "/" if is_dir else sub)
            if result.include is not None:
                verdict = result.include
        return verdict


def scan(root: Path, ignore: Sequence[str] = ()) -> Snapshot:
    """The snapshot of ``root`` (raises CodeError naming the path that cannot be read, or a link
    that leads outside the project: what it points to would be published on every node)."""
    if not root.is_dir():
        raise CodeError(f"train.code: {root} is not a directory on this machine")
    real_root = root.resolve()
    rules = _Ignore(ignore)
    files: list[FileEntry] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        rules.add_dir(root, rel_dir)
        join = (lambda n: f"{rel_dir}/{n}") if rel_dir else (lambda n: n)
        dirnames[:] = sorted(d for d in dirnames if not rules.ignored(join(d), True))
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                _check_dir_link(root, real_root, join(name))
        for name in sorted(filenames):
            rel = join(name)
            if rules.ignored(rel, False):
                continue
            if any(ord(c) < 32 for c in rel):
                raise CodeError(f"train.code: {rel!r} has a control character in its name; rename it or ignore it")
            files.append(_entry(root, real_root, rel))
    return Snapshot(root, tuple(sorted(files, key=lambda f: f.path)))


def _outside(real_root: Path, path: Path) -> Path | None:
    """Where ``path`` really leads, when that is outside the project; None when inside."""
    target = path.resolve()
    return None if target.is_relative_to(real_root) else target


def _check_dir_link(root: Path, real_root: Path, rel: str) -> None:
    """A symlinked directory is followed (its files under the link's name) when it leads to
    another directory of the project; a link outside, or to a directory the walk is in (a loop,
    which os.walk would follow until the path is too long), is refused by name, never dropped."""
    target = _outside(real_root, root / rel)
    if target is not None:
        raise CodeError(f"train.code: {rel} is a link to {target}, outside the project: its files would be "
                        "published on every node; copy what you need into the project, or ignore it (train.code.ignore)")
    parts = Path(rel).parts[:-1]
    walked = [(root / Path(*parts[:i])).resolve() for i in range(len(parts) + 1)]
    if (root / rel).resolve() in walked:
        raise CodeError(f"train.code: {rel} is a link to a directory that holds it (a loop); "
                        "remove it or ignore it (train.code.ignore)")


def _entry(root: Path, real_root: Path, rel: str) -> FileEntry:
    path = root / rel
    try:
        target = _outside(real_root, path)
        if target is not None:
            raise CodeError(f"train.code: {rel} is a link to {target}, outside the project: it would be published "
                            "on every node; copy the file into the project, or ignore it (train.code.ignore)")
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise CodeError(f"train.code: {rel} is not a regular file; ignore it (train.code.ignore)")
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise CodeError(f"train.code: cannot read {rel}: {e.strerror or e}") from e
    executable = bool(st.st_mode & stat.S_IXUSR)
    return FileEntry(rel, h.hexdigest() + (".x" if executable else ""), st.st_size)


def snapshot_of(inv: Inventory) -> Snapshot | None:
    """The snapshot hosts.yaml's train.code names, or None when the code is in the image / installed."""
    code = inv.train.code
    if code is None:
        return None
    return scan((inv.base_dir / os.path.expanduser(code.path)).resolve(), code.ignore)


def store_dir(inv: Inventory) -> str:
    return f"{inv.storage.checkpoints.host}/{STORE_SUBDIR}"


def code_dir(inv: Inventory, snap: Snapshot | None) -> CodeDir | None:
    """Where the snapshot is on every node, for the runtime (mount or working directory)."""
    if snap is None:
        return None
    return CodeDir(snap.id, f"{store_dir(inv)}/snapshots/{snap.id}")


def node_argv(inv: Inventory, mode: str, snap: Snapshot) -> tuple[str, ...]:
    """The receiving end on a node, with the node's interpreter (outside any container)."""
    return (runtime(inv).listener_python(), "-c", _node_program(), mode, store_dir(inv), snap.id)


@functools.cache
def _node_program() -> str:
    return NODE_PROGRAM.read_text()


def sync(inv: Inventory, remote: Remote, snap: Snapshot, on_node=lambda node, sent: None,
         nodes: Sequence[str] | None = None) -> dict[str, Sent]:
    """Make the snapshot present on every node (or on ``nodes``); raises RemoteFailure naming a
    node that failed."""

    out: dict[str, Sent] = {}
    for node in inv.nodes if nodes is None else [inv.node(n) for n in nodes]:
        asked = remote.send(node.name, [snap.manifest()], node_argv(inv, "need", snap))
        if not asked.ok:
            raise RemoteFailure("code sync", {node.name: asked}, hint=_hint(inv))
        lines = asked.stdout.splitlines()
        moved = tuple(line[len("moved "):] for line in lines if line.startswith("moved "))
        missing = {line.strip() for line in lines if not line.startswith("moved ")}
        if "present" in missing:
            out[node.name] = Sent(present=True)
        else:
            out[node.name] = dataclasses.replace(_put(inv, remote, node.name, snap, missing), moved=moved)
        on_node(node.name, out[node.name])
    return out


def _put(inv: Inventory, remote: Remote, node: str, snap: Snapshot, missing: set[str]) -> Sent:

    send = [f for f in {f.key: f for f in snap.files}.values() if f.key in missing]
    with tempfile.TemporaryFile() as buf:
        with tarfile.open(fileobj=buf, mode="w|", dereference=True) as tar:  # a symlinked file: its content
            real_root = snap.root.resolve()
            for f in send:
                if _outside(real_root, snap.root / f.path) is not None:  # changed into a link since the scan
                    raise CodeError(f"train.code: {f.path} now links outside the project; launch again")
                tar.add(snap.root / f.path, arcname=f"objects/{f.key}", recursive=False)
            info = tarfile.TarInfo("manifest.json")
            manifest = snap.manifest()
            info.size = len(manifest)
            tar.addfile(info, io.BytesIO(manifest))
        buf.seek(0)
        result: Result = remote.send(node, _chunks(buf), node_argv(inv, "put", snap))
    if not result.ok:
        raise RemoteFailure("code sync", {node: result}, hint=_hint(inv))
    return Sent(files=len(send), bytes=sum(f.size for f in send))


def _hint(inv: Inventory) -> str:
    return (f"the node needs {runtime(inv).listener_python()} and a writable {store_dir(inv)} "
            "(storage.checkpoints.host)")


def _chunks(f, size: int = 1 << 20) -> Iterator[bytes]:
    yield from iter(lambda: f.read(size), b"")
