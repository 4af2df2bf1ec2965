"""The checkpoints on disk: atomic save, a completion marker, keep-last-k, newest valid on load
(trainer/checkpointer.py is the policy over them: what a checkpoint holds, when, where a run resumes).

A checkpoint is ``ckpt-<step>.pt`` plus its marker ``ckpt-<step>.pt.ok`` (JSON: size and
sha256 of the file). The file is written to a temporary name, fsynced and renamed; only then is
the marker written the same way. A checkpoint counts only when its marker exists and the file
matches it, so a crash or a full disk at any point leaves the previous checkpoint the newest
valid one. Loading uses ``torch.load(weights_only=True)``: tensors and plain containers only.

A marked checkpoint that still does not load (its bytes differ from the marker, the file is
corrupt, or ``weights_only`` refuses it) is broken: it is skipped as if it had no marker, never
counts towards keep-last, and is renamed aside to ``ckpt-<step>.pt.bad`` (its marker removed),
kept rather than deleted so that a person can see what was wrong with it (a damaged volume, a
forged file) and undo the move if a read error was only passing.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one is untouched."""


class _Broken(Exception):
    """A marked checkpoint that cannot be used; the message is the one-line reason."""


@dataclass(frozen=True)
class Skipped:
    name: str                 # the checkpoint's file name, e.g. ckpt-000000040.pt
    reason: str               # one printable line: why it was not loaded
    aside: str | None = None  # the name it was renamed to (None: the rename failed, it stays)


@dataclass
class Found:
    """What resuming found: the newest loadable checkpoint (if any) and the broken ones above it."""

    path: Path | None = None
    state: dict | None = None
    skipped: list[Skipped] = field(default_factory=list)


_REASON_CHARS = 200
_MARKER_BYTES = 4096


def _one_line(text: str) -> str:
    """A reason taken from a file's content (a pickled global's name) is data: printable and short."""
    text = " ".join(text.split())
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."


