"""Which engine runs a job: the one whose ``serves`` takes the inventory (deploy/engines/engine.py)."""

from __future__ import annotations

from pathlib import Path

from ..inventory import load
from .engine import Engine, Invocation
from .engine_fleet import SshFleet
from .engine_slurm import Slurm
from .fleet import Fleet
from .slurmjob import SlurmJob

ENGINES: tuple[type[Engine], ...] = (Slurm, SshFleet)


def for_invocation(st: Invocation) -> Engine:
    """The engine of ``st.inv``'s job, bound to ``st``."""
    inv = st.inv
    (engine,) = [e for e in ENGINES if e.serves(inv)]
    return engine(st)


def api(hosts: str | Path = "hosts.yaml", **options) -> Fleet | SlurmJob:
    """The Python API of ``hosts``'s job: a :class:`Fleet` for an SSH fleet (``nodes:``), a
    :class:`SlurmJob` for Slurm (``slurm:``); ``options`` go to it (``say``, ``warn``, and the
    fleet's ``without``). Both have check, deploy, launch, states, wait, verdict, runs, doctor,
    logs and stop."""
    return (SlurmJob if load(hosts).slurm is not None else Fleet)(hosts, **options)


__all__ = ["ENGINES", "api", "for_invocation"]
