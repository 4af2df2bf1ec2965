"""hosts.yaml -> frozen, validated objects. The only package that knows the YAML layout.

``load(path)`` returns an :class:`Inventory` or raises :class:`InventoryError` whose
issues name the file, the field path (``nodes[2].address``), the YAML line and what is
expected. Nothing here opens a connection. Its parts: ``fields`` (what each kind of value may
be, and the bounds), ``schema`` (the sections), ``rules`` (what spans several fields) and
``loading`` (the bounded read and the error mapping).
"""

from __future__ import annotations

from ..errors import InventoryError
from .fields import MAX_NODES, MAX_PER_NODE, RESERVED_ENV, RESERVED_JOBS
from .loading import MAX_BYTES, field_path, load, loads
from .rules import cross_field_problems
from .schema import (
    TOOL_FLAGS,
    Code,
    Image,
    Inventory,
    Job,
    Mount,
    Node,
    Rendezvous,
    Secret,
    Slurm,
    SlurmContainer,
    SlurmLogin,
    Ssh,
    SshOverrides,
    Storage,
    Train,
)

__all__ = ["Code", "Image", "Inventory", "InventoryError", "Job", "MAX_BYTES", "MAX_NODES", "MAX_PER_NODE", "Mount",
           "Node", "RESERVED_ENV", "RESERVED_JOBS", "Rendezvous", "Secret", "Slurm", "SlurmContainer", "SlurmLogin",
           "Ssh", "SshOverrides", "Storage", "TOOL_FLAGS", "Train", "cross_field_problems", "field_path", "load",
           "loads"]
