"""Slurm (hosts.yaml's ``slurm:``): the engine whose verbs talk to the login node only; Slurm
starts, watches and ends the job (deploy/engines/engine.py is the interface). The commands are data in
``slurm.py``; here they run and their output is shown."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace

import click

from ..checks.preflight import Check
from ..errors import InputError, RemoteFailure, RuntimeFailure
from ..job import codesync, plan, record, runs, runtime, secretenv
from ..job.payload import payload
from ..nodes.remote import Remote
from ..observe import doctor, view
from ..text import safe
from . import fleet, render, slurm
from .engine import Engine


def _login(inv) -> str:
    return inv.slurm.login.name


def _on_login(remote, inv, argv, what: str, *, timeout: float = 60, stdin: bytes | None = None):
    name = _login(inv)
    got = remote.run({name: argv}, check=False, timeout=timeout,
                     stdin=None if stdin is None else {name: stdin})[name]
    if not got.ok:
        raise RemoteFailure(what, {name: got}, hint=f"check the login node ({inv.slurm.login.address}): "
                                                    "`ddp-deploy check`")
    return got


def _checks(inv, remote) -> list[Check]:
    """The login node: Slurm's commands, the partition up, the shared directories, the interpreter."""
    name = _login(inv)
    got = _on_login(remote, inv, slurm.check_argv(inv), "check")
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


def _state(inv, remote, redact=str) -> slurm.SlurmState:
    return secretenv.masked(slurm.parse_status(_on_login(remote, inv, slurm.status_argv(inv), "status").stdout), redact)


def _follow(inv, remote, timeout, redact, every: float = 10.0) -> slurm.SlurmState:
    """Polls the job until Slurm is done with it: a line when its state changes, else at most every
    ``every`` seconds while its progress moves."""
    deadline = None if timeout is None else time.monotonic() + timeout
    said, state, at = None, None, 0.0
    diagnosed, probed = False, None
    while True:
        s = _state(inv, remote, redact)
        line = _line(s)
        if s.state != state or (line != said and time.monotonic() - at >= every):
            click.echo(line)
            said, state, at = line, s.state, time.monotonic()
        if not s.active:
            return s
        if probed is None or time.monotonic() - probed >= slurm.PROGRESS_EVERY_S:
            probed = time.monotonic()
            stalled = {n: v.stall for n, v in _node_states(inv, remote, s, redact).items() if v.stall}
            if stalled and not diagnosed:  # once per stall: where it stopped, then what every rank is doing
                click.echo(safe(f"stalled: {', '.join(f'{n} {view.stall_text(v)}' for n, v in stalled.items())}; "
                                f"{_diagnose(inv, remote, s, redact).summary} (`ddp-deploy doctor` shows each rank)"))
            diagnosed = bool(stalled)
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeFailure(f"still in Slurm after {timeout:g} s: job {s.job_id} {s.state}",
                                 hint="follow with `ddp-deploy status`, end it with `ddp-deploy stop`")
        time.sleep(2)


def _line(s: slurm.SlurmState) -> str:
    why = f" ({s.reason})" if s.reason and s.state == "PENDING" else ""
    metrics = next((n.metrics for n in s.nodes.values() if n.metrics), "")
    cells = view.Progress.from_line(metrics).cells()
    shown = "  ".join(f"{k} {v}" for k, v in cells.items() if v != "-")
    return safe(f"Slurm job {s.job_id}: {s.state}{why}" + (f"  {shown}" if shown else ""))


def _verdict(inv, remote, s: slurm.SlurmState, redact) -> None:
    stalled = [n for n, r in s.nodes.items() if r.stall_stopped]
    if stalled:  # each node's launcher ended its part with 0 on the stall: Slurm says COMPLETED
        raise fleet.stalled_and_stopped(inv, remote, stalled, redact)
    if s.ok and all(n.exits and n.exits[-1][1] == 0 for n in s.nodes.values()):
        click.echo(f"Slurm job {s.job_id} COMPLETED: all nodes finished with exit code 0")
        return
    first = _first_failure(inv, remote, s, redact)
    raise RuntimeFailure(f"Slurm job {s.job_id} ended {s.state}" + (f" (exit {s.exit_code})" if s.exit_code else "")
                         + (f": {first.describe()}" if first else ""),
                         hint=f"`ddp-deploy logs --run {s.run}` shows the rest; the batch script's own output is "
                              f"in {runs.runs_dir(inv)}/{s.run}/slurm-{s.job_id}.out")


