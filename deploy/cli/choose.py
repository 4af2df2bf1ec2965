"""Which engine runs a job for the CLI: the one whose ``serves`` takes the inventory (deploy/cli/engine.py)."""

from __future__ import annotations

from .engine import Engine, Invocation
from .engine_fleet import FleetCommands
from .engine_slurm import SlurmCommands

ENGINES: tuple[type[Engine], ...] = (SlurmCommands, FleetCommands)


def for_invocation(st: Invocation) -> Engine:
    """The engine of ``st.inv``'s job, bound to ``st``."""
    inv = st.inv
    (engine,) = [e for e in ENGINES if e.serves(inv)]
    return engine(st)


__all__ = ["ENGINES", "for_invocation"]
