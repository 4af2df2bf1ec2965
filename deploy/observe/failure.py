"""The first failure of a failed job, from the nodes' logs: which node and rank failed first, its
exit code, and the program's first error line, instead of the last lines of a long log.

torchrun ends a failed run with a summary whose "Root Cause (first observed failure)" block names
the rank, exit code and time of the first worker that failed on that node; the earliest of those
across nodes is the job's first failure, except that a Root Cause whose own words are a broken
connection gives way to a rank of its summary that raised an error of its own (that rank's end
broke the connection; it took longer to end). The program's own words come from the log before that
summary: the first ``... error: ...`` line (argparse, the trainer's refusals) or the last line of
the first traceback (the exception), whichever comes first, with torch's ``[rankN]: `` prefix
read and removed. Pure functions over text; ``cli`` fetches the logs.

A rank that returns early (exit 0, no teardown) while the others still train makes them fail
with a broken connection, and torchrun's summary then names one of *them*. torchrun lists every
worker that failed, the ones it killed itself too (exit -15), but never one that had exited 0:
a rank that printed lines on a node whose summary leaves it out, and printed no error, had ended
with 0 before the failure. A node whose every rank exited 0 prints no summary: its torchrun
waits for the other nodes at the exit barrier (5 minutes), then logs "Error waiting on exit
barrier. Elapsed: N seconds", which dates the ranks' end. When the first failure is a lost
connection, such a rank is the cause (:class:`LeftEarly`). tests/failure_logs holds what torch
prints in these cases.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import NamedTuple

from agent.contract import is_hint

from ..text import lines as log_lines, safe
from .view import split_rank

ROOT_CAUSE = "Root Cause (first observed failure):"
_FIELD = re.compile(r"^\s+(time|rank|exitcode)\s*:\s*(.*?)\s*$")
_ERROR_LINE = re.compile(r"(^|\s|:)error:\s+\S", re.IGNORECASE)
# torchrun's own lines, never the program's words: its elastic package and its logging's header
# ("W0523 06:51:16.655000 ...", glog style: level, month, day, time).
_TORCHRUN_LINE = re.compile(r"^(torch\.distributed\.elastic|ChildFailedError|[IWEF]\d{4} \d{2}:\d{2}:\d{2})")
# What a rank says when a peer went away: gloo ("Connection closed by peer", "Connection reset by
# peer", "Broken pipe" on a write), NCCL ("remote process exited or there was a network error",
# "Connection closed by remote peer"), the c10d store (reset, broken pipe).
_LOST_PEER = re.compile(r"connection (closed|reset)|closed by (remote )?peer|broken pipe|remote process exited",
                        re.IGNORECASE)
_BLOCK = re.compile(r"^\[\d+\]:\s*$")
# mp.spawn's and start_processes' error in the parent: no message of its own, the worker's
# traceback follows it, after "-- Process N terminated with the following error:".
_RAISED_IN_WORKER = re.compile(r"^(?:[\w.]+\.)?(ProcessRaisedException):?\s*$")
_WORKER_BLOCK = re.compile(r"^-- Process (\d+) terminated with the following error:")
_SUMMARY_RANK = re.compile(r"^\s+rank\s*:\s*(\d+)")
# The agent of a node whose workers all exited 0, when the other nodes never reach the barrier.
_EXIT_BARRIER = re.compile(r"^[IWEF]\d{4} (\d{2}):(\d{2}):(\d{2}(?:\.\d+)?) .*Error waiting on exit barrier\. "
                           r"Elapsed: (\d+(?:\.\d+)?) seconds")


@dataclass(frozen=True)
class Failure:
    node: str
    rank: int | None = None
    exit_code: str | None = None
    time: str | None = None
    says: str | None = None
    """The program's first error line, if one was found."""
    explained: str | None = dataclasses.field(default=None, kw_only=True)
    """What the node's launcher said of that failure: a write through a file of the code, which
    is a link to the read-only snapshot (agent/snapshot_hint.py), the path where it is known."""

    def describe(self) -> str:
        """One line for the operator's terminal: the node, rank and exit code, and what the
        program said, its control characters escaped (deploy/text.py)."""
        who = self.node + (f" rank {self.rank}" if self.rank is not None else "")
        code = f" (exit {self.exit_code})" if self.exit_code is not None else ""
        return safe(f"{who} failed first{code}" + (f": {self.says}" if self.says else "")
                    + (f"; {self.explained}" if self.explained else ""))


