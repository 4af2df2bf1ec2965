"""The operator's image cache: saved images (``docker save`` output, one file per image ID) and
the small identity record of each (how the containerd image store names it), bounded in count
and size.

After each deploy that used it, the cache keeps the saved image just shipped and then the most
recently used others while there are fewer than :data:`KEEP_CACHED` and their sizes fit in
``DDP_DEPLOY_IMAGE_CACHE_GB``; the image just shipped is kept even when it alone is over the bound
(the next deploy of it, or of a code-only change, reads it), and the report says so. Every
eviction is reported in deploy's output (:func:`report`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import RuntimeFailure
from .oci import Identity

CACHE_ENV = "DDP_DEPLOY_IMAGE_CACHE"
"""Directory for the saved image files (default ~/.cache/ddp-deploy/images)."""
BOUND_ENV = "DDP_DEPLOY_IMAGE_CACHE_GB"
"""Size bound of the saved images, in GB (10^9 bytes)."""
DEFAULT_BOUND_GB = 40.0
"""Two CUDA PyTorch images of 8-20 GB: the one shipped now and the one before it."""
KEEP_CACHED = 2
"""Saved images kept in the cache: the one just shipped and the most recently used other one."""
KEEP_IDENTITIES = 64
STALE_TEMP_SECONDS = 3600

_evicted: list[tuple[str, int]] = []
_lock = threading.Lock()


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ddp-deploy" / "images")


def cache_path(image_id: str, name: str) -> Path:
    """The saved image: its ID and the name it was saved under (the name is in the tar too)."""
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return cache_dir() / f"{image_id.removeprefix('sha256:')}.{tag}.tar"


def bound() -> int:
    """The size bound in bytes; a value that is not a number of GB is refused."""
    raw = os.environ.get(BOUND_ENV, "").strip()
    try:
        gb = float(raw) if raw else DEFAULT_BOUND_GB
    except ValueError:
        gb = -1.0
    if not gb >= 0:
        raise RuntimeFailure(f"{BOUND_ENV}={raw!r} is not a size in GB", hint=f"e.g. {BOUND_ENV}=40, or unset it")
    return int(gb * 1e9)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def clean_cache(keep: Path) -> None:
    """Keep ``keep`` and the most recently used other saved images that fit the bounds; drop the
    rest and stale temporary files. What was dropped is remembered for :func:`report`."""
    limit = bound()
    d = keep.parent
    try:
        others = sorted((p for p in d.glob("*.tar") if p != keep), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return
    used, kept = _size(keep), 1
    for p in others:
        size = _size(p)
        if kept < KEEP_CACHED and used + size <= limit:
            used, kept = used + size, kept + 1
            continue
        try:
            p.unlink()
        except OSError:
            continue
        with _lock:
            _evicted.append((p.name, size))
    try:
        for p in d.glob("*.tmp"):
            if time.time() - p.stat().st_mtime > STALE_TEMP_SECONDS:
                p.unlink(missing_ok=True)
        records = sorted(_identities().glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for p in records[KEEP_IDENTITIES:]:
            p.unlink(missing_ok=True)
    except OSError:
        pass


@dataclass(frozen=True)
class Report:
    directory: Path
    used: int
    bound: int
    images: int
    evicted: tuple[tuple[str, int], ...]

    def line(self) -> str:
        text = (f"image cache: {self.used / 1e9:.1f} GB in {self.images} saved image{'s' * (self.images != 1)} "
                f"of {self.bound / 1e9:g} GB ({BOUND_ENV}) in {self.directory}")
        if self.used > self.bound:
            text += "; over the bound with the image just shipped alone, which is kept for the next deploy"
        if self.evicted:
            text += "; evicted " + ", ".join(f"{_label(n)} ({s / 1e9:.1f} GB)" for n, s in self.evicted)
        return text


def _label(file_name: str) -> str:
    """``<image hex>.<name>.tar`` -> ``name sha256:<12 hex>``."""
    hexid, _, rest = file_name.partition(".")
    return f"{rest.removesuffix('.tar')} sha256:{hexid[:12]}"


def report() -> Report:
    """The cache now, and what was evicted since the last report (in this process)."""
    d = cache_dir()
    tars = list(d.glob("*.tar")) if d.is_dir() else []
    with _lock:
        evicted = tuple(_evicted)
        _evicted.clear()
    return Report(d, sum(_size(p) for p in tars), bound(), len(tars), evicted)


# ------------------------------------------------------------------ identity records


def _identities() -> Path:
    return cache_dir() / "identities"


def remember(ident: Identity) -> None:
    """Keep which config a manifest digest binds (a containerd store's name for the image), for as
    long as a deploy or launch may meet it (the saved file itself may be evicted). Any way that
    gives a node the image under a manifest of its own (a registry's) records it here too."""
    d = _identities()
    path = d / f"{ident.manifest.removeprefix('sha256:')}.json"
    try:
        d.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temp.write_text(json.dumps({"config": ident.config, "manifest": ident.manifest}))
        os.replace(temp, path)
    except OSError:
        pass


def config_of(manifest: str) -> str | None:
    """The config digest the manifest ``manifest`` binds, where this machine has met it."""
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", manifest):
        return None
    try:
        data = json.loads((_identities() / f"{manifest[7:]}.json").read_text())
        return str(data["config"]) if data.get("manifest") == manifest else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
