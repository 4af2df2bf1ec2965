"""The train and evaluation loops. They receive built objects and build nothing themselves."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from agent.heartbeat import Heartbeat

from .build import Built, amp_dtype
from .checkpointer import Checkpointer, Position
from .config import TrainConfig
from .data import Normalizer, TensorData, augment, epoch_batches, eval_shard, train_sampler
from .dist import DistEnv, all_reduce_sum
from .metrics import IntervalTimer, MetricsWriter, RunningStats, peak_memory_mb
from .stopping import Stopped, StopSignal

log = logging.getLogger(__name__)


@dataclass
class Context:
    cfg: TrainConfig
    env: DistEnv
    built: Built
    train: TensorData
    test: TensorData
    normalize: Normalizer
    checkpointer: Checkpointer
    """What a checkpoint holds, when one is written and where the run resumes (trainer/checkpointer.py)."""
    metrics: MetricsWriter
    stop: StopSignal
    heartbeat: Heartbeat = field(default_factory=lambda: Heartbeat(None))
    """This rank's progress for `status` (agent/heartbeat/): every step, evaluation batch, checkpoint."""


# --- evaluation -----------------------------------------------------------------------------------

def _sync_buffers(ctx: Context) -> None:
    """BatchNorm statistics of rank 0 on every rank, so that all ranks evaluate the same model."""
    if ctx.env.distributed:
        for buffer in ctx.built.raw_model.buffers():
            here = buffer.to(ctx.env.device)  # a later stage's is sent from the process group's device
            dist.broadcast(here, src=0)
            if here is not buffer:
                buffer.copy_(here)


@torch.no_grad()
def evaluate(ctx: Context) -> dict:
    """Each rank scores a disjoint shard of the test set; the counts are summed over ranks."""
    _sync_buffers(ctx)
    model = ctx.built.local
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.env.device)
    dtype = amp_dtype(ctx.cfg)
    for idx in eval_shard(ctx.env, len(ctx.test), ctx.env.device).split(ctx.cfg.eval_batch_size):
        x = ctx.normalize(ctx.test.images[idx])
        y = ctx.test.labels[idx]
        with torch.autocast(ctx.env.device.type, dtype=dtype, enabled=dtype is not None):
            out = model(x)
        sums[0] += F.cross_entropy(out.float(), y, reduction="sum").double()
        sums[1] += (out.argmax(1) == y).sum().double()
        sums[2] += y.numel()
        ctx.heartbeat.beat()
    loss_sum, correct, count = all_reduce_sum(ctx.env, sums).tolist()
    return {"eval_loss": loss_sum / count, "eval_acc": correct / count, "eval_samples": int(count)}


# --- training -------------------------------------------------------------------------------------

def steps_per_epoch(cfg: TrainConfig, env: DistEnv, n_train: int) -> int:
    return train_sampler(env, n_train, cfg.seed).num_samples // (cfg.batch_size * cfg.grad_accum)


