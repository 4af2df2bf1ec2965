"""Datasets on the shared volume, loaded once as tensors, and the distributed sampler.

The data directory lives on the shared volume. One process per node (local rank 0) makes sure
the dataset is there, under a file lock so that nodes sharing the volume never download it
twice; the other processes wait. Datasets small enough for memory are then held as uint8
tensors on the training device and normalised there: no DataLoader, no per-sample transforms.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import DistributedSampler

from .dist import DistEnv, gather_objects

SYNTHETIC_DATA_SEED = 20240601  # the synthetic data is a fixed dataset, independent of --seed


class DatasetUnavailable(RuntimeError):
    """The dataset is neither in the data directory nor downloadable."""


@dataclass(frozen=True)
class DatasetSpec:
    channels: int
    size: int
    classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


SPECS = {
    "synthetic": DatasetSpec(1, 28, 10, (0.5,), (0.29,)),
    "mnist": DatasetSpec(1, 28, 10, (0.1307,), (0.3081,)),
    "fashion-mnist": DatasetSpec(1, 28, 10, (0.2860,), (0.3530,)),
    "cifar10": DatasetSpec(3, 32, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


@dataclass(frozen=True)
class TensorData:
    """A whole split as tensors: images uint8 (N, C, H, W), labels int64 (N,)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device) -> "TensorData":
        return TensorData(self.images.to(device), self.labels.to(device))


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive POSIX lock (lockf, which NFS honours) held for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


# --- the per-dataset "download" into the shared directory ---------------------------------------

