"""Every part of torch's private API that this package uses, and the one place that touches it.

torch gives no public way to do what the node's launcher and the flight recorder need:

- **how torchrun's agent starts and closes a worker**
  (``torch.distributed.elastic.multiprocessing.subprocess_handler.SubprocessHandler``: its
  ``_popen(args, env)``, ``close(death_sig)`` and the ``_stdout``/``_stderr`` files it opened):
  the relay pipes a worker's output (agent.launch) and the zygote forks it (agent.zygote);
- **the store of the c10d rendezvous** (``c10d_rendezvous_backend.TCPStore``, the name the
  backend makes it through): bound to the node's address (before torch 2.8);
- **the rendezvous's shutdown** (``DynamicRendezvousHandler.shutdown``): an elastic job's
  rendezvous kept open when an agent ends on an error;
- **the flight recorder's dump** (``torch._C._distributed_c10d``: ``_dump_fr_trace_json``, on torch
  2.5 ``_dump_nccl_trace_json``) and the variable of its size;
- **what DDP's constructor imports** (``torch._dynamo``), imported by the zygote before it forks.

A torch release that moves one of them is found by :func:`missing`, which
tests/test_torch_private.py runs on every tested torch, naming the part, instead of in a job.
"""

from __future__ import annotations

import inspect

HANDLER_MODULE = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"


def _handler():
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh

    return sh.SubprocessHandler


def wrap_worker_start(wrap) -> None:
    """torchrun's agent starts each worker through ``wrap(start)(handler, args, env)``, ``start``
    being what it used until now."""
    handler = _handler()
    handler._popen = wrap(handler._popen)


def wrap_worker_close(wrap) -> None:
    """torchrun's agent closes each worker through ``wrap(close)(handler, death_sig=None)``."""
    handler = _handler()
    handler.close = wrap(handler.close)


def worker_files(handler) -> tuple:
    """The files the agent opened for a worker's stdout and stderr (``--tee``, ``--redirects``),
    None where it opened none."""
    return handler._stdout, handler._stderr


def set_worker_files(handler, stdout, stderr) -> None:
    """What the worker about to start gets as its stdout and stderr (None: the agent's own)."""
    handler._stdout, handler._stderr = stdout, stderr


def wrap_rendezvous_store(wrap) -> None:
    """The c10d rendezvous backend makes its store through ``wrap(TCPStore)``."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend

    backend.TCPStore = wrap(backend.TCPStore)


def wrap_rendezvous_shutdown(wrap) -> None:
    """An agent shuts the rendezvous down through ``wrap(shutdown)(handler)``."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    DynamicRendezvousHandler.shutdown = wrap(DynamicRendezvousHandler.shutdown)


def c10d():
    """torch's C extension of torch.distributed (the flight recorder's dumps), None where absent."""
    try:
        from torch._C import _distributed_c10d
    except ImportError:
        return None
    return _distributed_c10d


def flight_dump(backend: str | None):
    """The flight recorder's JSON dump for ``backend`` (``nccl``, ``gloo``), None where this torch has
    none: newer torch's serves both, torch 2.5's NCCL alone."""
    found = c10d()
    if found is None or backend not in ("nccl", "gloo"):
        return None
    names = FLIGHT_DUMPS if backend == "nccl" else FLIGHT_DUMPS[:1]
    return next((getattr(found, n) for n in names if hasattr(found, n)), None)


DDP_IMPORTS = ("torch._dynamo",)
"""What DDP's constructor imports (about a second): the zygote imports it before it forks."""

FLIGHT_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
"""The flight recorder's JSON dump: its name on newer torch (any backend), and on torch 2.5 (NCCL)."""


def missing() -> list[str]:
    """The private parts above that this torch lacks, or has in another shape: [] where all are
    there as used."""
    out = []

    def params(fn, *names: str) -> None:
        try:
            got = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            out.append(f"{fn!r}: no signature")
            return
        if got[:len(names)] != list(names):
            out.append(f"{getattr(fn, '__qualname__', fn)}{tuple(got)}, not {names}")

    try:
        handler = _handler()
        params(handler._popen, "self", "args", "env")
        params(handler.close, "self", "death_sig")
        init = inspect.getsource(handler.__init__)
        out += [f"SubprocessHandler.{a} (set in __init__)" for a in ("self._stdout", "self._stderr", "self.proc")
                if a not in init]
    except (ImportError, AttributeError, OSError) as exc:
        out.append(f"{HANDLER_MODULE}.SubprocessHandler: {exc}")
    try:
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend

        if not callable(getattr(backend, "TCPStore", None)):
            out.append("c10d_rendezvous_backend.TCPStore")
    except ImportError as exc:
        out.append(f"c10d_rendezvous_backend: {exc}")
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

        params(DynamicRendezvousHandler.shutdown, "self")
    except (ImportError, AttributeError) as exc:
        out.append(f"DynamicRendezvousHandler.shutdown: {exc}")
    import importlib.util

    out += [f"{name} (a module)" for name in DDP_IMPORTS if importlib.util.find_spec(name) is None]
    found = c10d()
    if found is None or not any(hasattr(found, name) for name in FLIGHT_DUMPS):
        out.append(f"torch._C._distributed_c10d: none of {', '.join(FLIGHT_DUMPS)}")
    return out


if __name__ == "__main__":
    import json
    import sys

    import torch

    print(json.dumps({"torch": torch.__version__, "missing": missing()}))
    sys.exit(0)
