"""The distributed environment, read once: ranks, world size, device and backend.

Works under torchrun (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE are set) and as a plain
single process (no process group at all; every collective below is then a no-op).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from agent import exits
from agent.compat import binds_stores, listening_fd

from . import flight


class DistSetupError(RuntimeError):
    """The process cannot join the job as configured (e.g. more processes than GPUs)."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None when running as a single process without a process group
    stages: int = 1
    """Devices this process owns (--stages): its model runs as that many stages, the first on ``device``."""

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The process's devices, one per stage: on GPUs the ``stages`` that follow ``device``
        (local rank r owns cuda:r*stages onwards); on the CPU the stages share it."""
        if self.device.type != "cuda":
            return (self.device,) * self.stages
        return tuple(torch.device("cuda", self.device.index + s) for s in range(self.stages))

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def has_peers(self) -> bool:
        """In a process group with other processes: gradients to average, a stop to agree on."""
        return self.distributed and self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that writes shared files."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the process that does per-node work such as the dataset download."""
        return self.local_rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistSetupError(f"environment variable {name}={raw!r} is not an integer") from None


def pick_device(requested: str, local_rank: int, local_world_size: int, stages: int = 1) -> torch.device:
    """The process's (first) device: on GPUs, local rank r owns ``stages`` GPUs from cuda:r*stages."""
    want_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if visible == 0:
        raise DistSetupError("device cuda was requested but no GPU is visible; use --device cpu "
                             "or check the driver and CUDA_VISIBLE_DEVICES")
    if local_world_size * stages > visible:
        each = f" x {stages} stages" if stages > 1 else ""
        raise DistSetupError(
            f"{local_world_size} processes{each} on this node but only {visible} GPU(s) visible; "
            f"start torchrun with --nproc-per-node {visible // stages or 1} or fewer"
            + (", or fewer --stages" if stages > 1 else ""))
    return torch.device("cuda", local_rank * stages)


def pick_backend(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise DistSetupError("backend nccl needs a GPU device; use --backend gloo on CPUs")
    return requested


def setup(requested_device: str = "auto", requested_backend: str = "auto", timeout_s: int = 600,
          stages: int = 1) -> DistEnv:
    """Reads the launcher's environment once and joins the process group when launched by torchrun.

    ``timeout_s`` bounds every collective: a peer that vanished without closing its sockets
    (a node whose link went down) fails the job after that long instead of torch's 30 minutes.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
    device = pick_device(requested_device, local_rank, local_world_size, stages)
    launched = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    backend = pick_backend(requested_backend, device) if launched else None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend is not None and not dist.is_initialized():
        flight.enable(backend)  # doctor can then name the collective each rank is in
        timeout = timedelta(seconds=timeout_s)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # A PrefixStore around it: torch 2.5's c10d logger formats init_process_group's
            # arguments, and a TCPStore's repr raises there ("failed to format addr, unknown
            # family=0") when a reverse DNS lookup of its address fails, as on a node whose
            # resolver is unreachable (seen on the test cluster; 2.14 only warns). The wrapper's
            # repr is plain, on every version.
            store = dist.PrefixStore("workers", _bound_store(rank, world_size, timeout))
            kwargs.update(store=store, rank=rank, world_size=world_size)
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    return DistEnv(rank, local_rank, world_size, local_world_size, device, backend, stages)



def _bound_store(rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The workers' store at MASTER_ADDR:MASTER_PORT, hosted by rank 0 on that address alone.

    What ``env://`` would make, except that TCPStore listens on every address of the machine;
    handing it a socket already bound to MASTER_ADDR (the node's --local-addr) keeps it there.
    """
    addr, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 29500)
    listen_fd = None
    if rank == 0 and binds_stores():  # before torch 2.8: torch's own bind, every address (agent.compat)
        try:
            listen_fd = listening_fd(addr, port)
        except OSError as exc:
            raise DistSetupError(f"cannot listen on MASTER_ADDR {addr}:{port} ({exc.strerror or exc}): it must "
                                 "be an address of this node; give torchrun --local-addr") from None
    global _OWN_STORE
    _OWN_STORE = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout,
                               master_listen_fd=listen_fd)
    return _OWN_STORE


