"""The verbs that change the fleet: launch (all or nothing), stop, deploy, join, unlock."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from ...checks import preflight
from ...errors import InputError, RemoteFailure, RuntimeFailure
from ...images import prepare, ways
from ...images.build import QuietView
from ...inventory import Inventory
from ...job import codesync, launchplan, lock, phases, plan, record, runs, runtime, secretenv
from ...job.payload import payload
from ...nodes.remote import Remote
from .common import Say, node_index, one_image, quiet, refuse_failed_checks, running_job, start_run, sync_code, undo_start, without_interface
from .watch import end_watch, node_states


@dataclass(frozen=True)
class Started:
    """A launch that started the job on every node."""

    job: str
    run: str
    nodes: tuple[str, ...]
    procs: int
    program: str
    code: runtime.CodeDir | None
    phases: dict = field(default_factory=dict)
    """Where the launch's time went, phase by phase (deploy/job/phases.py)."""
    plan: launchplan.LaunchPlan | None = None
    """What it ran on each node: ``launch --dry-run``'s plan, with the run's id and what the checks found."""

    def describe(self) -> str:
        return (f"started {self.job} run {self.run} on {len(self.nodes)} nodes ({self.procs} processes): "
                f"{self.program}" + (f", code snapshot {self.code.snapshot[:12]}" if self.code else ""))


def launch(inv: Inventory, remote: Remote, *, hosts: str, redact: Callable[[str], str] = str, say: Say = quiet,
           warn: Say = quiet, failed_checks: Callable[[list], None] = lambda checks: None,
           wait_lock: float = 0.0, confirm: Callable[[], None] = lambda: None) -> Started:
    """Starts the job on every node, all or nothing: under the job's lock (a live holder waited for
    up to ``wait_lock`` seconds), the nodes' states (none
    unreachable, none running the job), the code synced, every check of ``check``, one image on
    every node, a new run with its record, then the start; a node that did not start stops the
    others. ``failed_checks`` sees the failed checks before the refusal; ``hosts`` names the
    inventory in the lock; ``confirm`` raises, just before the start, where the launch is no longer
    wanted (the watcher's, heal.py: the operator stopped the job meanwhile)."""
    secrets = secretenv.resolve(inv)
    snap = codesync.snapshot_of(inv)
    took = phases.Phases()
    with contextlib.ExitStack() as fleet:
        with took("lock"):
            held = fleet.enter_context(lock.held(inv, remote, "launch", hosts, warn=warn, wait_s=wait_lock))
        with took("states"):
            states = node_states(inv, remote, redact)
        unreachable = [f"{n} ({s.metrics})" for n, s in states.items() if s.state == "unreachable"]
        if unreachable:
            gone = ",".join(n for n, s in states.items() if s.state == "unreachable")
            raise RuntimeFailure(f"launch refused, nothing started: unreachable: {'; '.join(unreachable)}",
                                 hint=f"run `ddp-deploy check`; if lost for good, `ddp-deploy --without {gone} "
                                      "launch` runs the job on the others (hosts.yaml unchanged)")
        running = [n for n, s in states.items() if s.running]
        if running:
            raise RuntimeFailure(f"a previous run of {inv.job.name} is still running on {', '.join(running)}",
                                 hint="run `ddp-deploy stop` first; two runs never share a rendezvous")
        with took("code"):
            code = sync_code(inv, remote, snap, say)
        # Everything `check` proves (engine, torch and CUDA where the job runs, the program
        # importing there, GPUs, shared storage, the rendezvous port free and reachable: so no
        # other job's store can absorb this one) holds before anything starts.
        with took("checks"):
            pre = preflight.run_checks(inv, remote, for_launch=True, code=code)
        if pre.failed:
            failed_checks(pre.failed)
        refuse_failed_checks(pre.failed, "launch refused, nothing started: ")
        for line in without_interface(inv, pre.facts):
            warn(line)
        with took("image"):
            image_id = one_image(inv, remote)
        run = runs.new_id()
        planned = launchplan.make(inv, snap, facts=pre.facts, run=run)
        specs = [n.spec for n in planned.nodes]
        # Preparing took a while: an `unlock --force` meanwhile may have let another operator in,
        # whose run the cleanup below or a second start would break.
        held.confirm("launch")
        confirm()
        finished = {n: plan.stop_argv(inv, inv.node(n)) for n, s in states.items() if s.exists}
        if finished:  # a finished run's container or pid files; its checkpoints and kept logs stay
            with took("cleanup"):
                remote.run(finished, check=True, timeout=120)
        with took("record"):
            start_run(inv, remote, run, record.launch_record(inv, code, run, image_id, redact, took.data()), say, warn)
        stdin = {s.node: secretenv.stdin_lines(secrets) for s in specs} if secrets else None
        try:
            with took("start"):
                results = remote.run({s.node: s.argv for s in specs}, check=False, timeout=120, stdin=stdin)
        except KeyboardInterrupt:  # half-way: some nodes may run, none must be left running
            stuck = undo_start(inv, remote, [s.node for s in specs])
            warn("interrupted: " + (f"could NOT stop {', '.join(stuck)}: run `ddp-deploy stop`" if stuck
                                    else "stopped every node it had started"))
            raise
        if not all(r.ok for r in results.values()):
            started = [n for n, r in results.items() if r.ok]
            stuck = undo_start(inv, remote, list(results))
            hint = f"stopped the nodes that had started ({', '.join(started) or 'none'})"
            if stuck:
                hint = f"could NOT stop {', '.join(stuck)}: run `ddp-deploy stop` once they are reachable"
            raise RemoteFailure("launch", results, hint=hint)
    # the lock is released: the job has started, and following it only reads
    return Started(inv.job.name, run, tuple(s.node for s in specs), sum(n.nprocs for n in inv.nodes),
                   payload(inv).describe(), code, took.data(), planned)


