"""Progress beats for any program a job runs, with no change to it.

Installed in each worker before its program runs (the ``sitecustomize`` beside this file for the
workers torchrun starts; agent/zygote.py for those the launcher's zygote forks), where the launcher
set ``DDP_HEARTBEAT_DIR``. It writes the rank's heartbeat file (agent/heartbeat/), ``STEP RANK
GAP_MS PHASE`` in place, ``-`` for what it does not know:

- ``start`` when the worker starts: the watch's clock for the rank starts there;
- ``init`` when the program calls ``init_process_group``;
- ``run`` when the process group has formed, and again after every call of a collective of
  ``torch.distributed`` that returned and every ``DistributedDataParallel`` forward (each step of
  DDP holds the previous step's gradient all-reduce). With NCCL a call returns once its work is
  queued on the GPU: a hung collective stops the beats when the rank next waits on the GPU;
- ``done`` after ``destroy_process_group`` (what the rank does alone then holds no peer up), and
  ``ended`` when the worker's interpreter exits (``left`` where its process group never formed).

A program that beats itself (the built-in trainer, or the one line of docs/failures.md) keeps its
own step: the hook writes that step back and the longer of the two longest intervals. Only the
worker torchrun started writes ``start``; a process it starts (a data loader's worker) beats only
where it runs collectives itself. One that forms a process group of its own (a worker that
``mp.spawn`` or ``start_processes`` started: train.spawn) becomes a rank of its own there: its
file is its place on the node, ``RANK - GROUP_RANK x DDP_PROCS`` (else the worker's), made anew
so that the worker that started it writes it no more, and it is named in ``workers/`` as the
zygote names the workers it forks (``PID RANK``), where the node's diagnosis finds it. Its output
shares the worker's pipes to the launcher, which labels every line with the worker's rank; so each
line it prints begins with :data:`LABEL` and its rank (``sed`` writes it), which the launcher puts
in its place (agent/launch.py).

Standalone on purpose: the standard library only, and nothing of the ``trainer`` package, which
the program may have one of its own of.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import time

HEARTBEAT_DIR_ENV = "DDP_HEARTBEAT_DIR"
WORKERS_DIR = "workers"
LABEL = "\x1eddp-rank "
"""Begins a line of a rank of its own: ``LABEL RANK LOCAL_RANK \\x1e`` then the line."""
OWNER_ENV = "DDP_PROGRESS_PID"
"""The worker's pid: a process it starts inherits it, and knows it is not the worker."""
COLLECTIVES = ("all_reduce", "barrier", "broadcast", "all_gather", "all_gather_into_tensor", "reduce", "gather",
               "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "monitored_barrier", "send", "recv", "all_gather_object", "gather_object", "broadcast_object_list",
               "scatter_object_list", "batch_isend_irecv")
MARK = "__ddp_deploy_progress__"
ENDS = ("done", "ended", "left")

_beats: "_Beats | None" = None


class _Beats:
    """The rank's heartbeat file, written in place (one ``pwrite``)."""

    def __init__(self, path: str, rank: str) -> None:
        self.path, self.rank = path, rank if rank.isdigit() else "-"
        self.fd: int | None = None
        self.gap: float | None = None
        self.last: float | None = None
        self.written = b""
        self.step = "-"
        """The step of the program's own last line, if it writes one: kept in every line after it."""
        self.phase = "start"
        self.formed = False
        self.pid = os.getpid()

    def progress(self) -> None:
        now = time.monotonic()
        if self.last is not None:
            self.gap = max(self.gap or 0.0, now - self.last)
        self.last = now
        self.formed = True
        self.put("run")

    def end(self) -> None:
        if os.getpid() == self.pid:  # not a child forked from the worker, which runs its atexit too
            self.put("ended" if self.formed else "left")

    def rank_of_its_own(self, rank: str) -> "_Beats":
        """This process's own beats, where it is not the worker torchrun started but formed a group
        of its own as ``rank`` (see the module's docstring)."""
        directory = os.path.dirname(self.path)
        local = os.path.basename(self.path)
        procs, node = os.environ.get("DDP_PROCS", ""), os.environ.get("GROUP_RANK", "")
        if rank.isdigit() and procs.isdigit() and node.isdigit() and 0 <= int(rank) - int(node) * int(procs) < int(procs):
            local = str(int(rank) - int(node) * int(procs))
        own = _Beats(os.path.join(directory, local), rank)
        own.step, own.formed = self.step, True
        try:  # a file of its own: the worker's open one (its parent's) is written no more
            os.unlink(own.path)
        except OSError:
            pass
        own.put("run", create=True)
        atexit.register(own.end)
        try:
            os.makedirs(os.path.join(directory, WORKERS_DIR), mode=0o700, exist_ok=True)
            named = os.path.join(directory, WORKERS_DIR, local)
            temp = f"{named}.{own.pid}"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{own.pid} {own.rank}\n")
            os.replace(temp, named)
        except OSError:
            pass
        _label_output(own.rank, local)
        return own


    def put(self, phase: str, create: bool = False) -> None:
        if self.phase in ENDS and phase not in ENDS:
            return
        self.phase = phase
        try:
            if self.fd is None:
                if not create and not os.path.exists(self.path):
                    return  # the launcher emptied the directory (a restart): no longer this rank's file
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if create else 0),
                                  0o644)
            there = os.pread(self.fd, 64, 0).split(b"\n")[0]
            if there and there != self.written:  # the program beats too: its step, the longer interval
                words = there.split()
                if words and words[0].isdigit():
                    self.step = words[0].decode()
                if len(words) > 2 and words[2].isdigit():
                    self.gap = max(self.gap or 0.0, int(words[2]) / 1000)
            ms = "-" if self.gap is None else str(min(int(self.gap * 1000), 10 ** 13 - 1))
            line = f"{self.step:>20} {self.rank:>10} {ms:>13} {phase:<6}".encode()
            os.pwrite(self.fd, line + b"\n", 0)
            self.written = line
        except OSError:
            pass  # never the program's end: the watch has the worker's start, its output


