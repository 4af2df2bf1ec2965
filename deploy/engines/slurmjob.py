"""A Slurm inventory's verbs as a Python API (hosts.yaml's ``slurm:``): the procedures the Slurm
engine (deploy/cli/engine_slurm.py) is built on. Each talks to the login node only, returns
data or raises a :class:`~deploy.errors.DeployError`, and reports progress through ``say``::

    from deploy.engines.slurmjob import SlurmJob

    job = SlurmJob("hosts.yaml", say=print)
    run = job.launch()                   # the run; run.started: its id and the Slurm job's id
    final = job.wait(timeout=3600)       # Slurm's state once it is done with the job
    print(job.verdict(final))            # or a RuntimeFailure naming the first failure
    job.stop()

The commands themselves are data in deploy/engines/slurm.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..checks.node_checks import Check
from ..errors import InputError, JobStopped, RemoteFailure, RuntimeFailure, StillRunning
from ..inventory import load
from ..job import codesync, outcome, phases, plan, record, runs, runtime, scripts, secretenv
from ..job.payload import payload
from ..observe import doctor, view
from ..observe.goodput import Goodput
from ..observe import plot as plotting
from ..text import safe
from . import fleet, slurm
from .fleet import LogLine, Say, quiet
from .handle import JobApi, Run


def login(inv) -> str:
    return inv.slurm.login.name


def on_login(remote, inv, argv, what: str, *, timeout: float = 60, stdin: bytes | None = None):
    name = login(inv)
    got = remote.run({name: argv}, check=False, timeout=timeout,
                     stdin=None if stdin is None else {name: stdin})[name]
    if not got.ok:
        raise RemoteFailure(what, {name: got}, hint=f"check the login node ({inv.slurm.login.address}): "
                                                    "`ddp-deploy check`")
    return got


def login_checks(inv, remote) -> list[Check]:
    """The login node: Slurm's commands, the partition up, the shared directories, the interpreter."""
    name = login(inv)
    got = on_login(remote, inv, slurm.check_argv(inv), "check")
    checks: list[Check] = []
    for line in got.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "tools":
            checks.append(Check(name, "slurm", rest == "ok", "sbatch, squeue, scontrol, scancel, srun" if rest == "ok"
                                else f"{rest} (install Slurm's client commands on the login node)"))
        elif word == "sinfo":
            up = [p for p in rest.split(";") if p.strip().startswith("up")]
            where = f"partition {inv.slurm.partition}" if inv.slurm.partition else "the default partition"
            checks.append(Check(name, "partition", bool(up), f"{where}: {rest.strip(';') or 'none'}"
                                + ("" if up else " (slurm.partition: a partition that is up; `sinfo` lists them)")))
        elif word == "dir":
            ok, _, path = rest.partition(" ")
            checks.append(Check(name, "storage", ok == "ok", path if ok == "ok" else
                                f"{path} cannot be made or written (storage: a directory every node shares)"))
    if inv.job.runtime == "host":
        py = remote.run({name: plan.python_check_argv(inv)}, check=False, timeout=120)[name]
        checks.append(Check(name, "python", py.ok, f"{inv.python_path()}: torch {py.stdout.strip()}" if py.ok else
                            f"{inv.python_path()}: {py.summary()} (train.python: an interpreter on the shared "
                            "volume with this package installed)"))
    return checks


def job_state(inv, remote, redact=str) -> slurm.SlurmState:
    return secretenv.masked(slurm.parse_status(on_login(remote, inv, slurm.status_argv(inv), "status").stdout), redact)


