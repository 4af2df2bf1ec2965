"""Builds the training objects from the config: model (DDP-wrapped), optimizer, scheduler, scaler."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import TrainConfig
from .data import DatasetSpec
from .dist import DistEnv
from .models import build_model
from .stages import Staged


@dataclass
class Built:
    model: nn.Module  # what the loop calls: DDP-wrapped when there are several processes
    raw_model: nn.Module  # the plain module: state dicts (the same names however it is split)
    local: nn.Module  # the module without DDP: evaluation; the stages when split, else raw_model
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler


def amp_dtype(cfg: TrainConfig) -> torch.dtype | None:
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp]


def build(cfg: TrainConfig, env: DistEnv, spec: DatasetSpec, steps_per_epoch: int) -> Built:
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    raw = build_model(cfg.model, spec.channels, spec.size, spec.classes, sync_bn=cfg.sync_bn and env.has_peers)
    raw = raw.to(env.device)
    local: nn.Module = raw
    if cfg.stages > 1:
        local = Staged(raw, env.devices, cfg.micro_batches)  # moves each stage's layers to its device
    model: nn.Module = local
    # A job of one process has no gradients to average: DDP would only cost its hooks and its
    # all-reduce of one (1.1 ms a step of a small model on one GPU, bench/bench_step_parts.py).
    if env.has_peers:
        # A module on several devices (the stages) is DDP's "multi-device module": no device_ids.
        ids = [env.device.index] if env.device.type == "cuda" and cfg.stages == 1 else None
        # DDP re-lays its gradient buckets after a process's first step, and with more than two
        # ranks gloo's sum order follows an element's place in its bucket: a resumed process
        # would round its first step differently. Without find_unused_parameters the re-layout
        # happens; with it, buckets keep their first layout for good, so a CPU run resumed from
        # a checkpoint ends bit-identical. (NCCL sums are not bitwise reproducible anyway.)
        model = DDP(local, device_ids=ids, find_unused_parameters=env.backend == "gloo")
    optimizer = _optimizer(cfg, raw)
    scheduler = _scheduler(cfg, optimizer, steps_per_epoch)
    scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16")
    return Built(model, raw, local, optimizer, scheduler, scaler)


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    steps = steps_per_epoch * cfg.epochs
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def _scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    """Per-optimizer-step LR factor: linear warm-up, then constant, cosine or step decay."""
    total = max(total_steps(cfg, steps_per_epoch), 1)
    warmup = cfg.warmup_steps
    decay_every = max(cfg.step_size_epochs * steps_per_epoch, 1)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.scheduler == "cosine":
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if cfg.scheduler == "step":
            return cfg.gamma ** (step // decay_every)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