def train(ctx: Context, pos: Position) -> Position:
    """Trains from ``pos`` to the end (or max_steps); checkpoints and logs on the way."""
    cfg, env, b = ctx.cfg, ctx.env, ctx.built
    sampler = train_sampler(env, len(ctx.train), cfg.seed)
    dtype = amp_dtype(cfg)
    aug = cfg.augment and cfg.dataset == "cifar10"
    generator = torch.Generator(device=env.device) if aug else None
    stats, timer = RunningStats(env.device), IntervalTimer()
    done = lambda: cfg.max_steps and pos.global_step >= cfg.max_steps  # noqa: E731

    while pos.epoch < cfg.epochs and not done():
        batches = epoch_batches(sampler, pos.epoch, cfg.batch_size, cfg.grad_accum, env.device)
        b.model.train()
        for i in range(pos.micro, len(batches)):
            idx = batches[i]
            images = ctx.train.images[idx]
            if generator is not None:
                generator.manual_seed(cfg.seed * 1_000_003 + pos.epoch * 100_003 + i * 101 + env.rank)
                images = augment(images, generator)
            x, y = ctx.normalize(images), ctx.train.labels[idx]
            stepping = (i + 1) % cfg.grad_accum == 0
            sync = contextlib.nullcontext() if stepping or b.model is b.local else b.model.no_sync()
            with sync:
                with torch.autocast(env.device.type, dtype=dtype, enabled=dtype is not None):
                    out = b.model(x)
                    loss = F.cross_entropy(out, y)
                b.scaler.scale(loss / cfg.grad_accum).backward()
            stats.add(loss, (out.argmax(1) == y).sum(), y.numel())
            if not stepping:
                continue
            _optimizer_step(cfg, b)
            pos.global_step += 1
            pos.micro = i + 1
            timer.tick()
            ctx.heartbeat.beat(pos.global_step)
            if pos.global_step % cfg.log_every == 0:
                _log_train(ctx, pos, stats, timer)
            if done():
                break
            if ctx.stop.requested(env):
                stop_here(ctx, pos)
            if ctx.checkpointer.due(pos, len(batches)):
                ctx.checkpointer.save(pos)
        if pos.micro >= len(batches):
            pos.epoch, pos.micro = pos.epoch + 1, 0
        if timer.steps:
            _log_train(ctx, pos, stats, timer)
        ctx.metrics.write({"kind": "eval", "epoch": pos.epoch, "step": pos.global_step, **evaluate(ctx)})
        ctx.checkpointer.save(pos)
        if pos.epoch < cfg.epochs and not done() and ctx.stop.requested_now(env):
            raise _stopped(ctx, pos)  # the epoch's checkpoint is this position
        timer.reset()  # evaluation and the checkpoint are not training throughput
    ctx.stop.settle()
    return pos


def stop_here(ctx: Context, pos: Position) -> None:
    """A planned stop (trainer/stopping.py): the checkpoint of this very step, then out."""
    ctx.checkpointer.save(pos)
    raise _stopped(ctx, pos)


def _stopped(ctx: Context, pos: Position) -> Stopped:
    name = ctx.checkpointer.name(pos)
    ctx.heartbeat.finish()  # its checkpoint written, the rank only leaves: no stall to judge (agent/heartbeat/)
    ctx.metrics.write({"kind": "stopped", "epoch": pos.epoch, "step": pos.global_step, "micro": pos.micro,
                       "checkpoint": name, "signal": ctx.stop.received, "world_size": ctx.env.world_size})
    return Stopped(pos.global_step, pos.epoch, name, ctx.stop.received)


def _optimizer_step(cfg: TrainConfig, b: Built) -> None:
    if cfg.clip_grad:
        b.scaler.unscale_(b.optimizer)
        torch.nn.utils.clip_grad_norm_(b.raw_model.parameters(), cfg.clip_grad)
    b.scaler.step(b.optimizer)
    b.scaler.update()
    b.optimizer.zero_grad(set_to_none=True)
    b.scheduler.step()


def steps_left(ctx: Context, pos: Position) -> int:
    """Optimizer steps to the end of training at this world size (what `status` turns into an ETA)."""
    cfg = ctx.cfg
    per_epoch = steps_per_epoch(cfg, ctx.env, len(ctx.train))
    left = max(0, (cfg.epochs - pos.epoch) * per_epoch - pos.micro // cfg.grad_accum)
    return min(left, max(0, cfg.max_steps - pos.global_step)) if cfg.max_steps else left


def _log_train(ctx: Context, pos: Position, stats: RunningStats, timer: IntervalTimer) -> None:
    totals = stats.reduce(ctx.env)
    record = {"kind": "train", "epoch": pos.epoch, "epochs": ctx.cfg.epochs, "step": pos.global_step,
              "steps_left": steps_left(ctx, pos), "loss": totals["loss"], "acc": totals["acc"],
              "lr": ctx.built.optimizer.param_groups[0]["lr"],
              **timer.rates(totals["samples"]), "peak_mem_mb": peak_memory_mb(*ctx.env.devices)}
    ctx.metrics.write(record)
