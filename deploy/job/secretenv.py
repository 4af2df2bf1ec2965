"""Secrets: environment variables whose values the operator's machine reads at launch.

hosts.yaml names where each value comes from (``train.secrets``: the operator's environment or
a file), never the value. The values travel to the nodes as ``NAME=VALUE`` lines on the start
command's stdin (scripts.SECRETS_FROM_STDIN), so no command line, ``--dry-run`` output or debug
log holds them; what the tool prints (logs, status, errors, the debug log) passes through
:class:`Redactor`, which shows each value as ``***``. On the node the launcher masks the job's
output the same way before it is written anywhere (agent.masking, SECRET_NAMES_ENV).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agent.contract import MASK, Mask

from ..errors import InputError

if TYPE_CHECKING:
    from ..inventory import Inventory

MIN_LENGTH = 6
"""Shorter values cannot be redacted from output without hiding ordinary text."""


def source(inv: Inventory, name: str) -> str:
    """Where a secret comes from, for messages and --dry-run: ``$VAR`` or the file's path."""
    s = inv.train.secrets[name]
    return f"${s.env}" if s.env is not None else str(_file(inv, s.file))


def _file(inv: Inventory, path: str) -> Path:
    return inv.base_dir / os.path.expanduser(path)


def resolve(inv: Inventory) -> dict[str, str]:
    """Every secret's value; InputError (exit 2, before any connection) naming the secret and its
    source when one is missing, unreadable, too short or not one line."""
    return {name: value(inv, name) for name in inv.train.secrets}


def value(inv: Inventory, name: str) -> str:
    s, field = inv.train.secrets[name], f"train.secrets.{name}"
    if s.env is not None:
        text = os.environ.get(s.env)
        if text is None:
            raise InputError(f"${s.env} is not set in this shell", field=field,
                             hint=f"export {s.env}=... before running ddp-deploy")
    else:
        path = _file(inv, s.file)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}", field=field) from None
        text = text[:-1] if text.endswith("\n") else text
    if any(c in text for c in "\n\r\0"):
        raise InputError(f"the value from {source(inv, name)} spans lines or holds NUL; a secret is one line",
                         field=field)
    if len(text) < MIN_LENGTH:
        raise InputError(f"the value from {source(inv, name)} has {len(text)} characters; secrets need at "
                         f"least {MIN_LENGTH}, to be told apart from ordinary output when redacted", field=field)
    return text


def stdin_lines(values: dict[str, str]) -> bytes:
    """What the start command reads from stdin (scripts.SECRETS_FROM_STDIN)."""
    return "".join(f"{k}={v}\n" for k, v in values.items()).encode()


class Redactor:
    """Shows every known secret value in a text as ``***``, in each spelling a program may print
    it (agent.contract.forms: as is, JSON / repr / ascii-escaped, percent-encoded, base64)."""

    def __init__(self, values: dict[str, str] | None = None) -> None:
        self._mask = Mask((values or {}).values())

    def __bool__(self) -> bool:
        return bool(self._mask)

    def __call__(self, text: str) -> str:
        return self._mask(text)

    def logging_filter(self) -> logging.Filter:
        redact = self

        class _Filter(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                record.msg = redact(record.getMessage())
                record.args = None
                return True

        return _Filter()


PARSED_WORDS = frozenset({"state"})
"""Fields that hold the tool's own reading of a node (running, exited(1)), never the job's text."""


def masked(value, redact: Callable[[str], str]):
    """``value`` parsed from a node's output (a NodeState, Failure, kept Run, SlurmState, or the
    dicts, lists and tuples in them) with ``redact`` applied to each string in it but PARSED_WORDS.
    Parse first, mask after: a secret equal to a word the parser reads (``running``, ``exited``,
    an exit time) then changes what is shown, never what is decided."""
    if isinstance(value, str):
        return redact(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: masked(getattr(value, f.name), redact)
                                             for f in dataclasses.fields(value)
                                             if f.init and f.name not in PARSED_WORDS})
    if isinstance(value, dict):
        return {k: masked(v, redact) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(masked(v, redact) for v in value)
    return value


def redactor_for(inv: Inventory) -> Redactor:
    """For verbs that do not send the values (logs, status): every value this shell can read; one
    it cannot read, it cannot print either."""
    values = {}
    for name in inv.train.secrets:
        try:
            values[name] = value(inv, name)
        except InputError:
            continue
    return Redactor(values)
