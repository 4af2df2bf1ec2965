"""The SSH fleet's verbs as a Python API: the procedures the CLI is built on.

Each one takes the inventory, an open :class:`~deploy.nodes.remote.Remote` and a ``redact`` for the
job's secrets, returns data or raises a :class:`~deploy.errors.DeployError` naming the cause,
and reports progress through callbacks (``say``: a line of progress, ``warn``: a warning), so that
a notebook or a CI pipeline can launch, follow and stop a job without a shell::

    from deploy.engines.fleet import Fleet

    fleet = Fleet("hosts.yaml", say=print)
    started = fleet.launch()             # the run id, its nodes and where the launch's time went
    final = fleet.wait(timeout=3600)     # every node's state once the job has ended
    print(fleet.verdict(final))          # or a RuntimeFailure naming the first failure (JobStopped: stopped)
    fleet.stop()

The click commands (deploy/cli.py) only parse, call these and render (deploy/engines/render.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..checks import preflight
from ..errors import InputError, JobStopped, RemoteFailure, RuntimeFailure
from ..images import deliveries, prepare
from ..inventory import Inventory, load
from ..job import codesync, lock, outcome, phases, plan, record, runs, runtime, secretenv, stall
from ..job.payload import payload
from ..nodes.remote import Remote
from ..observe import doctor, failure, goodput, view
from ..observe.goodput import Goodput
from ..observe import plot as plotting

Say = Callable[[str], None]


def quiet(text: str) -> None:
    """The default reporter: says nothing."""


def size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


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
    from ..images import image

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


def verdict(inv, final, remote, redact) -> str:
    """The end of a followed job: what to say if every node (of an elastic job: every node not
    lost) exited with 0 and something shows that it trained; else a failure naming the nodes and
    the first failure (node, rank, exit code, the program's first error line), or a JobStopped
    where the operator's ``stop`` ended it."""
    lost = [n for n, s in final.items() if s.state in ("unreachable", "unknown")] if inv.elastic else []
    stopped = [n for n, s in final.items() if outcome.is_stopped(s.state)]
    failed = [n for n, s in final.items() if s.state != "exited(0)" and n not in lost and n not in stopped]
    stalled = [n for n, s in final.items() if s.state == stall.STOPPED]
    if stalled:  # the cause of any other node's end: each launcher ends its part when it finds the stall
        raise stalled_and_stopped(inv, remote, stalled, redact)
    if stopped:  # the ranks' ends under a stop (a peer gone first) are the stop's, not failures
        raise stopped_by_operator(final, stopped)
    if failed:
        first = first_failure(inv, remote, witnesses(final), redact)
        raise RuntimeFailure(f"the job failed on {', '.join(failed)}" + (f": {first.describe()}" if first else ""),
                             hint=f"`ddp-deploy logs{f' --tail {FAILURE_TAIL}' if first else ''}` shows the rest")
    untrained = nothing_trained(final, lost)
    if untrained:
        raise RuntimeFailure(untrained, hint=NOTHING_TRAINED_HINT)
    if lost:
        return (f"finished without {', '.join(lost)} (lost; job.min_nodes {inv.job.min_nodes}): the other "
                "nodes exited with code 0")
    return "all nodes finished with exit code 0"


NOTHING_TRAINED_HINT = ("a program that trains forms the process group (init_process_group) or prints METRICS lines "
                        "(docs/own-code.md); `ddp-deploy logs` shows what it did")


def nothing_trained(states, lost=()) -> str | None:
    """``every node exited 0, but ...: nothing shows it trained`` where every node (but the
    ``lost``) exited 0 and none formed a process group or printed a METRICS line; else None."""
    ended = [s for n, s in states.items() if n not in lost]
    if ended and all(s.state == "exited(0)" for s in ended) and not outcome.trained(ended):
        return f"every node {outcome.NOTHING_TRAINED}"
    return None


def stopped_by_operator(final, stopped: list[str]) -> JobStopped:
    """The end of a job that ``stop`` ended on the nodes ``stopped``: who stopped it, when and how,
    and how each other node had ended."""
    stops = [final[n].stop for n in stopped if final[n].stop is not None]
    said = outcome.describe_stop(stops, time.time()) if stops else "stopped (how: unknown)"
    before = [f"{n} {s.state}" for n, s in final.items() if n not in stopped]
    return JobStopped(f"the job was {said} with `ddp-deploy stop`, on {', '.join(stopped)}"
                      + (f"; ended before the stop reached them: {', '.join(before)}" if before else ""),
                      hint="not a failure of the job; launch again to resume from the newest checkpoint")


def stalled_and_stopped(inv, remote, stalled: list[str], redact) -> RuntimeFailure:
    """The end of a job whose nodes' launchers stopped it on a stall, with the kept diagnosis."""
    why = newest_stall(inv, remote, redact)
    return RuntimeFailure(f"the job stalled and was stopped on {', '.join(stalled)} (job.on_stall: stop)"
                          + (f": {why}" if why else ""),
                          hint="`ddp-deploy status --run ID` shows each stall and where the ranks were; "
                               "launch again to resume from the newest checkpoint")


def node_index(inv: Inventory, node: str) -> int:
    return [n.name for n in inv.nodes].index(node)


def running_job(inv: Inventory, remote: Remote, reader: str, node: str) -> tuple[Inventory, str, list[str], str]:
    """The inventory of the job running now (its rendezvous node from its launch record, read on
    ``reader``), the record's text, the nodes it was launched on, and its run id (the joining
    node's output is kept with that run)."""
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
    return (at, got.stdout, [n["name"] for n in found.get("nodes", []) if isinstance(n, dict) and "name" in n],
            run or runs.new_id())


def without_interface(inv, facts) -> list[str]:
    """A warning for each node whose NIC neither the inventory names nor the preflight found."""
    return [f"{n.name}: no interface holds {n.address}; gloo/NCCL pick one from the hostname (set "
            "nodes[].interface if the job hangs)" for n in inv.nodes
            if n.interface is None and facts.get(n.name, plan.NodeFacts()).interface is None]


UNREACHABLE_POLLS = 30  # consecutive 1-s polls before a silent node ends --wait


def wait(inv, remote, timeout, redact, show: Callable[[dict], None] = lambda states: None, say: Say = quiet,
         last: Callable[[dict], None] = lambda states: None) -> dict[str, plan.NodeState]:
    """Polls every node's state each second until the job has ended (an elastic job: on the nodes
    not lost), ``show`` each time; a RuntimeFailure past ``timeout`` or once too many nodes are
    lost, after ``last`` (the states then)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    silent = {n.name: 0 for n in inv.nodes}
    floor = inv.job.min_nodes or len(inv.nodes)  # an elastic job goes on without lost nodes, down to this
    diagnosed = False
    while True:
        states = node_states(inv, remote, redact)
        show(states)
        stalled = any(s.stall for s in states.values())
        if stalled and not diagnosed:  # once per stall: what every rank is doing, the odd ones first
            say(f"stalled: {diagnose(inv, remote, redact).summary} (`ddp-deploy doctor` shows each rank)")
        diagnosed = stalled
        for n, s in states.items():
            silent[n] = silent[n] + 1 if s.state in ("unreachable", "unknown") else 0
        lost = [n for n, count in silent.items() if count >= UNREACHABLE_POLLS]
        if len(inv.nodes) - len(lost) >= floor and all(
                s.ended or s.state == "absent" or n in lost for n, s in states.items()):
            return states
        if lost and len(inv.nodes) - len(lost) < floor:
            last(states)
            raise RuntimeFailure(f"lost contact with {', '.join(lost)} while the job ran",
                                 hint="`ddp-deploy stop` ends it on the nodes still reachable; launch again to resume "
                                      f"(`ddp-deploy --without {lost[0]} launch` leaves a node out for good)")
        if deadline is not None and time.monotonic() > deadline:
            last(states)
            raise RuntimeFailure(f"still running after {timeout:g} s",
                                 hint="follow with `ddp-deploy status`, end it with `ddp-deploy stop`")
        time.sleep(1)


FAILURE_TAIL = 400  # log lines read per failed node: torchrun's summary ends the log


def witnesses(states) -> list[str]:
    """The nodes whose logs tell the first failure: the failed ones, and, once one has failed, those
    that exited 0 too (a rank that left early, failure.LeftEarly, is the cause on a node that ended well)."""
    if not any(s.failed for s in states.values()):
        return []
    return [n for n, s in states.items() if s.failed or s.state == "exited(0)"]


def first_failure(inv, remote, nodes, redact) -> failure.Failure | None:
    if not nodes:
        return None
    got = remote.run({n: plan.logs_argv(inv, inv.node(n), tail=FAILURE_TAIL, follow=False) for n in nodes},
                     check=False, timeout=60)
    return secretenv.masked(failure.first_failure({n: r.stdout for n, r in got.items() if r.ok}), redact)


def node_states(inv, remote, redact) -> dict[str, plan.NodeState]:
    """Every node's state; ``redact`` hides secret values in the metrics (a program may print them),
    once parsed: what a node's state is never depends on them."""
    res = remote.run({n.name: plan.status_argv(inv, n) for n in inv.nodes}, check=False, timeout=60)
    return {n: plan.with_stall(secretenv.masked(plan.parse_status(r.stdout) if r.ok else plan.NodeState(
                "unknown" if r.connected else "unreachable", r.summary()), redact), inv.job.stall_timeout)
            for n, r in res.items()}


def diagnose(inv, remote, redact) -> doctor.Diagnosis:
    """Every node's workers and their stacks, grouped (deploy/observe/doctor.py); what the job's stacks
    say is masked like its output (a secret in a function's name or a path)."""
    res = remote.run({n.name: plan.diagnose_argv(inv, n) for n in inv.nodes}, check=False, timeout=60)
    ranks, silent = [], {}
    for n, r in res.items():
        if r.ok:
            ranks += doctor.parse(n, redact(r.stdout))
        else:
            silent[n] = redact(r.summary())
    return doctor.diagnose(ranks, silent, sum(n.nprocs for n in inv.nodes))


def when(run: runs.Run) -> tuple[str, str | None]:
    """When a run started (local time) and how long it took (None: not every node has ended)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.start)) if run.start else "?"
    return started, view.duration(run.end - run.start) if run.start and run.end else None


def readers(inv):
    """Where the tool reads and writes the shared volume: the nodes, or Slurm's login node."""
    return (inv.slurm.login,) if inv.slurm else inv.nodes


def on_any_node(inv, remote, argv, what: str):
    """``argv`` run on the first node that answers (the shared volume is the same on all): that
    node and its result; a failure naming each node tried."""
    tried = []
    for n in readers(inv):
        got = remote.run({n.name: argv}, check=False, timeout=60)[n.name]
        if got.ok:
            return n.name, got
        tried.append(f"{n.name}: {got.summary()}")
        if got.connected:
            break
    raise RuntimeFailure(f"cannot read {what} ({'; '.join(tried)})", hint="`ddp-deploy check` names the cause")


def kept_runs(inv, remote, prefix: str, redact) -> tuple[str, list[runs.Run]]:
    """The kept runs whose id starts with ``prefix``, and the node that read them."""
    reader, got = on_any_node(inv, remote, runs.list_argv(inv, prefix), f"the kept runs in {runs.runs_dir(inv)}")
    return reader, secretenv.masked(runs.parse(got.stdout), redact)


def kept_run(inv, remote, wanted: str, redact, verb: str) -> tuple[str, runs.Run]:
    reader, kept = kept_runs(inv, remote, wanted, redact)
    try:
        return reader, runs.pick(kept, wanted)
    except ValueError as e:
        raise InputError(f"{verb}: {e}", hint="`ddp-deploy runs` lists the kept runs") from None


def goodputs(inv, remote, kept: list[runs.Run], running: bool = False, warn: Say = quiet) -> dict[str, Goodput | None]:
    """Each kept run's goodput, from the built-in trainer's records in metrics.jsonl (None for a
    run with none: another program's, or one that never stepped); {} where the file could not be
    read. The newest run's wall time runs to now while it is ``running``; a run whose end no node
    recorded (one was lost) ends at its last record."""
    if not kept:
        return {}
    try:
        got = on_any_node(inv, remote, plotting.sources_argv(inv), f"the metrics in {inv.storage.checkpoints.host}")[1]
    except RuntimeFailure as e:
        warn(f"goodput not shown: {e}")
        return {}
    # unmasked: a secret equal to a word the reckoning reads ("train") must not change it; none of
    # the records' text is shown
    by_run = plotting.records_by_run(plotting.parse_sources(got.stdout)[1])
    now = time.time()
    return {r.id: goodput.of_run(by_run.get(r.id, []), r.start, r.end,
                                 now if running and r is kept[-1] else (goodput.last_time(by_run.get(r.id, [])) or now))
            for r in kept}


def metrics(inv, remote, run_ids: tuple[str, ...] = (), redact: Callable[[str], str] = str,
            warn: Say = quiet) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """The metrics records of each run (all, or those ``run_ids`` name: an id or its start), from
    metrics.jsonl on the shared volume, or from a run's kept logs (its program's METRICS lines)
    where the file knows nothing of it; secrets masked after parsing. And where each run's came
    from, for the runs read from logs."""
    reader, got = on_any_node(inv, remote, plotting.sources_argv(inv), f"the metrics in {inv.storage.checkpoints.host}")
    kept, text = plotting.parse_sources(got.stdout)  # parsed first, masked after (below)
    by_run = plotting.records_by_run(text)
    missing = [r for r in plotting.wanted_runs(kept, run_ids) if r not in by_run]
    from_logs = {}
    if missing:  # runs metrics.jsonl knows nothing of: their programs' METRICS lines
        read = remote.run({reader: plotting.log_metrics_argv(inv, missing)}, check=False, timeout=120)[reader]
        if read.ok:
            from_logs = plotting.log_records(read.stdout)
        else:
            warn(f"{reader}: the logs of {', '.join(missing)} were not read: {read.summary()}")
    return plotting.masked({**by_run, **from_logs}, redact), {run: plotting.FROM_LOGS for run in from_logs}


def plot(inv, remote, path: str | Path, run_ids: tuple[str, ...] = (), redact: Callable[[str], str] = str,
         warn: Say = quiet) -> str:
    """One PNG of the runs' metrics at ``path`` (deploy/observe/plot.py; needs matplotlib): what
    it drew, as a line."""
    plotting.require_matplotlib()
    by_run, sources = metrics(inv, remote, run_ids, redact, warn)
    plotting.render(by_run, path, wanted=run_ids, title=f"{inv.job.name}: metrics by run", from_logs=sources)
    return plotting.wrote(path, plotting.select(by_run, run_ids), sources)


def kept_failure(inv, remote, reader: str, run: str, nodes, redact) -> failure.Failure | None:
    """The first failure among ``nodes`` of a kept run, from their logs read on ``reader``."""
    logs = {}
    for n in nodes:
        got = remote.run({reader: runs.log_argv(inv, run, n, tail=FAILURE_TAIL, follow=False)}, check=False,
                         timeout=60)[reader]
        if got.ok:
            logs[n] = got.stdout
    return secretenv.masked(failure.first_failure(logs), redact) if logs else None


def newest_stall(inv, remote, redact) -> str | None:
    """The diagnosis of the newest run's last kept stall (None: none kept, or not read)."""
    try:
        reader, kept = kept_runs(inv, remote, "", redact)
    except RuntimeFailure:
        return None
    stalls = kept_stalls(inv, remote, reader, kept[-1], redact) if kept else []
    return stalls[-1]["diagnosis"] if stalls else None


def kept_stalls(inv, remote, reader: str, run: runs.Run, redact) -> list[dict]:
    """Each stall of a kept run, as its nodes' launchers kept it, with the diagnosis of the stacks
    they kept (None where none was read)."""
    events = run.stall_events()
    if not events:
        return []
    wanted = [(n, rec.time) for _, recs in events for n, rec in recs.items()]
    got = remote.run({reader: runs.stall_diagnoses_argv(inv, run.id, wanted)}, check=False, timeout=120)[reader]
    kept = runs.parse_diagnoses(got.stdout) if got.ok else {}
    procs = [run.procs(n) for n in run.nodes]
    out_ = []
    for when, recs in events:
        ranks = [r for n, rec in recs.items() if (n, rec.time) in kept for r in doctor.parse(n, kept[(n, rec.time)])]
        complete = all((n, rec.time) in kept for n, rec in recs.items()) and set(recs) == set(run.nodes)
        world = sum(procs) if complete and None not in procs else None  # else no rank is called gone
        found = doctor.diagnose(ranks, {}, world) if ranks else None
        actions = {r.action for r in recs.values()}
        out_.append({"time": when, "action": next((a for a in ("stop", "restart") if a in actions), "report"),
                     "nodes": {n: rec.as_data() for n, rec in recs.items()},
                     "diagnosis": secretenv.masked(found.summary, redact) if found else None,
                     "culprits": list(found.culprits) if found else []})
    return out_


# --- launch and stop ------------------------------------------------------------------------------

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

    def describe(self) -> str:
        return (f"started {self.job} run {self.run} on {len(self.nodes)} nodes ({self.procs} processes): "
                f"{self.program}" + (f", code snapshot {self.code.snapshot[:12]}" if self.code else ""))


def launch(inv: Inventory, remote: Remote, *, hosts: str, redact: Callable[[str], str] = str, say: Say = quiet,
           warn: Say = quiet, failed_checks: Callable[[list], None] = lambda checks: None) -> Started:
    """Starts the job on every node, all or nothing: under the fleet lock, the nodes' states (none
    unreachable, none running the job), the code synced, every check of ``check``, one image on
    every node, a new run with its record, then the start; a node that did not start stops the
    others. ``failed_checks`` sees the failed checks before the refusal; ``hosts`` names the
    inventory in the lock."""
    secrets = secretenv.resolve(inv)
    snap = codesync.snapshot_of(inv)
    took = phases.Phases()
    with contextlib.ExitStack() as fleet:
        with took("lock"):
            held = fleet.enter_context(lock.held(inv, remote, "launch", hosts, warn=warn))
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
        specs = plan.launch_plan(inv, pre.facts, code, run)
        # Preparing took a while: an `unlock --force` meanwhile may have let another operator in,
        # whose run the cleanup below or a second start would break.
        held.confirm("launch")
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
                   payload(inv).describe(), code, took.data())