def _first_failure(inv, remote, s: slurm.SlurmState, redact):
    return fleet.kept_failure(inv, remote, _login(inv), s.run, fleet.witnesses({n: r.state() for n, r in s.nodes.items()}),
                         redact)


_HEADER = re.compile(r"^==> (.*)/([^/]+)/log <==$")


def _node_states(inv, remote, s: slurm.SlurmState, redact, warn=None) -> dict[str, plan.NodeState]:
    """Each node's state: how it ended, as kept in the run's directory; while the job runs, its
    progress read on the node itself (a step beside the job's: its heartbeats, its log's age),
    judged against job.stall_timeout as on the SSH fleet."""
    states = {n: r.state() for n, r in s.nodes.items() if r.exits or not s.active}
    running = [n for n in s.nodes if n not in states]
    if not running:
        return states
    seen = {}
    if s.state == "RUNNING":
        got = remote.run({_login(inv): slurm.progress_argv(inv, s.job_id, s.run)}, check=False,
                         timeout=slurm.ON_NODES_S + 15)[_login(inv)]
        seen = slurm.by_node(got.stdout)
        if warn is not None and not all(n in seen for n in running):
            warn(safe(redact(f"warning: progress not read on {', '.join(n for n in running if n not in seen)} "
                             f"({got.summary() if not got.ok else 'no answer'}): a stall there is not shown")))
    for n in running:
        found = plan.parse_status("running\n" + seen[n]) if n in seen else plan.NodeState("running")
        found = replace(found, metrics=s.nodes[n].metrics)
        states[n] = secretenv.masked(plan.with_stall(found, inv.job.stall_timeout), redact)
    return states


def _diagnose(inv, remote, s: slurm.SlurmState, redact) -> doctor.Diagnosis:
    """Every node's workers and their stacks (deploy/observe/doctor.py), read by a step beside the job's."""
    if s.state != "RUNNING":
        raise RuntimeFailure(f"doctor: Slurm job {s.job_id} is {s.state}: no rank runs" if s.job_id else
                             f"doctor: {inv.job.name} was never submitted",
                             hint="`ddp-deploy status --run ID` shows the stacks kept at a stall of a run that ended")
    got = remote.run({_login(inv): slurm.diagnose_argv(inv, s.job_id)}, check=False,
                     timeout=slurm.ON_NODES_S + 15)[_login(inv)]
    found = slurm.by_node(got.stdout)
    ranks = [r for n, text in found.items() for r in doctor.parse(n, redact(text))]
    why = redact(got.summary()) if not got.ok else "no answer from its task"
    silent = {n: why for n in s.nodes if n not in found} if s.nodes else {}
    return doctor.diagnose(ranks, silent, inv.slurm.nodes * inv.slurm.nprocs)


