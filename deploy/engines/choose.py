"""Which Python API runs a job: a :class:`Fleet` for an SSH fleet, a :class:`SlurmJob` for Slurm."""

from __future__ import annotations

from pathlib import Path

from ..inventory import load
from .fleet import Fleet
from .slurmjob import SlurmJob


def api(hosts: str | Path = "hosts.yaml", **options) -> Fleet | SlurmJob:
    """The Python API of ``hosts``'s job: a :class:`Fleet` for an SSH fleet (``nodes:``), a
    :class:`SlurmJob` for Slurm (``slurm:``); ``options`` go to it (``say``, ``warn``, and the
    fleet's ``without``). Both have check, deploy, plan, launch (a :class:`~deploy.engines.handle.Run`),
    run, states, wait, verdict, runs, doctor, logs and stop, and keep their connections in ``with``."""
    return (SlurmJob if load(hosts).slurm is not None else Fleet)(hosts, **options)


__all__ = ["api"]
