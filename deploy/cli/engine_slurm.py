"""Slurm (hosts.yaml's ``slurm:``): the engine whose verbs talk to the login node only; Slurm
starts, watches and ends the job (deploy/cli/engine.py is the interface). The commands are data in
``slurm.py``, the procedures ``slurmjob.py``'s; here each verb calls and shows them."""

from __future__ import annotations

import threading

import click

from ..engines import fleet, slurm
from ..engines import slurmjob as job
from ..errors import InputError
from ..job import plan, runtime, secretenv
from ..nodes.remote import Remote
from ..observe import view
from ..text import safe
from . import render
from .engine import Engine


class SlurmCommands(Engine):
    """The verbs on a Slurm inventory: each talks to the login node only; Slurm starts, watches
    and ends the job."""

    name = "Slurm"
    limits = {"join": "Slurm allocates the nodes; a requeued job comes back on its own",
              "unlock": "there is no job lock: Slurm queues the job",
              "jobs": "Slurm keeps the jobs of its nodes: squeue lists them",
              "watch": "Slurm requeues a job whose node fails (slurm.requeue)"}

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
            checks = job.login_checks(inv, remote)
        render.print_checks(checks)
        fleet.refuse_failed_checks(checks, "")
        click.echo(f"all {len(checks)} checks passed")

    def deploy(self, dry_run: bool, build: bool, wait_lock: float = 0.0) -> None:  # no lock: Slurm queues
        inv = self.inv
        if dry_run:
            render.show(job.login(inv), plan.make_dirs_argv(inv))
            where = ("the site's runtime opens slurm.container.image " + inv.slurm.container.image
                     if inv.slurm.container else f"{inv.python_path()} must import the node agent and torch (shared venv)")
            click.echo(f"[{job.login(inv)}] {where}")
            return
        with Remote(inv) as remote:
            job.deploy(inv, remote, click.echo)

    def launch(self, dry_run: bool, wait: bool, timeout: float | None, wait_lock: float = 0.0) -> None:
        inv = self.inv
        secrets = secretenv.resolve(inv)
        if dry_run:
            login = job.login(inv)
            click.echo(f"[{login}] the batch script below, kept as {slurm.script_path(inv, plan.DRY_RUN)}; submitted with "
                       f"`sbatch --parsable` there" + (f", with {', '.join(secrets)} in its environment (never in the "
                                                       "script)" if secrets else ""))
            click.echo(job.dry_run_script(inv))
            return
        with Remote(inv) as remote:
            submitted = job.submit(inv, remote, redact=self.st.redact, say=render.say, warn=render.warn,
                                   failed_checks=render.print_checks)
            click.echo(submitted.describe())
            if wait:
                click.echo(job.verdict(inv, remote, job.follow(inv, remote, timeout, self.st.redact, render.say,
                                                               first_step=True), self.st.redact))

    def status(self, as_json: bool, follow: bool, run_id: str | None) -> None:
        inv = self.inv
        with Remote(inv) as remote:
            if run_id is not None:
                render.kept_status(inv, remote, run_id, as_json, self.st.redact, lambda: self.running(remote))
                return
            if follow:
                click.echo(job.verdict(inv, remote, job.follow(inv, remote, None, self.st.redact, render.say),
                                       self.st.redact))
                return
            s = job.job_state(inv, remote, self.st.redact)
            first = job.first_failure(inv, remote, s, self.st.redact) if not s.active else None
            states = job.node_states(inv, remote, s, self.st.redact, warn=render.warn)
            # a stall named where it is shown: the culprit's node, rank and frame (deploy/observe/doctor.py)
            why = job.diagnose(inv, remote, s, self.st.redact).summary if any(v.stall for v in states.values()) \
                else None
        untrained = fleet.nothing_trained(states) if not s.active else None
        if as_json:
            import json
            from dataclasses import asdict

            click.echo(json.dumps({"slurm_job": s.job_id, "run": s.run, "state": s.state, "reason": s.reason,
                                   "exit_code": s.exit_code, "elapsed": s.elapsed, "nodelist": s.nodelist,
                                   "requeued": s.restarts,
                                   "nodes": [view.as_data(n, inv.slurm.nprocs, v) for n, v in states.items()],
                                   "first_failure": asdict(first) if first else None,
                                   "stall_diagnosis": why, "nothing_trained": untrained}))
            return
        if s.job_id is None:
            click.echo(f"{inv.job.name}: never submitted (ddp-deploy launch)")
            return
        click.echo(safe(f"{inv.job.name} run {s.run}: Slurm job {s.job_id} {s.state}"
                        + (f" ({s.reason})" if s.reason else "") + (f", exit {s.exit_code}" if s.exit_code else "")
                        + (f", {s.elapsed}" if s.elapsed else "") + (f" on {s.nodelist}" if s.nodelist else "")
                        + (f", requeued {s.restarts}x" if s.restarts else "")))
        if states:
            render.out.print(render.states_table(inv.job.name, {n: inv.slurm.nprocs for n in states}, states))
        render.print_findings(why, first, untrained)

    def doctor(self, as_json: bool) -> None:
        inv = self.inv
        with Remote(inv) as remote:
            found = job.diagnose(inv, remote, job.job_state(inv, remote, self.st.redact), self.st.redact)
        render.show_diagnosis(found, as_json)

    def logs(self, follow: bool, tail: int | None, only_nodes: tuple[str, ...], only_ranks: tuple[int, ...],
             run_id: str | None) -> None:
        inv = self.inv
        printing = threading.Lock()
        width = {"of": 0}

        def reading(nodes: list[str]) -> None:
            width["of"] = max(len(view.log_label(n, inv.slurm.nodes * inv.slurm.nprocs - 1)) for n in nodes)

        def show(line) -> None:
            with printing:
                click.echo(safe(f"{view.log_label(line.node, line.rank):<{width['of']}} | {line.text}"))

        with Remote(inv) as remote:
            job.read_logs(inv, remote, show, run_id=run_id, nodes=only_nodes, ranks=only_ranks, tail=tail,
                          follow=follow, redact=self.st.redact, say=click.echo, reading=reading)

    def stop(self, dry_run: bool, now: bool) -> None:
        inv = self.inv
        if dry_run:
            render.show(job.login(inv), slurm.stop_argv(inv, 0 if now else runtime.STOP_GRACE_S))
            return
        with Remote(inv) as remote:
            said = job.stop(inv, remote, now=now, redact=self.st.redact)
        click.echo(safe(f"{job.login(inv)}: {said}"))

    def running(self, remote: Remote) -> bool:
        """Whether the job's newest run is in Slurm still (``runs``)."""
        return job.job_state(self.inv, remote).active

    def batch_script(self) -> str:
        """The batch script ``launch`` would submit (its run id: RUN_ID)."""
        return job.dry_run_script(self.inv)


__all__ = ["SlurmCommands"]
