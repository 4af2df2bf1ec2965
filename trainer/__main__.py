"""Entry point: parse the config, join the job, build, resume, train, tear down."""

from __future__ import annotations

import gc
import logging
import os
import sys

import torch

from agent import exits
from agent.contract import HEARTBEAT_DIR_ENV
from agent.heartbeat import Heartbeat

from . import data
from .build import build
from .checkpoint import CheckpointError
from .checkpointer import Checkpointer, ResumeMismatch
from .config import ConfigError, TrainConfig, load_config
from .dist import DistEnv, DistSetupError, setup, teardown
from .flight import FlightWatch
from .loop import Context, evaluate, steps_per_epoch, train
from .metrics import MetricsWriter
from .stages import SplitError
from .startup import Startup
from .stopping import STOPPED_EXIT, Stopped, StopSignal

log = logging.getLogger("trainer")


def make_context(cfg: TrainConfig, env: DistEnv, stop: StopSignal, startup: Startup | None = None) -> Context:
    """Makes the dataset present (once per node), loads it onto the device and builds everything."""
    startup = startup or Startup()
    fetched = data.prepare(env, cfg.dataset, cfg.data_dir, cfg.synthetic_size, cfg.download)
    if fetched:
        log.info("dataset %s %s under %s", cfg.dataset, fetched, cfg.data_dir)
    train_set, test_set = data.load(cfg.dataset, cfg.data_dir, cfg.synthetic_size)
    startup.mark("data")
    spec = data.SPECS[cfg.dataset]
    built = build(cfg, env, spec, steps_per_epoch(cfg, env, len(train_set)))
    if cfg.stages > 1 and env.is_local_main:
        log.info("model %s split: %s", cfg.model, built.local.extra_repr())
    startup.mark("model")
    metrics, heartbeat = MetricsWriter(env, cfg.ckpt_dir), Heartbeat.from_environ(rank=env.rank)
    return Context(
        cfg=cfg, env=env,
        built=built,
        train=train_set.to(env.device), test=test_set.to(env.device),
        normalize=data.Normalizer(spec, env.device),
        checkpointer=Checkpointer(cfg, env, built, metrics, heartbeat),
        metrics=metrics,
        stop=stop,
        heartbeat=heartbeat,
    )


def run(cfg: TrainConfig, env: DistEnv, stop: StopSignal | None = None, startup: Startup | None = None) -> dict:
    """One whole training job on an already set-up process; returns the final evaluation.
    With ``stop`` (signals installed), a planned stop raises :class:`Stopped` after its checkpoint.
    ``startup``: the moments this process reached so far; each node's first process prints where
    its time went before its first step (trainer/startup.py)."""
    stop = stop or StopSignal()
    stop.join(env, cfg.dist_timeout)
    startup = startup or Startup()
    ctx = make_context(cfg, env, stop, startup)
    watch = FlightWatch.start_for(os.environ.get(HEARTBEAT_DIR_ENV), env.local_rank, env.backend) if env.distributed else None
    try:
        return resume_and_train(ctx, startup)
    finally:
        if watch is not None:
            watch.close()
        ctx.heartbeat.close()
        ctx.metrics.close()  # the TensorBoard files' last events, after a stop or a failure too


def resume_and_train(ctx: Context, startup: Startup | None = None) -> dict:
    """Resumes from the newest checkpoint that loads (if any), trains, evaluates, saves the final model."""
    env = ctx.env
    torch_seed_per_rank(ctx.cfg, env)
    pos = ctx.checkpointer.resume(startup)
    if startup is not None and env.is_local_main:
        print(startup.line(), file=sys.stderr, flush=True)
    pos = train(ctx, pos)
    final = evaluate(ctx)
    ctx.checkpointer.finish()
    if env.is_main:
        ctx.metrics.write({"kind": "final", "epoch": pos.epoch, "step": pos.global_step,
                           "world_size": env.world_size, "backend": env.backend, **final})
    ctx.heartbeat.finish()  # nothing left to watch on this rank (agent/heartbeat/)
    return final


def require_cuda_for_sync_bn(cfg: TrainConfig, env: DistEnv) -> None:
    """SyncBatchNorm runs on CUDA tensors only: on CPU (gloo) it would fail at the first forward."""
    if cfg.sync_bn and env.device.type != "cuda":
        raise DistSetupError(f"sync_bn: SyncBatchNorm needs CUDA devices (NCCL), this process runs on "
                             f"{env.device.type}; drop --sync-bn on CPU nodes")


def torch_seed_per_rank(cfg: TrainConfig, env: DistEnv) -> None:
    """After the identical initialisation, each rank gets its own dropout stream."""
    torch.manual_seed(cfg.seed + 7919 * env.rank)


def main(argv: list[str] | None = None) -> int:
    startup = Startup()
    startup.mark("imports")
    # torch's modules live as long as the process: left out of the collector's full collections,
    # which would walk their objects (about 0.2 s of a core each, a pause of the step it falls in;
    # bench/RESULTS.md); what the run allocates from here on is collected as usual
    gc.freeze()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    stop = StopSignal().install()  # before joining: a stop during set-up still ends at a step boundary
    try:
        cfg = load_config(argv)
        env = setup(cfg.device, cfg.backend, cfg.dist_timeout, cfg.stages)
        startup.mark("process_group")
    except (ConfigError, DistSetupError) as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 2
    finished, code = False, 1  # code: what a teardown that hangs ends the process with (an error's 1)
    try:
        require_cuda_for_sync_bn(cfg, env)
        run(cfg, env, stop, startup)
        finished, code = True, 0
    except Stopped as exc:
        finished, code = True, STOPPED_EXIT  # every rank stopped at the same step: they leave together
        if env.is_local_main:
            print(f"trainer: {exc}", file=sys.stderr, flush=True)
        return STOPPED_EXIT
    except (ResumeMismatch, DistSetupError) as exc:
        code = 2
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 2
    except SplitError as exc:  # the same on every rank, before any collective: they leave together
        finished, code = True, 2
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 2
    except (data.DatasetUnavailable, CheckpointError) as exc:
        # Raised on every rank alike (each was agreed by a collective): they leave together, as a
        # finished run does, or a rank tearing down while its peer has gone aborts (SIGABRT), and
        # the job's first failure reads as that abort instead of this error.
        finished = True
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 1
    finally:
        teardown(env, finished, hung_exit=code)
    return 0


if __name__ == "__main__":
    exits.main(main)  # sys.exit(main()), without the interpreter's teardown of torch
