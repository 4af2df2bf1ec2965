"""The first failure of a failed job, from the nodes' logs: which node and rank failed first, its
exit code, and the program's first error line, instead of the last lines of a long log.

torchrun ends a failed run with a summary whose "Root Cause (first observed failure)" block names
the rank, exit code and time of the first worker that failed on that node; the earliest of those
across nodes is the job's first failure. The program's own words come from the log before that
summary: the first ``... error: ...`` line (argparse, the trainer's refusals) or the last line of
the first traceback (the exception), whichever comes first, with torch's ``[rankN]: `` prefix
read and removed. Pure functions over text; ``cli`` fetches the logs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .view import split_rank

ROOT_CAUSE = "Root Cause (first observed failure):"
_FIELD = re.compile(r"^\s+(time|rank|exitcode)\s*:\s*(.*?)\s*$")
_ERROR_LINE = re.compile(r"(^|\s|:)error:\s+\S", re.IGNORECASE)
# torchrun's own lines, never the program's words: its elastic package and its logging's header
# ("W0523 06:51:16.655000 ...", glog style: level, month, day, time).
_TORCHRUN_LINE = re.compile(r"^(torch\.distributed\.elastic|ChildFailedError|[IWEF]\d{4} \d{2}:\d{2}:\d{2})")


@dataclass(frozen=True)
class Failure:
    node: str
    rank: int | None = None
    exit_code: str | None = None
    time: str | None = None
    says: str | None = None
    """The program's first error line, if one was found."""

    def describe(self) -> str:
        who = self.node + (f" rank {self.rank}" if self.rank is not None else "")
        code = f" (exit {self.exit_code})" if self.exit_code is not None else ""
        return f"{who} failed first{code}" + (f": {self.says}" if self.says else "")


def _root_cause(log: str) -> dict[str, str] | None:
    """The fields of the first Root Cause block in ``log``, or None."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if ROOT_CAUSE in line:
            fields = {}
            for follow in lines[i + 1:i + 10]:
                m = _FIELD.match(split_rank(follow)[1])
                if m:
                    fields[m[1]] = m[2]
            return fields
    return None


def program_error(log: str) -> tuple[str | None, int | None]:
    """The program's first error line in ``log`` (before torchrun's failure summary), and the
    rank whose prefix it carried, if any."""
    in_traceback = False
    for raw in log.splitlines():
        if ROOT_CAUSE in raw or "ChildFailedError" in raw:
            break
        rank, line = split_rank(raw)
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        if in_traceback:
            if line.strip() and not line.startswith((" ", "\t")) and not line.startswith("The above exception"):
                return line.strip(), rank
            continue
        if _ERROR_LINE.search(line) and not _TORCHRUN_LINE.match(line):
            return line.strip(), rank
    return None, None


def first_failure(logs: dict[str, str]) -> Failure | None:
    """The job's first failure across ``logs`` (node -> log text, in inventory order)."""
    found: list[Failure] = []
    for node, log in logs.items():
        cause = _root_cause(log)
        says, prefixed = program_error(log)
        if cause is None:
            if says:
                found.append(Failure(node, prefixed, None, None, says))
            continue
        rank = re.match(r"(-?\d+)", cause.get("rank", ""))
        code = re.match(r"(-?\d+)", cause.get("exitcode", ""))
        found.append(Failure(node, int(rank[1]) if rank else prefixed, code[1] if code else None,
                             cause.get("time"), says))
    if not found:
        return None
    timed = [f for f in found if f.time]
    return min(timed, key=lambda f: f.time) if timed else found[0]