@dataclass(frozen=True)
class LeftEarly(Failure):
    """A rank that exited 0 while the others still trained: ``node``/``rank`` are that rank,
    ``time`` when the others' first failure was seen (it left before), ``says`` what the first of
    them (``lost_by``) said on losing the connection."""

    lost_by: str = ""
    """The node and rank that failed first, e.g. ``node1 rank 0``."""
    left_at: str | None = None
    """When the rank exited (HH:MM:SS by its node's clock), where its torchrun's log dates it."""

    def describe(self) -> str:
        who = f"rank {self.rank} on {self.node}"
        when = f" at {self.left_at}" if self.left_at else f" before {self.time}" if self.time else ""
        return safe(f"{who} exited 0{when} while the others still trained; the others then lost their "
                    f"connection to it ({self.lost_by}: {self.says})")


def _summary(log: str) -> tuple[dict[str, str] | None, list[dict[str, str]]]:
    """torchrun's failure summary in ``log``: the fields (time, rank, exitcode) of its Root Cause
    block, or None, and of every block it lists, the Root Cause's included."""
    lines = log_lines(log)
    start = next((i for i, line in enumerate(lines) if "ChildFailedError" in line or ROOT_CAUSE in line), None)
    blocks: list[dict[str, str]] = []
    cause, in_cause = None, False
    for line in lines[start:] if start is not None else []:
        text = split_rank(line)[1]
        if ROOT_CAUSE in text:
            in_cause = True
        elif _BLOCK.match(text):
            if cause is not None:
                break  # a later summary's
            blocks.append({})
            if in_cause:
                cause = blocks[-1]
        elif blocks and (m := _FIELD.match(text)):
            blocks[-1].setdefault(m[1], m[2])
    return cause, blocks


class Said(NamedTuple):
    """A program's first error line in a log, and the rank whose prefix it carried, if any."""

    text: str | None
    rank: int | None


def program_error(log: str, only: int | None = None) -> Said:
    """The program's first error line in ``log`` (before torchrun's failure summary), and the
    rank whose prefix it carried, if any; ``only``: of that rank's lines alone."""
    in_traceback, traceback_rank = False, None
    raised: tuple[str, str | None] | None = None  # a ProcessRaisedException's name, and its worker's number
    for raw in log_lines(log):
        if ROOT_CAUSE in raw or "ChildFailedError" in raw:
            break
        rank, line = split_rank(raw)
        if only is not None and rank != only:
            continue
        if raised is not None and rank == traceback_rank and (m := _WORKER_BLOCK.match(line)):
            raised = (raised[0], m[1])
            continue
        if line.startswith("Traceback (most recent call last)"):
            in_traceback, traceback_rank = True, rank
            continue
        if in_traceback:
            # torchrun's agent and the other ranks write to the same log meanwhile: neither ends this traceback
            interleaved = _TORCHRUN_LINE.match(line) or (traceback_rank is not None and rank != traceback_rank)
            if (line.strip() and not interleaved and not line.startswith((" ", "\t"))
                    and not line.startswith("The above exception")):
                if raised is None and (m := _RAISED_IN_WORKER.match(line.strip())):
                    raised, in_traceback = (m[1], None), False  # the cause is the worker's traceback below
                    continue
                if raised is not None:
                    return Said(f"{raised[0]}: process {raised[1] or '?'}: {line.strip()}", rank)
                return Said(line.strip(), rank)
            continue
        if _ERROR_LINE.search(line) and not _TORCHRUN_LINE.match(line):
            return Said(line.strip(), rank)
    if raised is not None:  # its worker's traceback is not in the log
        return raised[0] + ":", traceback_rank
    return Said(None, None)


def _barrier_start(line: str) -> str | None:
    """HH:MM:SS when the agent entered the exit barrier (its workers' end), from its timeout line."""
    m = _EXIT_BARRIER.match(line)
    if not m:
        return None
    seconds = (int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3]) - float(m[4])) % 86400
    return f"{int(seconds // 3600):02d}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"