def _load_failure(exc: Exception) -> str:
    """torch's errors are paragraphs of advice; the cause is one sentence of them."""
    text = str(exc)
    refused = "WeightsUnpickler error:" in text
    if refused:
        text = text.split("WeightsUnpickler error:", 1)[1]
    cause = text.strip().split("\n\n", 1)[0].split(". ", 1)[0].rstrip(".") or type(exc).__name__
    return _one_line(f"refused by torch.load(weights_only=True): {cause}" if refused else f"does not load: {cause}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _serialize(obj: object) -> memoryview:
    """torch.save into memory: file-system errors then surface as plain OSError from our write."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer()


def _write_atomically(path: Path, data: bytes | memoryview) -> None:
    """Writes data to a temporary file next to path, fsyncs it and renames it over path."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class CheckpointStore:
    def __init__(self, directory: str | os.PathLike, keep_last: int = 3) -> None:
        self.dir = Path(directory)
        self.keep_last = keep_last
        # Checkpoints this process wrote or loaded, by (inode, size, mtime): pruning does not load
        # them again. A file replaced since has another identity and is checked anew.
        self._loadable: set[tuple[Path, int, int, int]] = set()

    def path_for(self, step: int) -> Path:
        return self.dir / f"ckpt-{step:09d}.pt"

    def _marker(self, path: Path) -> Path:
        return path.with_name(path.name + ".ok")

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint with a marker, newest first (not yet verified)."""
        if not self.dir.is_dir():
            return []
        found = []
        for entry in self.dir.iterdir():
            match = _NAME.match(entry.name)
            if match and self._marker(entry).exists():
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    def _mismatch(self, path: Path) -> str | None:
        """Why the file is not what its marker records, or None when it is."""
        try:
            with open(self._marker(path), "rb") as handle:
                marker = json.loads(handle.read(_MARKER_BYTES))  # ours is ~150 bytes; a larger one is not ours
            size, sha256 = int(marker["size"]), str(marker["sha256"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"its marker {self._marker(path).name} is unreadable ({_one_line(type(exc).__name__)})"
        try:
            actual = path.stat().st_size
            if actual != size:
                return f"{actual} bytes, its marker records {size} (torn or damaged)"
            if _sha256(path) != sha256:
                return "its sha256 differs from its marker's (damaged)"
        except OSError as exc:
            return f"unreadable: {_one_line(exc.strerror or str(exc))}"
        return None

    def _identity(self, path: Path) -> tuple[Path, int, int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return (path, st.st_ino, st.st_size, st.st_mtime_ns)

    def _open(self, path: Path) -> dict:
        """The checkpoint's state, or _Broken with the reason it cannot be used."""
        identity = self._identity(path)
        problem = self._mismatch(path)
        if problem:
            raise _Broken(problem)
        try:
            state = self.load(path)
        except Exception as exc:  # whatever the bytes make torch raise, the file is unusable
            raise _Broken(_load_failure(exc)) from exc
        if not isinstance(state, dict):
            raise _Broken(f"holds a {type(state).__name__}, not a checkpoint's dict")
        if identity:
            self._loadable.add(identity)
        return state

    def _problem(self, path: Path) -> str | None:
        """Why the checkpoint cannot be used, or None; loads it unless this process already did."""
        if self._identity(path) in self._loadable:
            return None
        try:
            self._open(path)
        except _Broken as exc:
            return str(exc)
        return None

    def _set_aside(self, path: Path, reason: str) -> Skipped:
        """Renames a broken checkpoint out of the ckpt-*.pt names: never counted, never loaded."""
        aside = path.with_name(path.name + ".bad")
        try:
            os.replace(path, aside)
            self._marker(path).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not rename %s aside: %s", path, exc)
            return Skipped(path.name, reason)
        return Skipped(path.name, reason, aside.name)

    def resume_point(self) -> Found:
        """The newest checkpoint that loads, loaded; each broken one above it is set aside and named.

        Called by rank 0 alone, which then tells the others the path: every rank resumes from the
        same checkpoint whatever it would have seen itself."""
        found = Found()
        for _, path in self.complete():
            try:
                found.state = self._open(path)
            except _Broken as exc:
                found.skipped.append(self._set_aside(path, str(exc)))
                continue
            found.path = path
            break
        return found

    def latest(self) -> Path | None:
        """The newest checkpoint that is complete, intact and loads; broken ones are passed over
        (and left where they are: resume_point and prune set them aside)."""
        for _, path in self.complete():
            if self._problem(path) is None:
                return path
        return None

    def load(self, path: Path) -> dict:
        return torch.load(path, map_location="cpu", weights_only=True)

    def save(self, state: dict, step: int) -> Path:
        """Writes the checkpoint for ``step`` atomically, then prunes to the newest keep_last."""
        path = self.path_for(step)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            data = _serialize(state)
            _write_atomically(path, data)
            marker = {"step": step, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            _write_atomically(self._marker(path), json.dumps(marker).encode())
            identity = self._identity(path)
            if identity:
                self._loadable.add(identity)  # torch.save's own bytes, just written: they load
            self.prune(keep=path)
        except OSError as exc:
            self._discard(path)
            previous = self.latest()
            kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
            cause = "no space left on the device" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
            raise CheckpointError(f"checkpoint for step {step} not written to {self.dir}: {cause}; "
                                  f"{kept}; free space or fix the volume, then restart to resume") from exc
        return path

    def _discard(self, path: Path) -> None:
        for victim in (self._marker(path), path):
            try:
                victim.unlink(missing_ok=True)
            except OSError:
                pass

    def prune(self, keep: Path | None = None) -> None:
        """Keeps the newest keep_last checkpoints that load; deletes older ones (marker first) and
        stale temporary files. A broken one met on the way is set aside and does not count, so a
        broken newest never costs the newest loadable one.

        ``keep`` (the checkpoint just written) always stays, whatever the step numbers around it.
        """
        kept = int(keep is not None)
        for _, path in self.complete():
            if path == keep:
                continue
            if kept >= self.keep_last:
                self._discard(path)  # beyond keep_last: deleted unexamined, broken or not
                continue
            problem = self._problem(path)
            if problem:
                skipped = self._set_aside(path, problem)
                log.warning("checkpoint %s is broken (%s); renamed to %s", skipped.name, problem, skipped.aside)
                continue
            kept += 1
        for entry in self.dir.iterdir():
            if entry.name.startswith(".ckpt-") and ".tmp-" in entry.name:
                pid = entry.name.rsplit("-", 1)[-1]
                if pid.isdigit() and not _alive(int(pid)):
                    entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: alive, owned by someone else
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def save_final_model(directory: str | os.PathLike, state_dict: dict) -> Path:
    """The trained weights alone, written once, atomically."""
    path = Path(directory) / "final_model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, _serialize(state_dict))
    return path