def stop(inv: Inventory, remote: Remote, *, now: bool = False, say: Say = quiet) -> dict:
    """Ends the job on every reachable node (idempotent): SIGTERM and up to runtime.STOP_GRACE_S
    for its step and checkpoint, or ``now``: killed at once. Its watcher's watch first
    (heal.watch), so that nothing starts it again. Each node's Result, and each reachable spare's
    (one a ``--with`` put in the job, which this command may not have been given)."""
    by = runtime.operator()
    ended = end_watch(inv, remote, f"the job was stopped by {by} with `ddp-deploy stop`")
    if ended is not None:
        say(f"the watcher of {inv.job.name} ({ended.by}, pid {ended.pid}) ends: it starts nothing again")
    grace = 0 if now else runtime.STOP_GRACE_S
    every = inv.and_spares()
    got = remote.run({n.name: plan.stop_argv(every, n, grace) for n in every.nodes}, check=False, timeout=grace + 120)
    spares = {s.name for s in inv.spares}
    return {n: r for n, r in got.items() if n not in spares or r.connected}


Shipping = Callable[[str, str, int, int | None], None]  # node, stage, bytes done, bytes in all (None: unknown)


@contextlib.contextmanager
def no_progress():
    yield lambda node, stage, done, total: None


def deploy(inv: Inventory, remote: Remote, *, hosts: str, build: bool = False, say: Say = quiet, warn: Say = quiet,
           shipping: Callable[[], contextlib.AbstractContextManager[Shipping]] = no_progress,
           interrupted: Callable[[], None] = lambda: None, wait_lock: float = 0.0,
           build_view: QuietView | None = None) -> dict[str, str]:
    """Readies every node for a launch, under the locks of the job and of its image (a live holder
    waited for up to ``wait_lock`` seconds): the shared directories, then the image
    (built here with ``build``, shipped where a node's ID differs, each shipment's bytes reported to
    the function ``shipping()`` yields) or, on the host runtime, the interpreter checked. What each
    node has now, as a line. ``interrupted`` is called on a Ctrl-C while the lock is still held;
    ``build_view`` shows the build (none by default). The spares are made ready as the nodes are."""
    inv = inv.and_spares()
    steps = prepare.deployer(inv)
    with lock.held(inv, remote, "deploy", hosts, warn=warn, wait_s=wait_lock) as fleet_lock:
        def ship(image_id, held):
            # The build takes minutes: an `unlock --force` meanwhile may have let another operator in.
            fleet_lock.confirm("deploy", "no image was shipped")
            with shipping() as report:
                return ways.for_inventory(inv).ship(remote, image_id, held, report)

        try:
            return steps.run(remote, say, build=build, ship=ship, view=build_view)
        except KeyboardInterrupt:
            interrupted()
            raise


@dataclass(frozen=True)
class Joined:
    """A node started into the running job: the job's nodes that take it in at their next round."""

    node: str
    nodes: tuple[str, ...]
    rdzv: str
    endpoint: str
    run: str

    def describe(self) -> str:
        return (f"{self.node} started: the job's nodes ({', '.join(self.nodes)}) take it in at their next rendezvous "
                f"round ({self.rdzv}, {self.endpoint}); `ddp-deploy status` shows it training")


def joinable(inv: Inventory, node: str) -> None:
    """An InputError unless ``node`` is in hosts.yaml and the job is elastic (a node may join it)."""
    inv.check_names("join NODE", {node})
    if not inv.elastic:
        raise InputError(f"join: job {inv.job.name} has a fixed size (job.min_nodes is not set below the "
                         f"{inv.listed} nodes listed): no node can join it while it runs",
                         hint="`ddp-deploy stop`, then `ddp-deploy launch` runs it on every node")