def follow(inv, remote, timeout, redact, say: Say = quiet, every: float = 10.0, *,
           first_step: bool = False) -> slurm.SlurmState:
    """Polls the job until Slurm is done with it: a line when its state changes, else at most every
    ``every`` seconds while its progress moves. With ``first_step`` (``launch --wait``), the run's
    first step too, from the time Slurm started it, said and kept in its record (deploy/job/phases.py
    FirstStep), as on the SSH fleet."""
    deadline = None if timeout is None else time.monotonic() + timeout
    said, state, at = None, None, 0.0
    diagnosed, probed = False, None
    first: phases.FirstStep | None = None
    while True:
        s = job_state(inv, remote, redact)
        line = progress_line(s)
        if s.state != state or (line != said and time.monotonic() - at >= every):
            say(line)
            said, state, at = line, s.state, time.monotonic()
        if first is None and first_step and s.state == "RUNNING":
            first = phases.FirstStep(say, lambda found, run=s.run: record.keep_first_step(
                inv, remote, login(inv), run, found, say))
        if not s.active:
            if first is not None:
                first.see(node_states(inv, remote, s, redact))
                first.end()
            return s
        if probed is None or time.monotonic() - probed >= slurm.PROGRESS_EVERY_S:
            probed = time.monotonic()
            states = node_states(inv, remote, s, redact)
            if first is not None:
                first.see(states)
            stalled = {n: v.stall for n, v in states.items() if v.stall}
            if stalled and not diagnosed:  # once per stall: where it stopped, then what every rank is doing
                say(safe(f"stalled: {', '.join(f'{n} {view.stall_text(v)}' for n, v in stalled.items())}; "
                         f"{diagnose(inv, remote, s, redact).summary} (`ddp-deploy doctor` shows each rank)"))
            diagnosed = bool(stalled)
        if deadline is not None and time.monotonic() > deadline:
            raise StillRunning(f"still in Slurm after {timeout:g} s: job {s.job_id} {s.state}",
                               hint="follow with `ddp-deploy status`, end it with `ddp-deploy stop`")
        time.sleep(2)


def progress_line(s: slurm.SlurmState) -> str:
    why = f" ({s.reason})" if s.reason and s.state == "PENDING" else ""
    metrics = next((n.metrics for n in s.nodes.values() if n.metrics), "")
    cells = view.Progress.from_line(metrics).cells()
    shown = "  ".join(f"{k} {v}" for k, v in cells.items() if v != "-")
    return safe(f"Slurm job {s.job_id}: {s.state}{why}" + (f"  {shown}" if shown else ""))


def verdict(inv, remote, s: slurm.SlurmState, redact) -> str:
    """What to say of a job that ended well; a RuntimeFailure naming the first failure otherwise."""
    stalled = [n for n, r in s.nodes.items() if r.stall_stopped]
    if stalled:  # each node's launcher ended its part with 0 on the stall: Slurm says COMPLETED
        raise fleet.stalled_and_stopped(inv, remote, stalled, redact)
    stops = [r.stop for r in s.nodes.values() if r.stop is not None]
    if stops:  # the operator's stop (scancel): the job's end, not its failure
        raise JobStopped(f"Slurm job {s.job_id}: the job was {outcome.describe_stop(stops, time.time())} with "
                         "`ddp-deploy stop`", hint="not a failure of the job; launch again to resume from the newest "
                                                   "checkpoint")
    if s.ok and all(n.exits and n.exits[-1][1] == 0 for n in s.nodes.values()):
        if not outcome.trained(s.nodes.values()):
            raise RuntimeFailure(f"Slurm job {s.job_id} COMPLETED: every node {outcome.NOTHING_TRAINED}",
                                 hint=fleet.NOTHING_TRAINED_HINT)
        return f"Slurm job {s.job_id} COMPLETED: all nodes finished with exit code 0"
    first = first_failure(inv, remote, s, redact)
    raise RuntimeFailure(f"Slurm job {s.job_id} ended {s.state}" + (f" (exit {s.exit_code})" if s.exit_code else "")
                         + (f": {first.describe()}" if first else ""),
                         hint=f"`ddp-deploy logs --run {s.run}` shows the rest; the batch script's own output is "
                              f"in {runs.runs_dir(inv)}/{s.run}/slurm-{s.job_id}.out")


def first_failure(inv, remote, s: slurm.SlurmState, redact):
    return fleet.kept_failure(inv, remote, login(inv), s.run, fleet.witnesses({n: r.state() for n, r in s.nodes.items()}),
                         redact)


HEADER = re.compile(r"^==> (.*)/([^/]+)/log <==$")


