"""The SSH fleet as one Python object (:class:`Fleet`): each verb a method, its connections
opened per call."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ...errors import InputError, RemoteFailure
from ...inventory import load
from ...job import launchplan, plan, runs, secretenv
from ...observe import doctor
from ...observe.goodput import Goodput
from ...observe import plot as plotting
from .common import Say, check, quiet
from .watch import diagnose, node_states, verdict, wait
from .kept import goodputs, kept_runs, metrics, plot
from .actions import Joined, deploy, join, launch, no_progress, stop, unlock
from .logs import LogLine, log_reads, read_logs
from .alljobs import FleetJobs, jobs
from .heal import Watch, current_run
from .heal import start as start_watcher
from ...nodes.remote import Remote
from ..handle import JobApi, Run


class Fleet(JobApi):
    """The job of a hosts.yaml on its SSH fleet, verb by verb, for a program instead of a shell;
    in ``with``, its connections are kept until the block ends (deploy/engines/handle.py).

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
        with self.connected() as remote:
            return check(self.inv, remote, self.say).checks

    def deploy(self, *, build: bool = False, shipping=no_progress, wait_lock: float = 0.0) -> dict[str, str]:
        """Readies every node (``ddp-deploy deploy``): each node's line of what it has now."""
        with self.connected() as remote:
            return deploy(self.inv, remote, hosts=self.hosts, build=build, say=self.say, warn=self.warn,
                          shipping=shipping, wait_lock=wait_lock)

    def plan(self) -> launchplan.LaunchPlan:
        """What ``launch`` would run on each node (``ddp-deploy launch --dry-run``), touching nothing:
        the run's id ``RUN_ID``, each node's NIC found only at launch (its notes say so)."""
        return launchplan.dry_run(self.inv)

    def launch(self, *, wait_lock: float = 0.0) -> Run:
        """Starts the job on every node, all or nothing (``ddp-deploy launch``; ``wait_lock``: seconds
        to wait for another command of this job that holds its lock), and its watcher where
        heal.watch is set: the run, with what the launch did (``.started``: its nodes, its phases,
        the plan it ran)."""
        with self.connected() as remote:
            started = launch(self.inv, remote, hosts=self.hosts, redact=self.redact, say=self.say, warn=self.warn,
                             wait_lock=wait_lock)
        if self.inv.heal.watch:
            self.say(start_watcher(self.inv, self.hosts, started.run).describe())
        return Run(self, started.run, started)

    def join(self, node: str) -> Joined:
        """Starts ``node`` into the elastic job the others run (``ddp-deploy join NODE``)."""
        with self.connected() as remote:
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
        with self.connected() as remote:
            reads = log_reads(self.inv, remote, run_id=run, nodes=nodes, tail=tail, follow=follow,
                              redact=self.redact, warn=self.warn)
            read_logs(remote, reads, on_line or kept.append, follow=follow, ranks=ranks, redact=self.redact)
        return kept

    def metrics(self, runs: tuple[str, ...] = ()) -> dict[str, list[dict]]:
        """Each run's metrics records as the trainer (or the program's METRICS lines) wrote them, by
        run id (all runs, or those ``runs`` names: an id or its start)."""
        with self.connected() as remote:
            by_run = metrics(self.inv, remote, runs, self.redact, self.warn).by_run
        return {run: by_run[run] for run in plotting.wanted_runs(list(by_run), runs)}

    def plot(self, path: str | Path, runs: tuple[str, ...] = ()) -> str:
        """The runs' metrics drawn into one PNG at ``path`` (``ddp-deploy plot``): what it drew."""
        with self.connected() as remote:
            return plot(self.inv, remote, path, runs, self.redact, self.warn)

    def unlock(self, *, force: bool = False) -> dict[str, str]:
        """Removes the job's stale locks (any, with ``force``): each node's line; a RuntimeFailure where
        a lock may remain."""
        with self.connected() as remote:
            done = unlock(self.inv, remote, force=force)
        refused = done.refusal()
        if refused:
            raise refused
        return done.lines

    def jobs(self) -> FleetJobs:
        """Every job running on the inventory's nodes, whoever started it (alljobs.py)."""
        with self.connected() as remote:
            return jobs(self.inv, remote)

    def states(self) -> dict[str, plan.NodeState]:
        """Every node's state now (running, exited(N), stalled, unreachable, ...) and its last metrics."""
        with self.connected() as remote:
            return node_states(self.inv, remote, self.redact)

    def wait(self, timeout: float | None = None,
             show: Callable[[dict], None] = lambda states: None) -> dict[str, plan.NodeState]:
        """Every node's state once the job has ended; ``show`` sees the states at each poll."""
        with self.connected() as remote:
            return wait(self.inv, remote, timeout, self.redact, show=show, say=self.say)

    def verdict(self, final: dict[str, plan.NodeState]) -> str:
        """What to say of a job that ended well; a RuntimeFailure naming the first failure otherwise
        (or saying that nothing shows it trained), a JobStopped where ``stop`` ended it."""
        with self.connected() as remote:
            return verdict(self.inv, final, remote, self.redact)

    def runs(self) -> list[runs.Run]:
        """The job's kept runs, oldest first: id, start, end, each node's exits, metrics and stalls."""
        with self.connected() as remote:
            return kept_runs(self.inv, remote, "", self.redact).runs

    def goodput(self) -> dict[str, Goodput | None]:
        """Each kept run's goodput and incidents (restarts, resizes, stops), by run id."""
        with self.connected() as remote:
            kept = kept_runs(self.inv, remote, "", self.redact).runs
            running = bool(kept) and kept[-1].end is None and any(s.running for s in node_states(
                self.inv, remote, self.redact).values())
            return goodputs(self.inv, remote, kept, running, self.warn)

    def doctor(self) -> doctor.Diagnosis:
        """What every rank of the running job is doing, grouped by where the ranks wait."""
        with self.connected() as remote:
            return diagnose(self.inv, remote, self.redact)

    def watch(self, run: str | None = None) -> tuple[str, str]:
        """Heals the running job (its run ``run``, default the current one) until it ends, as
        ``ddp-deploy watch`` does (heal.watch): how it ended (healing.OUTCOMES) and the last decision."""
        if not self.inv.heal.watch:
            raise InputError("watch: heal.watch is not set in hosts.yaml", hint="set heal.watch: true")
        with Remote(load(self.hosts).and_spares()) as remote:  # the nodes left out too: one may come back
            run = run or current_run(self.inv, remote)
            return Watch(self.inv, run, remote, hosts=self.hosts, redact=self.redact, say=self.say,
                         warn=self.warn).watch()

    def stop(self, *, now: bool = False) -> dict[str, str]:
        """Ends the job (see :func:`stop`), and its watcher first: each node's answer; a RemoteFailure
        where one did not."""
        with self.connected() as remote:
            results = stop(self.inv, remote, now=now, say=self.say)
        if not all(r.ok for r in results.values()):
            raise RemoteFailure("stop", results, hint="stop it there by hand once reachable, or run stop again")
        return {n: self.redact(r.stdout.strip()) for n, r in results.items()}