def _left_early(log: str) -> tuple[list[int], str | None]:
    """The ranks in ``log`` that had exited 0 while others failed, and when, if the log says:
    with torchrun's failure summary, the ranks that printed lines, no error, and that the summary
    (which lists every rank that failed or that torchrun stopped) leaves out; with its exit
    barrier's timeout, every rank that printed and no error. Neither: none (it may still run)."""
    lines = log_lines(log)
    start = next((i for i, line in enumerate(lines) if "ChildFailedError" in line or ROOT_CAUSE in line), None)
    left_at = None
    if start is None:
        left_at = next((t for line in lines if (t := _barrier_start(line))), None)
        if left_at is None:
            return [], None
    listed = set() if start is None else {
        int(m[1]) for line in lines[start:] if (m := _SUMMARY_RANK.match(split_rank(line)[1]))}
    printed: dict[int, bool] = {}  # rank -> printed an error
    for raw in lines:
        rank, line = split_rank(raw)
        if rank is None:
            continue
        erred = line.startswith("Traceback (most recent call last)") or bool(_ERROR_LINE.search(line))
        printed[rank] = printed.get(rank, False) or erred
    return sorted(r for r, erred in printed.items() if not erred and r not in listed), left_at


def _number(field: str | None) -> int | None:
    m = re.match(r"(-?\d+)", field or "")
    return int(m[1]) if m else None


def _lost(says: str | None) -> bool:
    return bool(says and _LOST_PEER.search(says))


def _first_of(log: str, cause: dict[str, str], listed: list[dict[str, str]]) -> tuple[dict[str, str], str | None]:
    """The summary block of the rank that failed first on this node, and that rank's own words.
    torchrun's Root Cause is the worker whose process it saw end first, and the others are the ones
    it saw end as it stopped them: a rank that raised can take longer to end (its traceback, its
    teardown) than the rank its end cut off takes to fail, more so on a loaded machine. So when the
    Root Cause's own words are a broken connection, a listed rank whose own error is something else
    failed before it."""
    def own(block: dict[str, str]) -> str | None:
        rank = _number(block.get("rank"))
        return None if rank is None else program_error(log, rank).text

    words = own(cause)
    if _lost(words):
        for block in listed:
            if block is not cause and (theirs := own(block)) and not _lost(theirs):
                return block, theirs
    return cause, words


def _explained(log: str) -> str | None:
    """The node's launcher's first word on a write through a file of the code (a line of its own,
    no rank's prefix: agent/snapshot_hint.py), if it said one."""
    for raw in log_lines(log):
        rank, line = split_rank(raw)
        if rank is None and is_hint(line):
            return line.strip()
    return None


def first_failure(logs: dict[str, str]) -> Failure | None:
    """The job's first failure across ``logs`` (node -> log text, in inventory order); when that
    failure is a lost connection and a rank had exited 0 before it, that rank (:class:`LeftEarly`)."""
    found: list[Failure] = []
    for node, log in logs.items():
        cause, listed = _summary(log)
        says, prefixed = program_error(log)
        if cause is None:
            if says:
                found.append(Failure(node, prefixed, None, None, says))
            continue
        block, own = _first_of(log, cause, listed)
        failed = _number(block.get("rank"))
        if failed is None:
            failed = prefixed
            own = program_error(log, failed).text if failed is not None else None
        if own or (prefixed is not None and failed is not None and prefixed != failed and _lost(says)):
            # its own words; without them, another rank's broken connection is what the failed
            # rank's end did to it, not its words
            says = own
        code = _number(block.get("exitcode"))
        found.append(Failure(node, failed, None if code is None else str(code), block.get("time"), says))
    if not found:
        return None
    timed = [f for f in found if f.time]
    # torchrun dates a failure to the second: of nodes that failed in the same one, a broken
    # connection is not the first
    first = min(timed, key=lambda f: (f.time, _lost(f.says))) if timed else found[0]
    explained = _explained(logs[first.node])
    if explained:
        first = dataclasses.replace(first, explained=explained)
    if _lost(first.says):
        for node, log in logs.items():
            left, left_at = _left_early(log)
            if left:
                lost_by = first.node + (f" rank {first.rank}" if first.rank is not None else "")
                return LeftEarly(node, left[0], "0", first.time, first.says, lost_by, left_at)
    return first
