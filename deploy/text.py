"""Data from a job (its output, METRICS lines, every file on the shared volume) shown on the
operator's terminal as text, never as something the terminal or rich acts on.

A program can print, and a file on the volume can hold, escape sequences that clear the screen,
set the window title, plant a hyperlink or write the clipboard (OSC 52), a carriage return that
overwrites the start of a line, or a bidi override that shows text in another order than it
is. :func:`safe` writes each such character as its Python escape (``\\x1b``, ``\\r``,
``\\u202e``), so the operator sees what is there and the terminal acts on none of it (the CLI's
tables take each cell through it: deploy/cli/table.py). :func:`lines` cuts a job's text into
lines where a node's log does: at a newline alone.
"""

from __future__ import annotations

import re

# C0 controls but tab (ESC, BEL, CR, LF, backspace), DEL, C1 controls (a terminal reads U+009B as
# an ESC [), the Unicode marks, embeddings, overrides and isolates that reorder text (bidi),
# the line and paragraph separators, and lone surrogates (a JSON "\ud800": no encoding writes them).
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")


def _escaped(m: re.Match) -> str:
    return repr(m[0])[1:-1]


def safe(text: str) -> str:
    """``text`` with every character a terminal would act on, instead of show, written as its
    escape; printable text (any script, tabs) as it is. A backslash stays one: escaping twice
    changes nothing."""
    return _UNSAFE.sub(_escaped, text)


def lines(text: str) -> list[str]:
    """The lines of ``text`` from a job (a log, a node's output read from it), ended by ``\\n``
    alone, as ``grep``, ``tail`` and ``logs`` end them on the node. A program can print a
    ``\\r``, ``\\x0b``, ``\\x0c``, ``\\x1c``-``\\x1e``, ``\\x85``, ``\\u2028`` or ``\\u2029`` inside
    one of its lines, each of which ``str.splitlines`` takes for a line's end: here it is data (shown
    by :func:`safe` as its escape), and what follows it stays in that line, of that line's rank."""
    cut = text.split("\n")
    return cut[:-1] if cut[-1] == "" else cut


def size(n: int) -> str:
    """A byte count as people read it: ``12.3 MB``, ``4.5 kB``."""
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"