def node_states(inv, remote, s: slurm.SlurmState, redact, warn=None) -> dict[str, plan.NodeState]:
    """Each node's state: how it ended, as kept in the run's directory; while the job runs, its
    progress read on the node itself (a step beside the job's: its heartbeats, its log's age),
    judged against job.stall_timeout as on the SSH fleet."""
    states = {n: r.state() for n, r in s.nodes.items() if r.exits or not s.active}
    running = [n for n in s.nodes if n not in states]
    if not running:
        return states
    seen = {}
    if s.state == "RUNNING":
        got = remote.run({login(inv): slurm.progress_argv(inv, s.job_id, s.run)}, check=False,
                         timeout=slurm.ON_NODES_S + 15)[login(inv)]
        seen = slurm.by_node(got.stdout)
        if warn is not None and not all(n in seen for n in running):
            warn(redact(f"progress not read on {', '.join(n for n in running if n not in seen)} "
                        f"({got.summary() if not got.ok else 'no answer'}): a stall there is not shown"))
    for n in running:
        found = plan.parse_status("running\n" + seen[n]) if n in seen else plan.NodeState("running")
        found = replace(found, metrics=s.nodes[n].metrics)
        states[n] = secretenv.masked(plan.with_stall(found, inv.job.stall_timeout), redact)
    return states


def diagnose(inv, remote, s: slurm.SlurmState, redact) -> doctor.Diagnosis:
    """Every node's workers and their stacks (deploy/observe/doctor.py), read by a step beside the job's."""
    if s.state != "RUNNING":
        raise RuntimeFailure(f"doctor: Slurm job {s.job_id} is {s.state}: no rank runs" if s.job_id else
                             f"doctor: {inv.job.name} was never submitted",
                             hint="`ddp-deploy status --run ID` shows the stacks kept at a stall of a run that ended")
    got = remote.run({login(inv): slurm.diagnose_argv(inv, s.job_id)}, check=False,
                     timeout=slurm.ON_NODES_S + 15)[login(inv)]
    found = slurm.by_node(got.stdout)
    ranks = [r for n, text in found.items() for r in doctor.parse(n, redact(text))]
    why = redact(got.summary()) if not got.ok else "no answer from its task"
    silent = {n: why for n in s.nodes if n not in found} if s.nodes else {}
    return doctor.diagnose(ranks, silent, inv.slurm.nodes * inv.slurm.nprocs)


def deploy(inv, remote, say: Say = quiet) -> dict[str, str]:
    """The shared directories made from the login node, and what the job will run with there: the
    site's container image, or the shared interpreter with torch. The login node's line."""
    name = login(inv)
    on_login(remote, inv, plan.make_dirs_argv(inv), "deploy")
    say(f"{name}: directories ready in {inv.storage.checkpoints.host}, {inv.storage.data.host}")
    if inv.slurm.container is not None:
        done = f"the site's runtime opens slurm.container.image {inv.slurm.container.image}"
    else:
        py = on_login(remote, inv, plan.python_check_argv(inv), "deploy", timeout=120)
        done = f"{inv.python_path()}: torch {py.stdout.strip()}"
    say(f"{name}: {done}")
    return {name: done}


@dataclass(frozen=True)
class Submitted:
    """A run submitted to Slurm: its id (the kept run's), the Slurm job's id and its size."""

    job: str
    run: str
    job_id: str
    nodes: int
    procs: int
    program: str
    code: str | None

    def describe(self) -> str:
        return (f"submitted {self.job} run {self.run} as Slurm job {self.job_id} ({self.nodes} nodes x {self.procs} "
                f"processes): {self.program}" + (f", code snapshot {self.code[:12]}" if self.code else ""))


def submit(inv, remote, *, redact: Callable[[str], str] = str, say: Say = quiet, warn: Say = quiet,
           failed_checks: Callable[[list], None] = lambda checks: None) -> Submitted:
    """Submits a new run, refused while one is in Slurm still: the code synced to the shared
    volume, the login node's checks, the run's record, its batch script kept and ``sbatch``
    (the secrets on its stdin, never in the script)."""
    secrets = secretenv.resolve(inv)
    snap = codesync.snapshot_of(inv)
    now = job_state(inv, remote, redact)
    if now.active:
        raise RuntimeFailure(f"a previous run of {inv.job.name} is still in Slurm: job {now.job_id} {now.state}",
                             hint="run `ddp-deploy stop` first; two runs never share a rendezvous")
    code = fleet.sync_code(inv, remote, snap, say, nodes=[login(inv)])
    failed = [c for c in login_checks(inv, remote) if not c.ok]
    if failed:
        failed_checks(failed)
    fleet.refuse_failed_checks(failed, "launch refused, nothing submitted: ")
    run = runs.new_id()
    fleet.start_run(inv, remote, run, record.launch_record(inv, code, run, None, redact), say, warn)
    on_login(remote, inv, slurm.write_argv(slurm.script_path(inv, run)), "launch",
             stdin=slurm.batch_script(inv, run, code).encode())
    got = on_login(remote, inv, slurm.submit_argv(inv, run), "launch (sbatch)",
                   stdin=secretenv.stdin_lines(secrets) if secrets else b"")
    s = inv.slurm
    return Submitted(inv.job.name, run, got.stdout.strip().splitlines()[-1], s.nodes, s.nprocs,
                     payload(inv).describe(), code.snapshot if code else None)