def join(inv: Inventory, remote: Remote, node: str, *, hosts: str, redact: Callable[[str], str] = str,
         say: Say = quiet, warn: Say = quiet, failed_checks: Callable[[list], None] = lambda checks: None) -> Joined:
    """Starts ``node`` into the elastic job running on the others, under the job's lock: the running
    job's own settings (its launch record), the code synced to that node, the join's checks there,
    then the start; nothing else changes when it is refused or fails."""
    joinable(inv, node)
    secrets = secretenv.resolve(inv)
    snap = codesync.snapshot_of(inv)
    with lock.held(inv, remote, "join", hosts, warn=warn):
        states = node_states(inv, remote, redact)
        mine = states[node]
        if mine.state == "unreachable":
            raise RuntimeFailure(f"join refused, nothing started: {node} is unreachable ({mine.metrics})",
                                 hint="check its link and sshd; `ddp-deploy check` names the cause")
        if mine.running:
            raise RuntimeFailure(f"join refused: {node} runs the job already",
                                 hint="the running nodes take it in at their next round; see `ddp-deploy status`")
        running = [n for n, s in states.items() if s.running]
        if not running:
            raise RuntimeFailure(f"join refused, nothing started: {inv.job.name} runs on no node",
                                 hint="`ddp-deploy launch` starts it (it resumes from the newest checkpoint)")
        job = running_job(inv, remote, running[0], node)
        at, text, joined, run = job.inv, job.record, job.nodes, job.run
        if not states[at.rdzv_node.name].running:
            raise RuntimeFailure(f"join refused, nothing started: {at.rdzv_node.name}, which hosts the running "
                                 f"job's rendezvous, does not run it ({states[at.rdzv_node.name].state})",
                                 hint="the job cannot take a node in without it: `ddp-deploy stop`, then "
                                      f"`ddp-deploy --without {at.rdzv_node.name} launch`")
        code = sync_code(at, remote, snap, say, nodes=[node])
        pre = preflight.join_checks(at, remote, node, (record.path(inv), text), code)
        if pre.failed:
            failed_checks(pre.failed)
        refuse_failed_checks(pre.failed, "join refused, nothing started: ")
        spec = plan.launch_spec(at, node_index(at, node), pre.facts.get(node, plan.NodeFacts()), code, run)
        if mine.exists:  # its finished run (restarts run out): its checkpoints stay on the shared volume
            remote.run({node: plan.stop_argv(at, at.node(node))}, check=True, timeout=120)
        stdin = {node: secretenv.stdin_lines(secrets)} if secrets else None
        started = remote.run({node: spec.argv}, check=False, timeout=120, stdin=stdin)
        if not started[node].ok:
            undo_start(at, remote, [node])
            raise RemoteFailure("join", started, hint="nothing else changed: the job runs on as it was")
    return Joined(node, tuple(joined), at.rdzv_node.name, plan.endpoint(at), run)


@dataclass(frozen=True)
class Unlocked:
    """What ``unlock`` found and did on each node (its line, in hosts.yaml's order), and the nodes
    where a lock may remain, with the reason."""

    lines: dict[str, str]
    left: dict[str, str]

    def refusal(self) -> RuntimeFailure | None:
        if not self.left:
            return None
        return RuntimeFailure("unlock: not cleared on " + "; ".join(f"{n} ({why})" for n, why in self.left.items()),
                              hint="run `ddp-deploy unlock` again once they answer")


def unlock(inv: Inventory, remote: Remote, *, force: bool = False) -> Unlocked:
    """Removes the job's locks (its own and its image's, lock.keys) where their holder is gone (its
    heartbeat stale), or any of them with ``force``; refuses, removing nothing, while a live
    command holds one."""
    keys = lock.keys(inv, "deploy")
    seen = {key: lock.survey(inv, remote, key) for key in keys}
    found = {key: {n: s for n, s in seen[key].locks.items() if s is not None} for key in keys}
    live = [s for key in keys for s in found[key].values() if s.stale() is None]
    if live and not force:
        raise RuntimeFailure(f"unlock refused, nothing removed: {live[0].describe()}, its heartbeat "
                             f"{live[0].quiet} s ago", hint="that command still runs: wait for it to finish; "
                             "--force only if you know it does not")
    removed = {key: lock.remove(inv, remote, key, found[key]) for key in keys}
    failed = {n: r for key in keys for n, r in seen[key].failed.items()}
    left = {n: r.summary() for n, r in failed.items()}
    lines = {}
    for n in (node.name for node in inv.nodes):
        if n in failed:
            lines[n] = failed[n].summary()
            continue
        said = []
        for key in keys:
            s, r = found[key].get(n), removed[key].get(n)
            if s is None or r.stdout.strip() == "gone":
                continue
            if r.stdout.strip() == "removed":
                said.append(f"removed the lock of {s.holder()} ({s.stale() or 'live, --force'})")
            else:
                left[n] = "another lock was taken meanwhile" if r.ok else r.summary()
                said.append(left[n])
        lines[n] = "; ".join(said) or "no lock"
    return Unlocked(lines, left)
