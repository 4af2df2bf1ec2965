"""Every job running on the fleet's nodes, of any user, from what each node's kernel says.

Each launcher of a job on a node answers on a listening abstract socket (trainer/holds.py) for as
long as it runs: the node's kernel gives its pid, uid and start; the job, run, user and GPUs are
what it tells of itself. No central record: a job is listed exactly while its launcher lives, and
a node that does not answer is named as such, never as one without jobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...inventory import Inventory
from ...job.runtime import runtime
from ...job.scripts import HOLDS
from ...nodes.remote import Remote

ANSWERS_READ = 256
"""Jobs read from one node's answer (a node flooded with claims is not read to its end)."""


@dataclass(frozen=True)
class NodeJob:
    """One job's launcher on one node."""

    node: str
    job: str
    run: str
    user: str
    uid: int
    pid: int
    since: float
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class FleetJob:
    """One job (its name, run and uid) across the nodes it runs on."""

    job: str
    run: str
    user: str
    uid: int
    since: float
    nodes: dict[str, tuple[int, ...]]  # node -> the GPUs its launcher there holds


@dataclass(frozen=True)
class FleetJobs:
    jobs: list[FleetJob]
    unanswered: dict[str, str]  # node -> why it could not say


def jobs_argv(inv: Inventory, node) -> tuple[str, ...]:
    return (runtime(inv).listener_python(), "-c", HOLDS, "jobs")


def parse(node: str, stdout: str) -> list[NodeJob]:
    """One node's answer (``holds.py jobs``: a JSON line per launcher); lines not understood are
    skipped."""
    out = []
    for line in stdout.splitlines()[:ANSWERS_READ]:
        try:
            h = json.loads(line)
            said = h.get("said") if isinstance(h.get("said"), dict) else {}
            gpus = said.get("gpus") if isinstance(said.get("gpus"), list) else []
            out.append(NodeJob(node, str(said.get("job", "?"))[:64], str(said.get("run", ""))[:64],
                               str(said.get("user", "?"))[:64], int(h["uid"]), int(h["pid"]), float(h["since"]),
                               tuple(int(g) for g in gpus[:64])))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def gather(node_jobs: list[NodeJob]) -> list[FleetJob]:
    """The launchers of one job (name, run, uid) as one row, oldest job first."""
    grouped: dict[tuple[str, str, int], list[NodeJob]] = {}
    for j in node_jobs:
        grouped.setdefault((j.job, j.run, j.uid), []).append(j)
    rows = [FleetJob(job, run, group[0].user, uid, min(j.since for j in group), {j.node: j.gpus for j in group})
            for (job, run, uid), group in grouped.items()]
    return sorted(rows, key=lambda r: (r.since, r.job))


def jobs(inv: Inventory, remote: Remote) -> FleetJobs:
    """Every job whose launcher runs on one of the inventory's nodes, whoever started it."""
    results = remote.run({n.name: jobs_argv(inv, n) for n in inv.nodes}, check=False, timeout=60)
    found, unanswered = [], {}
    for name, r in results.items():
        if r.ok:
            found += parse(name, r.stdout)
        else:
            unanswered[name] = r.summary()
    return FleetJobs(gather(found), unanswered)