def _label_output(rank: str, local: str) -> None:
    """This process's stdout and stderr through ``sed``, which begins each line with the label of its
    rank. ``sed`` leaves the heartbeat directory out of its environment: no diagnosis takes it for a rank."""
    import subprocess

    if not (rank.isdigit() and local.isdigit()):
        return
    env = {k: v for k, v in os.environ.items() if k not in (HEARTBEAT_DIR_ENV, "LOCAL_RANK", "RANK")}
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            if stream is not None:
                stream.flush()
            sed = subprocess.Popen(["sed", "-u", f"s/^/{LABEL}{rank} {local}\x1e/"], stdin=subprocess.PIPE,
                                   stdout=fd, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        except (OSError, ValueError):
            return  # its lines keep the worker's label
        os.dup2(sed.stdin.fileno(), fd)
        sed.stdin.close()


def install(environ=os.environ) -> bool:
    """Beats for this process where ``DDP_HEARTBEAT_DIR`` is set; True when installed."""
    global _beats
    directory, local = environ.get(HEARTBEAT_DIR_ENV), environ.get("LOCAL_RANK", "")
    if not directory or not local.isdigit() or _beats is not None:
        return False
    owner = environ.get(OWNER_ENV, "")
    _beats = _Beats(os.path.join(directory, local), environ.get("RANK", ""))
    if owner in ("", str(os.getpid())):
        environ[OWNER_ENV] = str(os.getpid())
        _beats.put("start", create=True)
        atexit.register(_beats.end)
    else:
        _beats.phase = "run"
    if "torch.distributed" in sys.modules:
        _patch_distributed(sys.modules["torch.distributed"])
    if "torch.nn.parallel.distributed" in sys.modules:
        _patch_ddp(sys.modules["torch.nn.parallel.distributed"])
    sys.meta_path.insert(0, _Finder())
    return True


class _Finder:
    """Patches ``torch.distributed`` and DDP once the program imports them (nothing before)."""

    AFTER = {"torch.distributed": lambda m: _patch_distributed(m),
             "torch.nn.parallel.distributed": lambda m: _patch_ddp(m)}

    def find_spec(self, name, path=None, target=None):
        after = self.AFTER.get(name)
        if after is None:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                after(module)
            except Exception as exc:  # a torch whose names differ: the program runs without these beats
                sys.stderr.write(f"ddp_deploy_progress: warning: no progress beats from {name} ({exc!r})\n")

        spec.loader.exec_module = exec_module
        return spec


def _after(fn, phase_before: str | None = None):
    """``fn``, beating when a call of it returns."""
    if getattr(fn, MARK, False):
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        global _beats
        if phase_before is not None and _beats is not None and _is_worker():
            _beats.put(phase_before)
        out = fn(*args, **kwargs)
        if _beats is not None:
            if phase_before == "init":
                if _is_worker():
                    _beats.rank = _rank(_beats.rank)
                else:  # a process the worker started, a rank of its own
                    _beats = _beats.rank_of_its_own(_rank("-"))
            _beats.progress()
        return out
    setattr(call, MARK, True)
    return call


def _is_worker() -> bool:
    """This process is the worker torchrun started (not one it started: those inherit its pid here)."""
    return os.environ.get(OWNER_ENV) == str(os.getpid())


def _rank(known: str) -> str:
    try:
        return str(int(sys.modules["torch.distributed"].get_rank()))
    except Exception:  # no group after all: what the environment said
        return known


def _done(fn):
    if getattr(fn, MARK, False):
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        if _beats is not None:
            _beats.put("done")
        return out
    setattr(call, MARK, True)
    return call


def _patch_distributed(dist) -> None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    init = getattr(c10d, "init_process_group", None) or getattr(dist, "init_process_group", None)
    if init is not None:
        wrapped = _after(init, "init")
        _set(dist, c10d, "init_process_group", init, wrapped)
    destroy = getattr(c10d, "destroy_process_group", None)
    if destroy is not None:
        _set(dist, c10d, "destroy_process_group", destroy, _done(destroy))
    for name in COLLECTIVES:
        fn = getattr(c10d, name, None)
        if callable(fn):
            _set(dist, c10d, name, fn, _after(fn))


def _set(dist, c10d, name, original, wrapped) -> None:
    for module in (dist, c10d):
        if module is not None and getattr(module, name, None) is original:
            setattr(module, name, wrapped)


def _patch_ddp(module) -> None:
    cls = getattr(module, "DistributedDataParallel", None)
    if cls is not None and "forward" in vars(cls):
        cls.forward = _after(cls.forward)
