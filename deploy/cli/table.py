"""The CLI's tables of data: rich reads ``[red]`` in a plain string as markup, so
:class:`DataTable` takes every str cell, and its title, as text made safe (deploy/text.py).
:class:`Screen` is the console the tables print on; where stdout is not a terminal (CI logs,
pipes, files) it prints them at their full width: nothing is cut.
"""

from __future__ import annotations

from rich.console import Console, ConsoleDimensions
from rich.table import Table
from rich.text import Text

from ..text import safe


def cell(value, style: str = "") -> Text:
    """A table cell of data: ``value`` as text (no markup), made safe."""
    return Text(safe(value if isinstance(value, str) else str(value)), style=style)


class DataTable(Table):
    """A rich Table whose title and str cells are data: shown as they are, never read as markup
    (a rich renderable, e.g. a styled Text, is taken as it is)."""

    def __init__(self, *columns, title=None, **options) -> None:
        super().__init__(*columns, title=cell(title) if isinstance(title, str) else title, **options)

    def add_row(self, *cells, **options) -> None:
        super().add_row(*(cell(c) if isinstance(c, str) else c for c in cells), **options)


PIPE_WIDTH = 1 << 20
"""The width tables print at where stdout is not a terminal: wider than any row, so rich neither
wraps nor ellipsizes a cell (it assumes 80 columns otherwise, or the width of a terminal on stderr)."""


class Screen(Console):
    """The console tables print on: a terminal's width on a terminal (or the ``width`` given),
    :data:`PIPE_WIDTH` elsewhere (a table is as wide as its widest row, never padded to it)."""

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        self._given_width = options.get("width") is not None

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        return size if self.is_terminal or self._given_width else ConsoleDimensions(PIPE_WIDTH, size.height)

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)
