"""One exception tree for the deploy tool.

Library code raises these; only ``cli.py`` turns them into messages and exit codes:
``InputError`` -> exit 2 (the operator's input is wrong, nothing was touched),
``RuntimeFailure`` -> exit 1 (something on a node failed), ``JobStopped`` -> exit 3 (the job a
verb followed was ended by the operator's ``stop``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class DeployError(Exception):
    """Base class. ``lines()`` is what the operator sees, one line per problem."""

    exit_code = 1
    label = "error"
    """What the CLI's line starts with."""

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.node = node
        self.field = field
        self.hint = hint

    def lines(self) -> list[str]:
        where = ""
        if self.node:
            where += f"{self.node}: "
        if self.field:
            where += f"{self.field}: "
        text = f"{where}{self.message}"
        if self.hint:
            text += f" ({self.hint})"
        return [_one_line(text)]

    def __str__(self) -> str:
        return "; ".join(self.lines())


class InputError(DeployError):
    """The inventory or a command-line value is wrong. Nothing was contacted."""

    exit_code = 2


@dataclass(frozen=True)
class Issue:
    """One problem in hosts.yaml: where it is and what is expected."""

    file: str
    field: str
    line: int | None
    message: str

    def line_text(self) -> str:
        loc = f"{self.file}:{self.line}" if self.line else self.file
        field = self.field or "(document)"
        return _one_line(f"{loc}: {field}: {self.message}")


class InventoryError(InputError):
    """hosts.yaml is invalid; carries every issue found."""

    def __init__(self, issues: Sequence[Issue]) -> None:
        self.issues = tuple(issues)
        first = self.issues[0] if self.issues else None
        super().__init__(
            first.message if first else "invalid inventory",
            field=first.field if first else None,
            hint="fix hosts.yaml, then run `ddp-deploy validate`",
        )

    def lines(self) -> list[str]:
        return [i.line_text() for i in self.issues]


class RuntimeFailure(DeployError):
    """Something failed while talking to, or acting on, the nodes."""

    exit_code = 1


class StillRunning(RuntimeFailure):
    """The followed job had not ended when the wait's time was up: it runs on."""


class LostContact(RuntimeFailure):
    """Too many of the followed job's nodes stopped answering: what became of it is not known."""


class JobStopped(RuntimeFailure):
    """The followed job was ended by the operator's ``stop``: neither a success nor a failure of
    the job. A RuntimeFailure, so that a caller that treats any end but success alike still may."""

    exit_code = 3
    label = "stopped"


class RemoteFailure(RuntimeFailure):
    """A command failed on one or more nodes.

    ``results`` maps every node that was addressed to its outcome (any object with
    ``ok`` and ``summary()``), so the caller sees the hosts that worked too.
    """

    def __init__(self, what: str, results: Mapping[str, object], hint: str | None = None):
        self.what = what
        self.results = dict(results)
        failed = [n for n, r in self.results.items() if not getattr(r, "ok", False)]
        super().__init__(f"{what} failed on {', '.join(failed) or 'no node'}", hint=hint)
        self.failed = failed

    def lines(self) -> list[str]:
        out = []
        for node in self.failed:
            text = f"{node}: {self.what}: {self.results[node].summary()}"
            if self.hint:
                text += f" ({self.hint})"
            out.append(_one_line(text))
        return out or super().lines()


def _one_line(text: str) -> str:
    return " ".join(text.split())
