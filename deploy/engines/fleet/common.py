"""What the fleet's verbs share: the code synced, the checks, the one image, a run's start and
its undoing, the running job's shape, and where the shared volume is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...checks import preflight
from ...errors import RuntimeFailure
from ...inventory import Inventory
from ...job import codesync, plan, record, runs, runtime, secretenv
from ...nodes.remote import Remote, Result
from ...text import size


Say = Callable[[str], None]


def quiet(text: str) -> None:
    """The default reporter: says nothing."""


def sync_code(inv, remote, snap, say: Say = quiet, nodes=None) -> runtime.CodeDir | None:
    """The code snapshot on every node (only the files their store lacks travel), reported per node."""
    if snap is None:
        return None
    say(f"code: {snap.root}: {len(snap.files)} files, {size(snap.size)}, snapshot {snap.id[:12]}")

    def report(node: str, sent: codesync.Sent) -> None:
        for said in sent.moved:  # a program wrote into its snapshot, or something was planted there
            say(f"{node}: warning: code snapshot {snap.id[:12]} was not your code; moved aside: {said}")
        if sent.present:
            say(f"{node}: code snapshot {snap.id[:12]} present")
        else:
            say(f"{node}: code sent {sent.files} file{'s' * (sent.files != 1)} ({size(sent.bytes)}), "
                       f"snapshot {snap.id[:12]} stored")

    codesync.sync(inv, remote, snap, on_node=report, nodes=nodes)
    return codesync.code_dir(inv, snap)


def check(inv, remote, say: Say = quiet, *, for_launch: bool = False) -> preflight.Preflight:
    """``check``'s procedure: a secret this shell cannot read fails here, not at launch; then the
    code synced, so that the program's import is checked where it will run, and the preflight on
    every node (``for_launch``: the image must be there already, as ``check --network`` needs)."""
    secretenv.resolve(inv)
    inv = inv.and_spares()  # a spare is checked as a node is
    code = sync_code(inv, remote, codesync.snapshot_of(inv), say)
    return preflight.run_checks(inv, remote, for_launch=for_launch, code=code)


def refuse_failed_checks(checks, doing: str) -> None:
    failed = [c for c in checks if not c.ok]
    if failed:
        raise RuntimeFailure(f"{doing}{len(failed)} check(s) failed: "
                             + " | ".join(f"{c.node} {c.name}: {c.detail}" for c in failed),
                             hint="see the table above; `ddp-deploy check` runs them alone")


def one_image(inv, remote) -> str | None:
    """The id of the image every node holds (None: the job runs in no image), as the config's
    digest on Docker's classic store and the containerd image store alike (image.comparable_id);
    refuses a launch across nodes whose images differ (one left behind by an earlier deploy)."""
    from ...images import image

    if runtime.runtime(inv).image_id_argv() is None:
        return None
    got = remote.run({n.name: image.identify_argv(inv) for n in inv.nodes}, check=False, timeout=60)
    said = {n: image.parse_survey(n, r.stdout) for n, r in got.items() if r.ok}
    ids = {n: i for n, h in said.items() if (i := image.comparable_id(h)) is not None}
    if len(set(ids.values())) > 1 or len(ids) < len(got):
        def holds(n: str) -> str:
            if n not in said:
                return got[n].summary()
            h = said[n]
            if n not in ids:
                return "no such image" if h.image_id is None else f"{h.image_id[:19]}, incomplete (containerd store)"
            return ids[n][:19] + (" (containerd store: a manifest no deploy from here made)"
                                  if h.store == image.CONTAINERD and ids[n] == h.image_id else "")
        raise RuntimeFailure(f"launch refused, nothing started: the nodes do not hold the same {inv.image.name} "
                             f"({', '.join(f'{n} {holds(n)}' for n in got)})",
                             hint="run `ddp-deploy deploy`: it ships the image to the nodes that lack it")
    return next(iter(ids.values()), None)


def start_run(inv, remote, run: str, kept: dict, say: Say = quiet, warn: Say = quiet) -> None:
    """The run's record on the shared volume, as the job's current one too; the oldest runs
    beyond job.keep_runs removed. Not fatal: the job runs without it, and says so."""
    first = readers(inv)[0].name
    done = remote.run({first: runs.start_argv(inv, run)}, stdin={first: record.encode(kept)}, check=False,
                      timeout=60)[first]
    if not done.ok:
        warn(f"{first}: the record of run {run} was not written in {runs.runs_dir(inv)}: {done.summary()}")
        return
    pruned = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("pruned ")]
    if pruned:
        say(f"removed the oldest run{'s' * (len(pruned) > 1)} ({', '.join(pruned)}): job.keep_runs is "
            f"{inv.job.keep_runs}")


def undo_start(inv, remote, nodes) -> list[str]:
    """Stops the job on ``nodes`` at once (a launch that did not start everywhere); the nodes it
    could not stop."""
    undo = remote.run({n: plan.stop_argv(inv, inv.node(n)) for n in nodes}, check=False, timeout=120)
    return [n for n, r in undo.items() if not r.ok]


def node_index(inv: Inventory, node: str) -> int:
    return [n.name for n in inv.nodes].index(node)


@dataclass(frozen=True)
class RunningJob:
    """The job running now, as its launch record says."""

    inv: Inventory
    """The inventory with the rendezvous where the running job has it."""
    record: str
    """The launch record's text."""
    nodes: list[str]
    """The nodes it was launched on."""
    run: str
    """Its run id (a joining node's output is kept with that run)."""


