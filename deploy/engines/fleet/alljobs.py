"""Every job running on the fleet's nodes, of any user, from what each node's kernel says.

Each launcher of a job on a node answers on a listening abstract socket (agent/holds.py) for as
long as it runs: the node's kernel gives its pid, uid and start; the job, run, user and GPUs are
what it tells of itself, and so is its state (what its ranks' heartbeats say: starting, running,
stalled, ending) and their newest step. No central record: a job is listed exactly while its
launcher lives, and a node that does not answer is named as such, never as one without jobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from agent.contract import STATES

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
    state: str = "not told"  # STATES, "unknown" (its launcher could not read it), "not told"
    step: int | None = None


@dataclass(frozen=True)
class FleetJob:
    """One job (its name, run and uid) across the nodes it runs on."""

    job: str
    run: str
    user: str
    uid: int
    since: float
    nodes: dict[str, tuple[int, ...]]  # node -> the GPUs its launcher there holds
    states: dict[str, str]  # node -> what its launcher there tells of its ranks
    step: int | None  # the newest step a node's launcher tells

    @property
    def state(self) -> str:
        """The job's state in a word, naming the nodes where they differ (``stalled on node2``)."""
        kinds = sorted(set(self.states.values()), key=lambda k: (STATES + (k,)).index(k))
        if len(kinds) == 1:
            return kinds[0]
        order = sorted(kinds, key=lambda k: k != "stalled")  # a stall first: it is what to act on
        return "; ".join(f"{k} on {', '.join(n for n, s in self.states.items() if s == k)}" for k in order)


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
                               tuple(int(g) for g in gpus[:64]), _state(said.get("state")), _step(said.get("step"))))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def _state(told: object) -> str:
    if told in STATES:
        return told
    return "unknown" if isinstance(told, str) and told.startswith("unknown") else "not told"


def _step(told: object) -> int | None:
    return told if type(told) is int and 0 <= told <= 2 ** 53 else None


def gather(node_jobs: list[NodeJob]) -> list[FleetJob]:
    """The launchers of one job (name, run, uid) as one row, oldest job first."""
    grouped: dict[tuple[str, str, int], list[NodeJob]] = {}
    for j in node_jobs:
        grouped.setdefault((j.job, j.run, j.uid), []).append(j)
    rows = [FleetJob(job, run, group[0].user, uid, min(j.since for j in group), {j.node: j.gpus for j in group},
                     {j.node: j.state for j in group}, max((j.step for j in group if j.step is not None), default=None))
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
