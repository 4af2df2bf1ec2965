"""The checkpointer: what a checkpoint holds, when one is written, where a run resumes, and the
final model. trainer/checkpoint.py is its store (each file written atomically beside its marker,
the newest kept, a broken one set aside); this module is the policy over it, for all of a job's ranks.

- **What:** the model, optimizer, scheduler and scaler, the position (epoch, micro-batches of it
  consumed, optimizer steps), every rank's RNG streams, the world size and the config.
- **When** (:meth:`Checkpointer.due`): every ``--ckpt-every`` optimizer steps inside an epoch, at
  each epoch's end, and at the step of a planned stop. Saving is collective: every rank hands over
  its RNG state, rank 0 writes, and a failure stops every rank with the store's message.
- **From where** (:meth:`Checkpointer.resume`): rank 0 chooses the newest checkpoint that loads,
  naming each broken one it passes over, and every rank loads that very file. A checkpoint of
  another job (dataset, model, synthetic size) is refused; one of another batch layout (batch
  size, accumulation, seed) or world size replays its epoch from the start, and a resized job
  reseeds each rank deterministically, since its streams cannot be replayed.
- **The end** (:meth:`Checkpointer.finish`): the trained weights alone, ``final_model.pt``.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from agent.heartbeat import Heartbeat

from .build import Built
from .checkpoint import CheckpointError, CheckpointStore, Found, save_final_model
from .config import TrainConfig
from .dist import DistEnv, broadcast_object, gather_objects
from .metrics import MetricsWriter
from .startup import Startup

log = logging.getLogger(__name__)


@dataclass
class Position:
    """Where training stands: the epoch, the micro-batches of it already consumed, optimizer steps."""

    epoch: int = 0
    micro: int = 0
    global_step: int = 0


class ResumeMismatch(ValueError):
    """The checkpoint was written by a run whose model or data differ from this one."""


SAME_JOB = ("dataset", "model", "synthetic_size")
"""The config fields that make a checkpoint another job's."""
BATCH_LAYOUT = ("batch_size", "grad_accum", "seed")
"""The config fields that only lay the batches out otherwise: the epoch is replayed from its start."""