_OWN_STORE: dist.TCPStore | None = None
_LEFT_KEY = "trainer/left"


TEARDOWN_S = 120.0
"""How long leaving the process group may take before the process ends without it (rank 0 alone
waits up to 60 s there for the others to sign off)."""
BACKSTOP_S = 10.0
"""How much later the C library's timers end a process whose hang holds the GIL."""


def teardown(env: DistEnv, finished: bool = False, hung_exit: int = 1) -> None:
    """Leaves the process group; after a finished run, rank 0 (the store's host) leaves last.

    DDP's reducer holds the group (and gloo's pending work) in reference cycles; left to the
    interpreter's exit, destroying them there aborts the process now and then ("terminate
    called without an active exception", seen in CI). They are collected here, while Python is
    whole, after every rank of a finished run has reached this point.

    Where that hangs past ``TEARDOWN_S``, the process says so and ends with ``hung_exit``, what it
    was about to end with, rather than showing as running for ever while the job waits on it (a
    finished run's worker that never ends after its last barrier never signs off, and its node's
    agent never reaches the exit barrier). A hang inside torch that holds the GIL (torch 2.5's
    ``destroy_process_group`` under gloo) leaves no Python thread running: the C library's timers
    (:func:`exits.end_later`) end it ``BACKSTOP_S`` later, with the same code.
    """
    if env.distributed and dist.is_initialized():
        left = threading.Event()
        threading.Thread(target=_end_if_hung, args=(left, TEARDOWN_S, env.rank, hung_exit), name="teardown-watch",
                         daemon=True).start()
        # where the hang holds the GIL (torch 2.5's destroy_process_group under gloo), no Python
        # thread runs again: the C library's own threads end the process a little later instead
        disarm = exits.end_later(TEARDOWN_S + BACKSTOP_S, hung_exit, _hung_line(TEARDOWN_S + BACKSTOP_S, env.rank,
                                                                                  hung_exit, " (holding the interpreter)"))
        try:
            if finished:
                barrier(env)
            gc.collect()
            dist.destroy_process_group()
            if finished and _OWN_STORE is not None:
                _leave_store_host_last(env)
        finally:
            left.set()
            if disarm is not None:
                disarm()


def _hung_line(seconds: float, rank: int, code: int, how: str = "") -> str:
    return (f"trainer: rank {rank}: leaving the process group took over {seconds:g} s (hung in torch's "
            f"teardown{how}): this process ends without it, with exit {code}")


def _end_if_hung(left: threading.Event, seconds: float, rank: int, code: int) -> None:
    if left.wait(seconds):
        return
    print(_hung_line(seconds, rank, code), file=sys.stderr)
    exits.flush()
    exits.end(code)


def _leave_store_host_last(env: DistEnv, timeout_s: float = 60) -> None:
    """Rank 0 hosts the workers' store in its own process: it exits only after every other
    rank has signed off, so none of them loses the store while it still shuts down."""
    try:
        if not env.is_main:
            _OWN_STORE.add(_LEFT_KEY, 1)
            return
        deadline = time.monotonic() + timeout_s
        while _OWN_STORE.add(_LEFT_KEY, 0) < env.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError:  # a peer that already died cannot sign off; the job is ending anyway
        pass


def barrier(env: DistEnv) -> None:
    if env.distributed:
        if env.device.type == "cuda":
            dist.barrier(device_ids=[env.device.index])
        else:
            dist.barrier()


def all_reduce_sum(env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    """Sums a tensor over all ranks in place (one collective) and returns it."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_objects(env: DistEnv, obj: object) -> list:
    """Every rank's object, in rank order, on every rank."""
    if not env.distributed:
        return [obj]
    out: list = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(env: DistEnv, obj: object) -> object:
    """Rank 0's object on every rank."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
