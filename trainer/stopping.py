"""A planned stop: SIGTERM (``ddp-deploy stop``, a scheduler, a spot reclaim) ends the job at a
step boundary, with a checkpoint, on every rank at the same step.

torchrun's agent passes the signal it receives on to its workers and gives them 30 s (its
shutdown timeout) before it kills them. A worker here only notes the signal; after each
optimizer step every rank asks whether any rank was signalled (one all-reduce of a single
integer on the CPU, in a gloo group of its own), so a signal that reached one node alone still
stops all of them at the same step: the loop then writes a checkpoint and every rank exits with
``STOPPED_EXIT``. Launched again, the job resumes from that step: no step is trained twice.

The question asked after step N is answered after step N+1 (an asynchronous all-reduce, waited
for one step later): its round trip, a blocking collective on every step before, overlaps the
next step instead (bench/bench_step_parts.py measured it at 0.45 ms a step on one GPU). Every
rank reads the same answer at the same step, so they still stop together, one step later. A
job of one process asks nobody.

A second signal ends the process at once (the default action is restored by the first).
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from .dist import DistEnv

STOPPED_EXIT = 75
"""The exit code of a process that stopped on a signal after its checkpoint (EX_TEMPFAIL: the
job is not finished; launch it again). torchrun's agent on a node that was not signalled
counts it as a failure and starts a new rendezvous round, as for any failure."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """Raised by the loop once the checkpoint of a planned stop is written."""

    def __init__(self, step: int, epoch: int, checkpoint: str, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} at step {step} (epoch {epoch}); checkpoint {checkpoint} "
                         "written: launch again to resume from it")
        self.step, self.epoch, self.checkpoint, self.signal_name = step, epoch, checkpoint, signal_name


class StopSignal:
    """Notes SIGTERM/SIGINT in this process; :meth:`requested` agrees on it across every rank."""

    def __init__(self) -> None:
        self.received: str | None = None
        """The signal's name (``SIGTERM``, or ``SIGTERM to another rank``), once one arrived."""
        self._signum = 0
        self._group = None
        self._asked = None  # (the all-reduce's work, its tensor): the question not yet read

    def install(self) -> "StopSignal":
        for sig in SIGNALS:
            signal.signal(sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._signum == 0:
            self._signum, self.received = signum, name
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
        # os.write: the logging module takes locks the interrupted code may hold.
        os.write(2, f"trainer: {name} received: stopping after this step, with a checkpoint\n".encode())

    def join(self, env: DistEnv, timeout_s: float | None = None) -> None:
        """Collective (every rank, once, after the process group exists): the group the flag
        travels in, gloo's, so that the question stays on the CPU, off the GPU's stream, and its
        collectives apart from the training's (whose sequence numbers doctor reads).

        ``timeout_s``: the job's ``--dist-timeout``, the training group's. A group made without one
        (the benchmarks') gets torch's default, 30 min: a question in flight when a peer goes silent
        then waits that long to be answered, at the next step or at :meth:`settle`."""
        if env.has_peers:
            self._group = (dist.new_group(backend="gloo") if timeout_s is None
                           else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))

    def requested(self, env: DistEnv) -> bool:
        """Collective: True on every rank, at the same call, once any rank has received a stop
        signal before the call before (see the module's docstring)."""
        if self._group is None:
            return self.received is not None
        signum = self._answer()
        if not signum:
            self._ask()  # read at the next call
        return self._agreed(signum)

    def requested_now(self, env: DistEnv) -> bool:
        """Collective: as :meth:`requested`, but asked and answered in this call (where a
        blocking round trip costs nothing, as after an evaluation)."""
        if self._group is None:
            return self.received is not None
        signum = self._answer()
        if not signum:
            self._ask()
            signum = self._answer()
        return self._agreed(signum)

    def settle(self) -> None:
        """Collective: waits for the question still in flight (before the group goes away)."""
        if self._group is not None:
            self._answer()

    def _ask(self) -> None:
        flag = torch.tensor([self._signum], dtype=torch.int32)
        self._asked = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)

    def _answer(self) -> int:
        if self._asked is None:
            return 0
        work, flag = self._asked
        self._asked = None
        work.wait()
        return int(flag.item())

    def _agreed(self, signum: int) -> bool:
        if not signum:
            return False
        if self.received is None:
            self.received = f"{signal.Signals(signum).name} to another rank"
        return True