def stop(inv: Inventory, remote: Remote, *, now: bool = False) -> dict:
    """Ends the job on every reachable node (idempotent): SIGTERM and up to runtime.STOP_GRACE_S
    for its step and checkpoint, or ``now``: killed at once. Each node's Result."""
    grace = 0 if now else runtime.STOP_GRACE_S
    return remote.run({n.name: plan.stop_argv(inv, n, grace) for n in inv.nodes}, check=False, timeout=grace + 120)


Shipping = Callable[[str, str, int, int | None], None]  # node, stage, bytes done, bytes in all (None: unknown)


@contextlib.contextmanager
def no_progress():
    yield lambda node, stage, done, total: None


def deploy(inv: Inventory, remote: Remote, *, hosts: str, build: bool = False, say: Say = quiet, warn: Say = quiet,
           shipping: Callable[[], contextlib.AbstractContextManager[Shipping]] = no_progress,
           interrupted: Callable[[], None] = lambda: None) -> dict[str, str]:
    """Readies every node for a launch, under the fleet lock: the shared directories, then the image
    (built here with ``build``, shipped where a node's ID differs, each shipment's bytes reported to
    the function ``shipping()`` yields) or, on the host runtime, the interpreter checked. What each
    node has now, as a line. ``interrupted`` is called on a Ctrl-C while the lock is still held."""
    steps = prepare.deployer(inv)
    with lock.held(inv, remote, "deploy", hosts, warn=warn) as fleet_lock:
        def ship(image_id, held):
            # The build takes minutes: an `unlock --force` meanwhile may have let another operator in.
            fleet_lock.confirm("deploy", "no image was shipped")
            with shipping() as report:
                return deliveries.for_inventory(inv).ship(remote, image_id, held, report)

        try:
            return steps.run(remote, say, build=build, ship=ship)
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
    """Starts ``node`` into the elastic job running on the others, under the fleet lock: the running
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
        at, text, joined, run = running_job(inv, remote, running[0], node)
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
    """Removes the fleet lock where its holder is gone (its heartbeat stale), or any lock with
    ``force``; refuses, removing nothing, while a live command holds it."""
    seen = lock.survey(inv, remote)
    found = {n: s for n, s in seen.locks.items() if s is not None}
    live = [s for s in found.values() if s.stale() is None]
    if live and not force:
        raise RuntimeFailure(f"unlock refused, nothing removed: {live[0].describe()}, its heartbeat "
                             f"{live[0].quiet} s ago", hint="that command still runs: wait for it to finish; "
                             "--force only if you know it does not")
    removed = lock.remove(inv, remote, found)
    left = {n: r.summary() for n, r in seen.failed.items()}
    lines = {}
    for n in (node.name for node in inv.nodes):
        s, r = found.get(n), removed.get(n)
        if n in seen.failed:
            lines[n] = seen.failed[n].summary()
        elif s is None or r.stdout.strip() == "gone":
            lines[n] = "no lock"
        elif r.stdout.strip() == "removed":
            lines[n] = f"removed the lock of {s.holder()} ({s.stale() or 'live, --force'})"
        else:
            left[n] = lines[n] = "another lock was taken meanwhile" if r.ok else r.summary()
    return Unlocked(lines, left)


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
    run = kept_run(inv, remote, run_id, redact, "logs --run")[1]
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


class Fleet:
    """The job of a hosts.yaml on its SSH fleet, verb by verb, for a program instead of a shell.

    ``without``: nodes left out (as ``--without``). ``say`` and ``warn`` receive the progress
    lines and warnings the CLI prints. Every secret value is masked in what is returned (the
    job's output may print one)."""

    def __init__(self, hosts: str | Path = "hosts.yaml", *, without: tuple[str, ...] = (), say: Say = quiet,
                 warn: Say = quiet) -> None:
        inv = load(hosts)
        if inv.slurm is not None:
            raise InputError(f"{hosts}: a Slurm inventory; this API drives an SSH fleet (nodes:)",
                             hint="use deploy.engines.slurmjob.SlurmJob for Slurm, or deploy.engines.choose.api, "
                                  "which picks")
        self.hosts = str(hosts)
        self.inv = inv.without(without) if without else inv
        self.redact = secretenv.redactor_for(self.inv)
        self.say, self.warn = say, warn

    def check(self) -> list:
        """The preflight checks on every node (``ddp-deploy check``), with the code synced first so
        that the program's import is checked where it will run: each a Check (node, name, ok, detail)."""
        with Remote(self.inv) as remote:
            return check(self.inv, remote, self.say).checks

    def deploy(self, *, build: bool = False, shipping=no_progress) -> dict[str, str]:
        """Readies every node (``ddp-deploy deploy``): each node's line of what it has now."""
        with Remote(self.inv) as remote:
            return deploy(self.inv, remote, hosts=self.hosts, build=build, say=self.say, warn=self.warn,
                          shipping=shipping)

    def launch(self) -> Started:
        """Starts the job on every node, all or nothing (``ddp-deploy launch``)."""
        with Remote(self.inv) as remote:
            return launch(self.inv, remote, hosts=self.hosts, redact=self.redact, say=self.say, warn=self.warn)

    def join(self, node: str) -> Joined:
        """Starts ``node`` into the elastic job the others run (``ddp-deploy join NODE``)."""
        with Remote(self.inv) as remote:
            return join(self.inv, remote, node, hosts=self.hosts, redact=self.redact, say=self.say, warn=self.warn)

    def logs(self, *, tail: int | None = None, nodes: tuple[str, ...] = (), ranks: tuple[int, ...] = (),
             run: str | None = None, follow: bool = False,
             on_line: Callable[[LogLine], None] | None = None) -> list[LogLine]:
        """The job's log lines (of the kept run ``run``, or the running one), node after node, only the
        ``nodes`` and ``ranks`` asked for. With ``on_line`` each goes there as it comes and none is
        kept (a log can outgrow memory). ``follow`` needs ``on_line``: every node at once, so it may
        be called from several threads at once, until interrupted (or, on docker, until the
        containers end)."""
        if follow and on_line is None:
            raise InputError("logs: follow=True needs on_line", hint="pass on_line=print, or a function of your own")
        kept: list[LogLine] = []
        with Remote(self.inv) as remote:
            reads = log_reads(self.inv, remote, run_id=run, nodes=nodes, tail=tail, follow=follow,
                              redact=self.redact, warn=self.warn)
            read_logs(remote, reads, on_line or kept.append, follow=follow, ranks=ranks, redact=self.redact)
        return kept

    def metrics(self, runs: tuple[str, ...] = ()) -> dict[str, list[dict]]:
        """Each run's metrics records as the trainer (or the program's METRICS lines) wrote them, by
        run id (all runs, or those ``runs`` names: an id or its start)."""
        with Remote(self.inv) as remote:
            by_run = metrics(self.inv, remote, runs, self.redact, self.warn)[0]
        return {run: by_run[run] for run in plotting.wanted_runs(list(by_run), runs)}

    def plot(self, path: str | Path, runs: tuple[str, ...] = ()) -> str:
        """The runs' metrics drawn into one PNG at ``path`` (``ddp-deploy plot``): what it drew."""
        with Remote(self.inv) as remote:
            return plot(self.inv, remote, path, runs, self.redact, self.warn)

    def unlock(self, *, force: bool = False) -> dict[str, str]:
        """Removes a stale fleet lock (any, with ``force``): each node's line; a RuntimeFailure where
        a lock may remain."""
        with Remote(self.inv) as remote:
            done = unlock(self.inv, remote, force=force)
        refused = done.refusal()
        if refused:
            raise refused
        return done.lines

    def states(self) -> dict[str, plan.NodeState]:
        """Every node's state now (running, exited(N), stalled, unreachable, ...) and its last metrics."""
        with Remote(self.inv) as remote:
            return node_states(self.inv, remote, self.redact)

    def wait(self, timeout: float | None = None,
             show: Callable[[dict], None] = lambda states: None) -> dict[str, plan.NodeState]:
        """Every node's state once the job has ended; ``show`` sees the states at each poll."""
        with Remote(self.inv) as remote:
            return wait(self.inv, remote, timeout, self.redact, show=show, say=self.say)

    def verdict(self, final: dict[str, plan.NodeState]) -> str:
        """What to say of a job that ended well; a RuntimeFailure naming the first failure otherwise
        (or saying that nothing shows it trained), a JobStopped where ``stop`` ended it."""
        with Remote(self.inv) as remote:
            return verdict(self.inv, final, remote, self.redact)

    def runs(self) -> list[runs.Run]:
        """The job's kept runs, oldest first: id, start, end, each node's exits, metrics and stalls."""
        with Remote(self.inv) as remote:
            return kept_runs(self.inv, remote, "", self.redact)[1]

    def goodput(self) -> dict[str, Goodput | None]:
        """Each kept run's goodput and incidents (restarts, resizes, stops), by run id."""
        with Remote(self.inv) as remote:
            kept = kept_runs(self.inv, remote, "", self.redact)[1]
            running = bool(kept) and kept[-1].end is None and any(s.running for s in node_states(
                self.inv, remote, self.redact).values())
            return goodputs(self.inv, remote, kept, running, self.warn)

    def doctor(self) -> doctor.Diagnosis:
        """What every rank of the running job is doing, grouped by where the ranks wait."""
        with Remote(self.inv) as remote:
            return diagnose(self.inv, remote, self.redact)

    def stop(self, *, now: bool = False) -> dict[str, str]:
        """Ends the job (see :func:`stop`): each node's answer; a RemoteFailure where one did not."""
        with Remote(self.inv) as remote:
            results = stop(self.inv, remote, now=now)
        if not all(r.ok for r in results.values()):
            raise RemoteFailure("stop", results, hint="stop it there by hand once reachable, or run stop again")
        return {n: self.redact(r.stdout.strip()) for n, r in results.items()}