def stop(inv, remote, *, now: bool = False, redact: Callable[[str], str] = str) -> str:
    """Ends the job (``scancel``: SIGTERM and up to runtime.STOP_GRACE_S, or at once with ``now``);
    the login node's answer."""
    grace = 0 if now else runtime.STOP_GRACE_S
    got = on_login(remote, inv, slurm.stop_argv(inv, grace), "stop", timeout=grace + 120)
    return redact(got.stdout.strip())


def read_logs(inv, remote, on_line: Callable[[LogLine], None], *, run_id: str | None = None,
              nodes: tuple[str, ...] = (), ranks: tuple[int, ...] = (), tail: int | None = None,
              follow: bool = False, redact: Callable[[str], str] = str, say: Say = quiet,
              reading: Callable[[list[str]], None] = lambda nodes: None) -> list[str]:
    """Every node's log of the job's run (or the kept run ``run_id``), read on the login node from
    the run's directory, each line to ``on_line`` as it comes: ``tail`` over all of them, its file
    headers telling the nodes apart. ``reading`` learns the nodes before the first line; they are
    returned too (none while the job waits for its nodes)."""
    if run_id is not None:
        kept = fleet.kept_run(inv, remote, run_id, redact, "logs --run").run
        run, ran = kept.id, list(kept.nodes)
    else:
        s = job_state(inv, remote, redact)
        if s.job_id is None:
            raise RuntimeFailure(f"{inv.job.name} was never submitted", hint="`ddp-deploy launch` first")
        run, ran = s.run, list(s.nodes)
        if not ran:
            say(f"no output yet: Slurm job {s.job_id} is {s.state}" + (f" ({s.reason})" if s.reason else ""))
            return []
    unknown = sorted(set(nodes) - set(ran))
    if unknown:
        raise InputError(f"--node {', '.join(unknown)}: not a node of run {run} ({', '.join(ran)})")
    chosen = [n for n in ran if not nodes or n in nodes]
    reading(chosen)
    paths = [f"{runtime.kept_dir(inv, run, n)}/log" for n in chosen]
    argv = ["tail", "-v", "-n", "+1" if tail is None else str(tail), *(["-F"] if follow else []), *paths]
    current = {"node": chosen[0]}

    def emit(_login_name: str, line: str) -> None:
        head = HEADER.match(line)
        if head:
            current["node"] = head.group(2)
            return
        if not line and not follow:
            return
        rank, text = view.split_rank(line)
        if not ranks or rank in ranks:
            on_line(LogLine(current["node"], rank, redact(text)))

    full = ("sh", "-c", scripts.MERGE_STDERR, "sh", *argv)
    results = remote.stream({login(inv): full}, emit)  # line by line: none of the logs held here
    if not all(r.ok for r in results.values()):
        raise RemoteFailure("logs", results, hint="no output on the shared volume yet, or the login node is unreachable")
    return chosen


def dry_run_script(inv) -> str:
    """The batch script ``launch`` would submit, its run's id ``RUN_ID`` (``--dry-run``, ``export slurm``)."""
    return slurm.batch_script(inv, code=codesync.code_dir(inv, codesync.snapshot_of(inv)))