class Slurm(Engine):
    """The verbs on a Slurm inventory: each talks to the login node only; Slurm starts, watches
    and ends the job."""

    name = "Slurm"
    limits = {"join": "Slurm allocates the nodes; a requeued job comes back on its own",
              "unlock": "there is no fleet lock: Slurm queues the job"}

    @classmethod
    def serves(cls, inv) -> bool:
        return inv.slurm is not None

    def validate(self) -> None:
        inv = self.inv
        s = inv.slurm
        click.echo(f"{self.st.hosts}: ok: job {inv.job.name}, runtime {inv.job.runtime}, Slurm: {s.nodes} nodes x "
                   f"{s.nprocs} processes{f' on partition {s.partition}' if s.partition else ''}, "
                   f"login {s.login.address}")

    def check(self, network: bool, network_mb: float) -> None:
        inv = self.inv
        if network:
            raise InputError("check --network: not on Slurm (the nodes are known once the job runs)",
                             hint="run the job; its first step's all-reduce is the network's test")
        secretenv.resolve(inv)
        with Remote(inv) as remote:
            checks = _checks(inv, remote)
        render.print_checks(checks)
        fleet.refuse_failed_checks(checks, "")
        click.echo(f"all {len(checks)} checks passed")

    def deploy(self, dry_run: bool, build: bool) -> None:
        inv = self.inv
        argv = plan.make_dirs_argv(inv)
        where = ("the site's runtime opens slurm.container.image " + inv.slurm.container.image
                 if inv.slurm.container else f"{inv.python_path()} must import trainer and torch (shared venv)")
        if dry_run:
            render.show(_login(inv), argv)
            click.echo(f"[{_login(inv)}] {where}")
            return
        with Remote(inv) as remote:
            _on_login(remote, inv, argv, "deploy")
            click.echo(f"{_login(inv)}: directories ready in {inv.storage.checkpoints.host}, {inv.storage.data.host}")
            if inv.slurm.container is None:
                py = _on_login(remote, inv, plan.python_check_argv(inv), "deploy", timeout=120)
                click.echo(f"{_login(inv)}: {inv.python_path()}: torch {py.stdout.strip()}")
            else:
                click.echo(f"{_login(inv)}: {where}")

    def launch(self, dry_run: bool, wait: bool, timeout: float | None) -> None:
        inv = self.inv
        secrets = secretenv.resolve(inv)
        snap = codesync.snapshot_of(inv)
        if dry_run:
            login = _login(inv)
            click.echo(f"[{login}] the batch script below, kept as {slurm.script_path(inv, 'RUN_ID')}; submitted with "
                       f"`sbatch --parsable` there" + (f", with {', '.join(secrets)} in its environment (never in the "
                                                       "script)" if secrets else ""))
            click.echo(slurm.batch_script(inv, "RUN_ID", codesync.code_dir(inv, snap)))
            return
        with Remote(inv) as remote:
            now = _state(inv, remote, self.st.redact)
            if now.active:
                raise RuntimeFailure(f"a previous run of {inv.job.name} is still in Slurm: job {now.job_id} {now.state}",
                                     hint="run `ddp-deploy stop` first; two runs never share a rendezvous")
            code = fleet.sync_code(inv, remote, snap, render.say, nodes=[_login(inv)])
            checks = _checks(inv, remote)
            failed = [c for c in checks if not c.ok]
            if failed:
                render.print_checks(failed)
            fleet.refuse_failed_checks(failed, "launch refused, nothing submitted: ")
            run = runs.new_id()
            fleet.start_run(inv, remote, run, record.launch_record(inv, code, run, None, self.st.redact), render.say, render.warn)
            _on_login(remote, inv, slurm.write_argv(slurm.script_path(inv, run)), "launch",
                      stdin=slurm.batch_script(inv, run, code).encode())
            got = _on_login(remote, inv, slurm.submit_argv(inv, run), "launch (sbatch)",
                            stdin=secretenv.stdin_lines(secrets) if secrets else b"")
            job_id = got.stdout.strip().splitlines()[-1]
            s = inv.slurm
            click.echo(f"submitted {inv.job.name} run {run} as Slurm job {job_id} ({s.nodes} nodes x {s.nprocs} "
                       f"processes): {payload(inv).describe()}" + (f", code snapshot {code.snapshot[:12]}" if code else ""))
            if wait:
                _verdict(inv, remote, _follow(inv, remote, timeout, self.st.redact), self.st.redact)

    def status(self, as_json: bool, follow: bool, run_id: str | None) -> None:
        inv = self.inv
        with Remote(inv) as remote:
            if run_id is not None:
                render.kept_status(inv, remote, run_id, as_json, self.st.redact)
                return
            if follow:
                _verdict(inv, remote, _follow(inv, remote, None, self.st.redact), self.st.redact)
                return
            s = _state(inv, remote, self.st.redact)
            first = _first_failure(inv, remote, s, self.st.redact) if not s.active else None
            states = _node_states(inv, remote, s, self.st.redact, warn=lambda line: click.echo(line, err=True))
        if as_json:
            import json
            from dataclasses import asdict

            click.echo(json.dumps({"slurm_job": s.job_id, "run": s.run, "state": s.state, "reason": s.reason,
                                   "exit_code": s.exit_code, "elapsed": s.elapsed, "nodelist": s.nodelist,
                                   "requeued": s.restarts,
                                   "nodes": [view.as_data(n, inv.slurm.nprocs, v) for n, v in states.items()],
                                   "first_failure": asdict(first) if first else None}))
            return
        if s.job_id is None:
            click.echo(f"{inv.job.name}: never submitted (ddp-deploy launch)")
            return
        click.echo(safe(f"{inv.job.name} run {s.run}: Slurm job {s.job_id} {s.state}"
                        + (f" ({s.reason})" if s.reason else "") + (f", exit {s.exit_code}" if s.exit_code else "")
                        + (f", {s.elapsed}" if s.elapsed else "") + (f" on {s.nodelist}" if s.nodelist else "")
                        + (f", requeued {s.restarts}x" if s.restarts else "")))
        if states:
            render.out.print(view.table(inv.job.name, {n: inv.slurm.nprocs for n in states}, states))
        if first:
            click.echo(f"first failure: {first.describe()}")

    def doctor(self, as_json: bool) -> None:
        inv = self.inv
        with Remote(inv) as remote:
            found = _diagnose(inv, remote, _state(inv, remote, self.st.redact), self.st.redact)
        render.show_diagnosis(found, as_json)

    def logs(self, follow: bool, tail: int | None, only_nodes: tuple[str, ...], only_ranks: tuple[int, ...],
             run_id: str | None) -> None:
        """Every node's log of the job's run (or a kept one), read on the login node from the run's
        directory: ``tail`` over all of them, its file headers telling the nodes apart."""
        inv = self.inv
        with Remote(inv) as remote:
            if run_id is not None:
                kept = fleet.kept_run(inv, remote, run_id, self.st.redact, "logs --run")[1]
                run, nodes = kept.id, list(kept.nodes)
            else:
                s = _state(inv, remote, self.st.redact)
                if s.job_id is None:
                    raise RuntimeFailure(f"{inv.job.name} was never submitted", hint="`ddp-deploy launch` first")
                run, nodes = s.run, list(s.nodes)
                if not nodes:
                    click.echo(f"no output yet: Slurm job {s.job_id} is {s.state}" + (f" ({s.reason})" if s.reason else ""))
                    return
            unknown = sorted(set(only_nodes) - set(nodes))
            if unknown:
                raise InputError(f"--node {', '.join(unknown)}: not a node of run {run} ({', '.join(nodes)})")
            nodes = [n for n in nodes if not only_nodes or n in only_nodes]
            paths = [f"{runtime.kept_dir(inv, run, n)}/log" for n in nodes]
            argv = ["tail", "-v", "-n", "+1" if tail is None else str(tail), *(["-F"] if follow else []), *paths]
            width = max(len(view.log_label(n, inv.slurm.nodes * inv.slurm.nprocs - 1)) for n in nodes)
            lock = threading.Lock()
            current = {"node": nodes[0]}

            def emit(_login_name: str, line: str) -> None:
                head = _HEADER.match(line)
                if head:
                    current["node"] = head.group(2)
                    return
                if not line and not follow:
                    return
                rank, text = view.split_rank(line)
                if only_ranks and rank not in only_ranks:
                    return
                with lock:
                    click.echo(safe(self.st.redact(f"{view.log_label(current['node'], rank):<{width}} | {text}")))

            full = ("sh", "-c", runtime.MERGE_STDERR, "sh", *argv)
            results = remote.stream({_login(inv): full}, emit)  # line by line: none of the logs held here
        if not all(r.ok for r in results.values()):
            raise RemoteFailure("logs", results, hint="no output on the shared volume yet, or the login node is unreachable")

    def stop(self, dry_run: bool, now: bool) -> None:
        inv = self.inv
        grace = 0 if now else runtime.STOP_GRACE_S
        argv = slurm.stop_argv(inv, grace)
        if dry_run:
            render.show(_login(inv), argv)
            return
        with Remote(inv) as remote:
            got = _on_login(remote, inv, argv, "stop", timeout=grace + 120)
        click.echo(safe(self.st.redact(f"{_login(inv)}: {got.stdout.strip()}")))

    def running(self, remote: Remote) -> bool:
        """Whether the job's newest run is in Slurm still (``runs``)."""
        return _state(self.inv, remote).active

    def batch_script(self) -> str:
        """The batch script ``launch`` would submit (its run id: RUN_ID)."""
        return slurm.batch_script(self.inv, "RUN_ID", codesync.code_dir(self.inv, codesync.snapshot_of(self.inv)))


__all__ = ["Slurm"]