def synthetic_test_size(train_size: int) -> int:
    return min(2048, max(256, train_size // 4))


def _synthetic_file(root: Path, size: int) -> Path:
    return root / "synthetic" / f"synthetic-{size}.pt"


def _make_synthetic(path: Path, size: int) -> None:
    """A learnable 10-class problem: each image is its class's fixed pattern blended with noise."""
    gen = torch.Generator().manual_seed(SYNTHETIC_DATA_SEED)
    total = size + synthetic_test_size(size)
    patterns = torch.rand(10, 1, 28, 28, generator=gen)
    labels = torch.randint(0, 10, (total,), generator=gen)
    noise = torch.rand(total, 1, 28, 28, generator=gen)
    images = ((0.5 * patterns[labels] + 0.5 * noise) * 255).round().to(torch.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"train_x": images[:size].clone(), "train_y": labels[:size].clone(),
                "test_x": images[size:].clone(), "test_y": labels[size:].clone()}, tmp)
    os.replace(tmp, path)


def _torchvision_class(name: str):
    from torchvision import datasets  # imported only for the datasets that need it

    return {"mnist": datasets.MNIST, "fashion-mnist": datasets.FashionMNIST, "cifar10": datasets.CIFAR10}[name]


def _ensure_present(name: str, root: Path, synthetic_size: int, download: bool) -> str:
    """Makes the dataset present under root; returns 'found' or 'fetched'. Local rank 0 only."""
    if name == "synthetic":
        path = _synthetic_file(root, synthetic_size)
        if path.exists():
            return "found"
        _make_synthetic(path, synthetic_size)
        return "fetched"
    cls = _torchvision_class(name)
    try:
        cls(str(root), train=True, download=False)
        cls(str(root), train=False, download=False)
        return "found"
    except RuntimeError:
        pass
    if not download:
        raise DatasetUnavailable(f"dataset {name} is not under {root} and --no-download is set; "
                                 f"copy it there or allow the download")
    try:
        cls(str(root), train=True, download=True)
        cls(str(root), train=False, download=True)
    except Exception as exc:  # urllib, HTTP and checksum errors all mean the same to the operator
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetUnavailable(
            f"dataset {name} is not under {root} and the download failed ({reason[:160]}); "
            f"copy the files there or give the node network access") from None
    return "fetched"


def prepare(env: DistEnv, name: str, data_dir: str, synthetic_size: int, download: bool) -> str:
    """Makes the dataset present once per node (under a lock shared by all nodes); all ranks wait.

    Returns what this node's local rank 0 did ('found', 'fetched') or '' on other ranks. Any
    rank's failure is raised on every rank, so that no process is left waiting in a collective.
    """
    root = Path(data_dir)
    outcome, error = "", None
    if env.is_local_main:
        try:
            with file_lock(root / f".{name}.lock"):
                outcome = _ensure_present(name, root, synthetic_size, download)
        except DatasetUnavailable as exc:
            error = str(exc)
        except OSError as exc:
            error = f"dataset {name}: cannot write under {root}: {exc.strerror or exc}"
    errors = [e for e in gather_objects(env, error) if e]
    if errors:
        raise DatasetUnavailable(errors[0])
    return outcome


def load(name: str, data_dir: str, synthetic_size: int) -> tuple[TensorData, TensorData]:
    """Reads an already-present dataset into (train, test) tensors on the CPU."""
    root = Path(data_dir)
    if name == "synthetic":
        blob = torch.load(_synthetic_file(root, synthetic_size), weights_only=True)
        return (TensorData(blob["train_x"], blob["train_y"]), TensorData(blob["test_x"], blob["test_y"]))
    cls = _torchvision_class(name)
    return tuple(_as_tensors(cls(str(root), train=train, download=False)) for train in (True, False))


def _as_tensors(ds) -> TensorData:
    images = torch.as_tensor(ds.data)
    if images.dim() == 3:  # MNIST-style (N, H, W)
        images = images.unsqueeze(1)
    else:  # CIFAR-style (N, H, W, C)
        images = images.permute(0, 3, 1, 2)
    labels = torch.as_tensor(ds.targets, dtype=torch.int64)
    return TensorData(images.contiguous(), labels)


# --- batches --------------------------------------------------------------------------------------

def train_sampler(env: DistEnv, n: int, seed: int) -> DistributedSampler:
    """torch's DistributedSampler over indices; the caller sets the epoch before each pass.

    drop_last: the tail that does not divide among the ranks waits for another epoch's shuffle,
    so no sample is seen twice in one epoch.
    """
    return DistributedSampler(range(n), num_replicas=env.world_size, rank=env.rank, shuffle=True,
                              seed=seed, drop_last=True)


def epoch_batches(sampler: DistributedSampler, epoch: int, batch_size: int, grad_accum: int,
                  device: torch.device) -> list[torch.Tensor]:
    """This rank's index batches for one epoch: whole micro-batches, a multiple of grad_accum of them."""
    sampler.set_epoch(epoch)
    indices = torch.tensor(list(iter(sampler)), dtype=torch.int64)
    per_step = batch_size * grad_accum
    usable = (len(indices) // per_step) * per_step
    return list(indices[:usable].to(device).split(batch_size))


def eval_shard(env: DistEnv, n: int, device: torch.device) -> torch.Tensor:
    """This rank's share of the test set: every index exactly once across ranks, no padding."""
    return torch.arange(env.rank, n, env.world_size, device=device)


class Normalizer:
    """uint8 images -> normalised float tensors, on the device."""

    def __init__(self, spec: DatasetSpec, device: torch.device) -> None:
        self.mean = torch.tensor(spec.mean, device=device).view(1, -1, 1, 1) * 255.0
        self.std = torch.tensor(spec.std, device=device).view(1, -1, 1, 1) * 255.0

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() - self.mean) / self.std


def augment(images: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop (zero padding) and horizontal flip per sample, batched on the images' device."""
    n, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    dev = images.device
    off_y = torch.randint(0, 2 * pad + 1, (n,), generator=generator, device=dev)
    off_x = torch.randint(0, 2 * pad + 1, (n,), generator=generator, device=dev)
    flip = torch.rand(n, generator=generator, device=dev) < 0.5
    cols = torch.arange(w, device=dev)
    cols = torch.where(flip[:, None], w - 1 - cols, cols) + off_x[:, None]
    rows = torch.arange(h, device=dev) + off_y[:, None]
    batch = torch.arange(n, device=dev)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()
