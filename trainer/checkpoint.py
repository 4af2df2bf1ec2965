"""The checkpoint manager: atomic save, a completion marker, keep-last-k, newest valid on load.

A checkpoint is ``ckpt-<step>.pt`` plus its marker ``ckpt-<step>.pt.ok`` (JSON: size and
sha256 of the file). The file is written to a temporary name, fsynced and renamed; only then is
the marker written the same way. A checkpoint counts only when its marker exists and the file
matches it, so a crash or a full disk at any point leaves the previous checkpoint the newest
valid one. Loading uses ``torch.load(weights_only=True)``: tensors and plain containers only.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one is untouched."""


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


class CheckpointManager:
    def __init__(self, directory: str | os.PathLike, keep_last: int = 3) -> None:
        self.dir = Path(directory)
        self.keep_last = keep_last

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

    def verify(self, path: Path) -> bool:
        try:
            marker = json.loads(self._marker(path).read_text())
            if path.stat().st_size != marker["size"]:
                return False
            return _sha256(path) == marker["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def latest(self) -> Path | None:
        """The newest checkpoint that is complete and intact; damaged ones are skipped, never loaded."""
        for step, path in self.complete():
            if self.verify(path):
                return path
            log.warning("skipping checkpoint %s: incomplete or damaged (size or sha256 mismatch)", path)
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
        """Deletes complete checkpoints beyond keep_last (marker first) and stale temporary files.

        ``keep`` (the checkpoint just written) always stays, whatever the step numbers around it.
        """
        others = [path for _, path in self.complete() if path != keep]
        for path in others[self.keep_last - (keep is not None):]:
            self._discard(path)
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
