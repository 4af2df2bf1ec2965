"""A synthetic regression dataset, the same for a given seed everywhere, cached in the shared data directory."""

import os
from pathlib import Path

import torch
import torch.distributed as dist


def generate(samples, features, seed):
    """x ~ N(0, 1); y is a smooth nonlinear function of x plus a little noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    w = torch.randn(features, generator=gen) / features ** 0.5
    y = 2 * torch.sin(x @ w) + 0.5 * x[:, 0] * x[:, 1] + 0.1 * torch.randn(samples, generator=gen)
    return {"x": x, "y": y.unsqueeze(1)}


def load(data_dir, samples, features, seed, rank):
    """Rank 0 writes the cache file if it is missing; after a barrier every rank reads it."""
    path = Path(data_dir) / f"regress-{samples}x{features}-seed{seed}.pt"
    if rank == 0 and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(generate(samples, features, seed), tmp)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return torch.load(path, map_location="cpu", weights_only=True)
