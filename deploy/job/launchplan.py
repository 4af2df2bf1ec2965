"""What ``launch`` does on each node, as data: the plan ``launch --dry-run`` prints and ``launch`` runs.

It is built from the inventory, the code snapshot (train.code), what the preflight found on each
node (its NIC and InfiniBand: not known before the checks, so a dry run names them as found at
launch) and the run's id (``RUN_ID`` until ``launch`` makes one). It holds no secret's value: the
names, and where each comes from; the values reach each start command on its stdin.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..inventory import Inventory
from ..nodes.transport import command_line
from ..text import size
from . import codesync, lock, runs, secretenv
from .payload import payload
from .plan import DRY_RUN, LaunchSpec, launch_plan
from .runtime import NodeFacts, runtime


@dataclass(frozen=True)
class CodePlan:
    """train.code: the snapshot every node runs, named by its content."""

    root: str
    files: int
    size: int
    snapshot: str
    store: str


@dataclass(frozen=True)
class NodePlan:
    spec: LaunchSpec
    notes: tuple[str, ...] = ()
    """What only the launch finds on the node (its NIC where hosts.yaml names none, InfiniBand, a
    kept probe answer)."""


@dataclass(frozen=True)
class LaunchPlan:
    job: str
    run: str
    program: str
    code: CodePlan | None
    secrets: tuple[tuple[str, str], ...]
    """(name, where its value comes from)."""
    locks: str
    runs: str
    keep_runs: int
    nodes: tuple[NodePlan, ...]

    def commands(self) -> dict[str, tuple[str, ...]]:
        """Each node's start command: what ``launch`` runs there."""
        return {n.spec.node: n.spec.argv for n in self.nodes}

    def __str__(self) -> str:
        """The plan as ``launch --dry-run`` prints it: what every node shares (``[all]``), then each
        node's command as its shell receives it, and what only the launch will find there."""
        out = [f"[all] {line}" for line in self.lines()]
        for n in self.nodes:
            out += [f"[{n.spec.node}] {line}" for line in command_line(n.spec.argv).split("\n")]
            out += [f"[{n.spec.node}] {note}" for note in n.notes]
        return "\n".join(out)

    def lines(self) -> list[str]:
        """What every node shares."""
        out = [f"program: {self.program}"]
        if self.code is not None:
            c = self.code
            out.append(f"code: {c.root} ({c.files} files, {size(c.size)}) as snapshot {c.snapshot} in {c.store}; "
                       "each node gets the files its store lacks")
        out += [f"secret {name}={secretenv.MASK} (from {where}), on the start command's stdin"
                for name, where in self.secrets]
        out.append(f"{self.locks}, held until the job has started")
        out.append("the preflight checks of `ddp-deploy check` first; any failure starts nothing")
        run = "a new run id (RUN_ID below)" if self.run == DRY_RUN else f"run {self.run}"
        out.append(f"{run}; its record, logs and exit codes kept in {self.runs}/{self.run}, the newest "
                   f"{self.keep_runs} runs (job.keep_runs)")
        return out


def dry_run(inv: Inventory) -> LaunchPlan:
    """What ``launch`` would run, before any check (``launch --dry-run``): every secret must be
    there (an InputError naming the one that is not), none is read into the plan."""
    secretenv.resolve(inv)
    return make(inv, codesync.snapshot_of(inv))


def make(inv: Inventory, snap: codesync.Snapshot | None, *, facts: dict[str, NodeFacts] | None = None,
         run: str = DRY_RUN) -> LaunchPlan:
    """The plan for ``inv``: ``facts`` what the preflight found on each node (None: a dry run, before
    any check), ``run`` the run's id."""
    code = codesync.code_dir(inv, snap)
    specs = launch_plan(inv, facts, code, run)
    nodes = []
    for s in specs:
        node = inv.node(s.node)
        notes = []
        if facts is None:
            if node.interface is None:
                notes.append(f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME: the interface holding {node.address}, "
                             "detected at launch")
            notes += runtime(inv).dry_run_notes(node)
        nodes.append(NodePlan(s, tuple(notes)))
    return LaunchPlan(
        job=inv.job.name, run=run, program=payload(inv).describe(),
        code=None if snap is None else CodePlan(str(snap.root), len(snap.files), snap.size, snap.id,
                                                codesync.store_dir(inv)),
        secrets=tuple((name, secretenv.source(inv, name)) for name in inv.train.secrets),
        locks=lock.describe(inv, "launch"), runs=runs.runs_dir(inv), keep_runs=inv.job.keep_runs,
        nodes=tuple(nodes))