def running_job(inv: Inventory, remote: Remote, reader: str, node: str) -> RunningJob:
    """The job running now: its rendezvous node from its launch record, read on ``reader``."""
    where = record.path(inv)
    got = remote.run({reader: ("cat", where)}, check=False, timeout=60)[reader]
    found = record.decode(got.stdout) if got.ok else None
    if found is None or not isinstance(found.get("rendezvous"), dict):
        raise RuntimeFailure(f"join refused, nothing started: {reader} cannot read the running job's launch "
                             f"record {where} ({got.summary() if not got.ok else 'not one this version wrote'})",
                             hint="`ddp-deploy stop`, then `ddp-deploy launch` (it resumes from the newest checkpoint)")
    rdzv = found["rendezvous"].get("node")
    if rdzv == node or rdzv not in {n.name for n in inv.nodes}:
        raise RuntimeFailure(f"join refused, nothing started: the running job's rendezvous is on {rdzv!r} "
                             f"({where}), " + ("the node to join" if rdzv == node else "not a node of hosts.yaml now"),
                             hint="`ddp-deploy stop`, then `ddp-deploy launch`")
    at = inv.hosting_rendezvous_on(rdzv)
    now = {"endpoint": plan.endpoint(at), "nnodes": plan.nnodes(at)}
    then = {"endpoint": found["rendezvous"].get("endpoint"), "nnodes": found.get("nnodes")}
    if now != then:
        changed = "; ".join(f"{k} {then[k]} then, {now[k]} now" for k in now if now[k] != then[k])
        raise RuntimeFailure(f"join refused, nothing started: hosts.yaml changed since the launch ({changed})",
                             hint="undo the change, or `ddp-deploy stop` and `ddp-deploy launch` with it")
    run = found.get("run") if isinstance(found.get("run"), str) and runs.RUN_ID.fullmatch(found["run"]) else None
    return RunningJob(at, got.stdout, [n["name"] for n in found.get("nodes", []) if isinstance(n, dict) and "name" in n],
                      run or runs.new_id())


def without_interface(inv, facts) -> list[str]:
    """A warning for each node whose NIC neither the inventory names nor the preflight found."""
    return [f"{n.name}: no interface holds {n.address}; gloo/NCCL pick one from the hostname (set "
            "nodes[].interface if the job hangs)" for n in inv.nodes
            if n.interface is None and facts.get(n.name, plan.NodeFacts()).interface is None]


FAILURE_TAIL = 400  # log lines read per failed node: torchrun's summary ends the log


def readers(inv):
    """Where the tool reads and writes the shared volume: the nodes, or Slurm's login node."""
    return (inv.slurm.login,) if inv.slurm else inv.nodes


@dataclass(frozen=True)
class Answer:
    """What one node answered."""

    node: str
    result: Result


def on_any_node(inv, remote, argv, what: str) -> Answer:
    """``argv`` run on the first node that answers (the shared volume is the same on all): that
    node and its result; a failure naming each node tried."""
    tried = []
    for n in readers(inv):
        got = remote.run({n.name: argv}, check=False, timeout=60)[n.name]
        if got.ok:
            return Answer(n.name, got)
        tried.append(f"{n.name}: {got.summary()}")
        if got.connected:
            break
    raise RuntimeFailure(f"cannot read {what} ({'; '.join(tried)})", hint="`ddp-deploy check` names the cause")