class SlurmJob(JobApi):
    """The job of a hosts.yaml with a ``slurm:`` section, verb by verb, for a program instead of a
    shell: each verb goes to the login node. ``say`` and ``warn`` receive the progress lines and
    warnings the CLI prints. Every secret value is masked in what is returned."""

    def __init__(self, hosts: str | Path = "hosts.yaml", *, say: Say = quiet, warn: Say = quiet) -> None:
        inv = load(hosts)
        if inv.slurm is None:
            raise InputError(f"{hosts}: an SSH fleet's inventory (nodes:); this API drives a Slurm job (slurm:)",
                             hint="use deploy.engines.fleet.Fleet for an SSH fleet")
        self.hosts = str(hosts)
        self.inv = inv
        self.redact = secretenv.redactor_for(inv)
        self.say, self.warn = say, warn

    def check(self) -> list[Check]:
        """The login node's checks (``ddp-deploy check``): Slurm's commands, the partition, storage."""
        secretenv.resolve(self.inv)
        with self.connected() as remote:
            return login_checks(self.inv, remote)

    def deploy(self, *, build: bool = False) -> dict[str, str]:
        """The shared directories and what the job runs with (``build`` has no meaning here: the
        site's image or the shared interpreter is given): the login node's line."""
        with self.connected() as remote:
            return deploy(self.inv, remote, self.say)

    def plan(self) -> str:
        """What ``launch`` submits (``ddp-deploy export slurm``): the batch script, the run's id ``RUN_ID``."""
        secretenv.resolve(self.inv)
        return dry_run_script(self.inv)

    def launch(self) -> Run:
        """Submits the job: the run, with what Slurm was given (``.started``: the Slurm job's id)."""
        with self.connected() as remote:
            submitted = submit(self.inv, remote, redact=self.redact, say=self.say, warn=self.warn)
        return Run(self, submitted.run, submitted)

    def state(self) -> slurm.SlurmState:
        """Slurm's state of the job's newest run: its id, state, reason, nodes and each node's exits."""
        with self.connected() as remote:
            return job_state(self.inv, remote, self.redact)

    def states(self) -> dict[str, plan.NodeState]:
        """Each node's state, a running node's read on the node itself (stalls included)."""
        with self.connected() as remote:
            return node_states(self.inv, remote, job_state(self.inv, remote, self.redact), self.redact, warn=self.warn)

    def wait(self, timeout: float | None = None) -> slurm.SlurmState:
        """Slurm's state once it is done with the job; each change of state to ``say``."""
        with self.connected() as remote:
            return follow(self.inv, remote, timeout, self.redact, self.say)

    def verdict(self, final: slurm.SlurmState) -> str:
        with self.connected() as remote:
            return verdict(self.inv, remote, final, self.redact)

    def runs(self) -> list[runs.Run]:
        with self.connected() as remote:
            return fleet.kept_runs(self.inv, remote, "", self.redact).runs

    def goodput(self) -> dict[str, Goodput | None]:
        """As :meth:`deploy.engines.fleet.Fleet.goodput`."""
        with self.connected() as remote:
            kept = fleet.kept_runs(self.inv, remote, "", self.redact).runs
            running = bool(kept) and kept[-1].end is None and job_state(self.inv, remote).active
            return fleet.goodputs(self.inv, remote, kept, running, self.warn)

    def doctor(self) -> doctor.Diagnosis:
        with self.connected() as remote:
            return diagnose(self.inv, remote, job_state(self.inv, remote, self.redact), self.redact)

    def logs(self, *, tail: int | None = None, nodes: tuple[str, ...] = (), ranks: tuple[int, ...] = (),
             run: str | None = None, follow: bool = False,
             on_line: Callable[[LogLine], None] | None = None) -> list[LogLine]:
        """As :meth:`deploy.engines.fleet.Fleet.logs`."""
        if follow and on_line is None:
            raise InputError("logs: follow=True needs on_line", hint="pass on_line=print, or a function of your own")
        kept: list[LogLine] = []
        with self.connected() as remote:
            read_logs(self.inv, remote, on_line or kept.append, run_id=run, nodes=nodes, ranks=ranks, tail=tail,
                      follow=follow, redact=self.redact, say=self.say)
        return kept

    def metrics(self, runs: tuple[str, ...] = ()) -> dict[str, list[dict]]:
        """As :meth:`deploy.engines.fleet.Fleet.metrics`."""
        with self.connected() as remote:
            by_run = fleet.metrics(self.inv, remote, runs, self.redact, self.warn).by_run
        return {run: by_run[run] for run in plotting.wanted_runs(list(by_run), runs)}

    def plot(self, path: str | Path, runs: tuple[str, ...] = ()) -> str:
        with self.connected() as remote:
            return fleet.plot(self.inv, remote, path, runs, self.redact, self.warn)

    def stop(self, *, now: bool = False) -> str:
        with self.connected() as remote:
            return stop(self.inv, remote, now=now, redact=self.redact)