class Checkpointer:
    def __init__(self, cfg: TrainConfig, env: DistEnv, built: Built, metrics: MetricsWriter,
                 heartbeat: Heartbeat) -> None:
        self.cfg, self.env, self.built = cfg, env, built
        self.metrics, self.heartbeat = metrics, heartbeat
        self.store = CheckpointStore(cfg.ckpt_dir, cfg.keep_last)

    # --- when ---------------------------------------------------------------------------------

    def due(self, pos: Position, batches: int) -> bool:
        """Whether this optimizer step inside an epoch of ``batches`` micro-batches is checkpointed
        (an epoch's last step is, at the epoch's end, after its evaluation)."""
        every = self.cfg.ckpt_every
        return bool(every) and pos.global_step % every == 0 and pos.micro < batches

    def name(self, pos: Position) -> str:
        """The file name of the checkpoint at ``pos``."""
        return self.store.path_for(pos.global_step).name

    # --- what -----------------------------------------------------------------------------------

    def _rng_state(self) -> dict:
        env = self.env
        state = {"cpu": torch.get_rng_state()}
        if env.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(env.device)
            if env.stages > 1:  # the later stages' dropout draws from their own devices' generators
                state["cuda_stages"] = [torch.cuda.get_rng_state(d) for d in env.devices[1:]]
        return state

    def _state(self, pos: Position, rng: list) -> dict:
        b = self.built
        return {"model": b.raw_model.state_dict(), "optimizer": b.optimizer.state_dict(),
                "scheduler": b.scheduler.state_dict(), "scaler": b.scaler.state_dict(),
                "epoch": pos.epoch, "micro": pos.micro, "global_step": pos.global_step,
                "world_size": self.env.world_size, "rng": rng, "config": self.cfg.to_dict()}

    def save(self, pos: Position) -> None:
        """Collective: every rank hands over its RNG state; rank 0 writes; a failure stops every rank."""
        rng = gather_objects(self.env, self._rng_state())
        error = None
        if self.env.is_main:
            try:
                self.store.save(self._state(pos, rng), pos.global_step)
            except CheckpointError as exc:
                error = str(exc)
            except Exception as exc:  # any failure must reach every rank, or they wait in a collective
                error = f"checkpoint for step {pos.global_step} not written to {self.store.dir}: {exc}"
        error = broadcast_object(self.env, error)
        self.heartbeat.beat()
        if error:
            raise CheckpointError(error)

    # --- from where -----------------------------------------------------------------------------

    def resume(self, startup: Startup | None = None) -> Position:
        """The position this run starts from: the newest checkpoint that loads, restored on every
        rank (and kept in the metrics as ``resumed``), or step 0."""
        cfg, env = self.cfg, self.env
        if not cfg.resume and env.is_main and self.store.complete():
            raise ResumeMismatch(f"resume: --no-resume, but {cfg.ckpt_dir} holds checkpoints of an earlier run; "
                                 f"use an empty --ckpt-dir or remove them")
        found = self.store.resume_point() if cfg.resume and env.is_main else None
        if found:
            say_skipped(found)
        # Rank 0 chose (and set the broken ones aside): every rank loads that very file.
        latest = broadcast_object(env, str(found.path) if found and found.path else None)
        pos = Position()
        if latest:
            state = found.state if found else self.store.load(latest)
            pos = self.restore(state)
            log.info("resumed from %s (epoch %d, step %d)", latest, pos.epoch, pos.global_step)
        if startup is not None:
            startup.mark("resume")
        if latest:
            # from_world_size != world_size: the job was resized (a node lost or taken in), and
            # resumed at the start of the checkpoint's epoch (restore). ``startup``: the moments
            # this process reached (its launcher's start, its own, its imports, process group, data,
            # model, resume), so that a restart's time can be told apart (tests/FAULTS.md)
            self.metrics.write({"kind": "resumed", "checkpoint": Path(latest).name, "epoch": pos.epoch,
                                "step": pos.global_step, "micro": pos.micro, "world_size": env.world_size,
                                "from_world_size": state["world_size"],
                                **({"startup": startup.moments()} if startup is not None else {})})
        return pos

    def restore(self, state: dict) -> Position:
        """``state`` loaded into this rank's model, optimizer, scheduler, scaler and RNG streams."""
        cfg, env, b = self.cfg, self.env, self.built
        saved = state["config"]
        for name in SAME_JOB:
            if saved.get(name) != getattr(cfg, name):
                raise ResumeMismatch(f"{name}: the checkpoints in {cfg.ckpt_dir} were written with "
                                     f"{name}={saved.get(name)!r}, this run has {getattr(cfg, name)!r}; "
                                     f"use another --ckpt-dir or the same {name}")
        b.raw_model.load_state_dict(state["model"])
        b.optimizer.load_state_dict(state["optimizer"])
        b.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            b.scaler.load_state_dict(state["scaler"])
        rng = state["rng"]
        if state["world_size"] == env.world_size:
            mine = rng[env.rank]
            torch.set_rng_state(mine["cpu"])
            if "cuda" in mine and env.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda"], env.device)
                later = mine.get("cuda_stages", [])
                if len(later) == env.stages - 1:  # another split draws elsewhere: not replayable on GPUs
                    for state_, device in zip(later, env.devices[1:]):
                        torch.cuda.set_rng_state(state_, device)
        else:  # a resized job cannot replay each rank's stream; keep it deterministic all the same
            torch.manual_seed(cfg.seed + 7919 * env.rank + state["global_step"])
        pos = Position(state["epoch"], state["micro"], state["global_step"])
        relaid = [n for n in BATCH_LAYOUT if saved.get(n) != getattr(cfg, n)]
        if state["world_size"] != env.world_size:
            relaid.append("world size")
        if relaid and pos.micro:
            # The position inside the epoch counts micro-batches of the old layout: replay the epoch.
            log.warning("resuming at the start of epoch %d: %s changed since the checkpoint", pos.epoch,
                        ", ".join(relaid))
            pos.micro = 0
        return pos

    # --- the end --------------------------------------------------------------------------------

    def finish(self) -> None:
        """The trained weights alone (rank 0)."""
        if self.env.is_main:
            save_final_model(self.cfg.ckpt_dir, self.built.raw_model.state_dict())


def say_skipped(found: Found) -> None:
    """One line per broken checkpoint passed over, naming it, why, and where the job resumes."""
    then = f"resuming from {found.path.name}" if found.path else "no loadable checkpoint left: starting from step 0"
    for skipped in found.skipped:
        where = f" (renamed to {skipped.aside})" if skipped.aside else ""
        print(f"trainer: skipping {skipped.name}{where}: {skipped.reason}; {then}", file=sys.stderr, flush=True)
