"""The programs that run on the nodes, as files: shell (``*.sh`` run by ``sh -c``, ``*.bash`` by
``bash -c``) and Python (``*.py``, by the node's interpreter with ``-c``). Each is passed whole as the
``-c`` argument, with its parameters as positional arguments after it, so no value of an inventory
or of a job is ever spliced into a program's text. tests/test_node_programs.py runs ``shellcheck``
on every shell file (CI installs it)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent


@cache
def node_program(name: str) -> str:
    """The text of the program ``name`` (a file in this folder)."""
    return (HERE / name).read_text()
