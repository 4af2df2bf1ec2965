"""The job's logs, every node's merged, each line with its node and rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...errors import RemoteFailure
from ...inventory import Inventory
from ...job import plan, runs
from ...nodes.remote import Remote
from ...observe import view
from .common import Say, quiet
from .kept import kept_run


@dataclass(frozen=True)
class LogLine:
    """One line of a node's log: the rank that wrote it (None: the launcher's own) and its text as
    the job wrote it, secrets masked (show it with :func:`deploy.text.safe`)."""

    node: str
    rank: int | None
    text: str


def log_reads(inv: Inventory, remote: Remote, *, run_id: str | None = None, nodes: tuple[str, ...] = (),
              tail: int | None = None, follow: bool = False, redact: Callable[[str], str] = str,
              warn: Say = quiet) -> dict[str, tuple[str, ...]]:
    """The command that reads each node's log, of the running job or of the kept run ``run_id``,
    for ``nodes`` (default: all); a node that ran that run but is not in hosts.yaml now is named
    through ``warn``."""
    inv.check_names("--node", set(nodes))
    chosen = [n for n in inv.nodes if not nodes or n.name in nodes]
    if run_id is None:
        return {n.name: plan.logs_argv(inv, n, tail=tail, follow=follow) for n in chosen}
    run = kept_run(inv, remote, run_id, redact, "logs --run").run
    gone = [n for n in run.nodes if n not in {m.name for m in inv.nodes}]
    if gone:
        warn(f"note: {', '.join(gone)} ran in {run.id} but not in hosts.yaml now: their logs are in "
             f"{runs.runs_dir(inv)}/{run.id}")
    return {n.name: runs.log_argv(inv, run.id, n.name, tail=tail, follow=follow) for n in chosen if n.name in run.nodes}


def read_logs(remote: Remote, reads: dict[str, tuple[str, ...]], on_line: Callable[[LogLine], None], *,
              follow: bool = False, ranks: tuple[int, ...] = (), redact: Callable[[str], str] = str) -> None:
    """Each line of the logs ``reads`` names, to ``on_line`` as it comes (secrets masked; only the
    ``ranks`` asked for): every node at once when following, else node after node, since a log can
    outgrow this machine's memory. A RemoteFailure where a node's log could not be read."""
    shown: dict[str, str] = {}

    def emit(node: str, line: str) -> None:
        rank, text = view.split_rank(line)
        if not ranks or rank in ranks:
            on_line(LogLine(node, rank, redact(text)))
            shown[node] = line

    if follow:
        results = remote.stream(reads, emit)
    else:
        results = {}
        for n, argv in reads.items():
            results.update(remote.stream({n: argv}, emit))
    if not all(r.ok for r in results.values()):
        raise RemoteFailure("logs", view.said_once(results, shown), hint="no run on that node yet, or unreachable")
