"""One checkpoint file, latest.pt, replaced atomically at each epoch end."""

import os
from pathlib import Path

import torch


def save(ckpt_dir, state):
    path = Path(ckpt_dir) / "latest.pt"
    tmp = path.with_name(f".latest.pt.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(ckpt_dir):
    """The saved state, or None before the first epoch end. latest.pt is always complete: only a rename makes it."""
    path = Path(ckpt_dir) / "latest.pt"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
