"""The SSH fleet (hosts.yaml's ``nodes:``): the engine whose verbs reach every node over SSH and
run the job there, in Docker or on the host (deploy/cli/engine.py is the interface). The procedures
are deploy/engines/fleet/'s, their rendering deploy/cli/render.py's; here each verb calls and shows them."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict

import click

from ..checks import netcheck
from ..engines import fleet
from ..errors import InputError, RemoteFailure, RuntimeFailure
from ..images import prepare
from ..job import codesync, healing, launchplan, lock, phases, plan, record, runtime, secretenv
from ..nodes.remote import Remote
from ..observe import view
from ..text import safe
from . import render
from .build_view import TerminalView
from .engine import Engine


class FleetCommands(Engine):
    name = "the SSH fleet"

    @classmethod
    def serves(cls, inv) -> bool:
        return inv.slurm is None

    def validate(self) -> None:
        inv = self.inv
        procs = sum(n.nprocs for n in inv.nodes)
        spares = f" and {len(inv.spares)} spare{'s' if len(inv.spares) > 1 else ''}" if inv.spares else ""
        click.echo(f"{self.st.hosts}: ok: job {inv.job.name}, runtime {inv.job.runtime}, {len(inv.nodes)} nodes{spares}, "
                   f"{procs} processes, rendezvous {inv.rdzv_node.address}:{inv.rendezvous.port}")

    def check(self, network: bool, network_mb: float) -> None:
        inv = self.inv
        with Remote(inv) as remote:
            pre = fleet.check(inv, remote, render.say, for_launch=network)  # --network needs the image there
            render.print_checks(pre.checks)
            fleet.refuse_failed_checks(pre.checks, "")
            click.echo(f"all {len(pre.checks)} checks passed")
            if network:
                report = netcheck.run(inv, remote, pre.facts, network_mb)
        if network:
            render.print_network(report)
            slow = report.get("slow") or []
            if slow:
                raise RuntimeFailure(f"network: {', '.join(slow)} much slower than the other nodes "
                                     f"({netcheck.describe_slow(report)})",
                                     hint="check that node's link, cabling and interface (nodes[].interface)")

    def deploy(self, dry_run: bool, build: bool, wait_lock: float = 0.0) -> None:
        inv = self.inv
        if dry_run:
            every = inv.and_spares()  # the spares are made ready as the nodes are
            click.echo(f"[all] {lock.describe(every, 'deploy')}, held while deploy runs")
            for line in prepare.deployer(every).dry_run(build):
                click.echo(line)
            return
        with Remote(inv) as remote:
            # a partial `docker load` registers no image: the ID check sees none
            fleet.deploy(inv, remote, hosts=self.st.hosts, build=build, say=click.echo, warn=render.warn,
                         wait_lock=wait_lock, build_view=TerminalView(),
                         shipping=render.shipping,
                         interrupted=lambda: click.echo("interrupted: a node whose load had not finished keeps the "
                                                        "image it had; `ddp-deploy deploy` ships the image to it "
                                                        "again", err=True))

    def launch(self, dry_run: bool, wait: bool, timeout: float | None, wait_lock: float = 0.0) -> None:
        inv = self.inv
        if dry_run:
            click.echo(launchplan.dry_run(inv))
            return
        with Remote(inv) as remote:
            started = fleet.launch(inv, remote, hosts=self.st.hosts, redact=self.st.redact, say=render.say, warn=render.warn,
                                   wait_lock=wait_lock,
                                   failed_checks=render.print_checks)
            click.echo(started.describe())
            click.echo(f"launch {phases.describe(started.phases)}")
            if inv.heal.watch:
                self._start_watcher(started.run)
            if not wait:
                return
            final = render.follow(inv, remote, timeout, self.st.redact, run=started.run)
            click.echo(fleet.verdict(inv, final, remote, self.st.redact))

    def join(self, node: str, dry_run: bool) -> None:
        inv = self.inv
        fleet.joinable(inv, node)
        secretenv.resolve(inv)
        if dry_run:
            snap = codesync.snapshot_of(inv)
            click.echo(f"[{node}] the running job's rendezvous node and size are read from its launch record "
                       f"{record.path(inv)}; shown here as hosts.yaml has them")
            click.echo(f"[{node}] the launch's preflight checks on {node} alone first; it must see that record and "
                       "reach the running job's rendezvous store")
            render.show(node, plan.launch_spec(inv, fleet.node_index(inv, node), code=codesync.code_dir(inv, snap)).argv)
            return
        with Remote(inv) as remote:
            joined = fleet.join(inv, remote, node, hosts=self.st.hosts, redact=self.st.redact, say=render.say,
                                warn=render.warn, failed_checks=render.print_checks)
        click.echo(joined.describe())

    def status(self, as_json: bool, follow: bool, run_id: str | None) -> None:
        inv = self.inv
        if follow and (as_json or run_id):
            raise InputError(f"status: --follow and {'--json' if as_json else '--run'} do not go together",
                             hint="poll `status --json` instead" if as_json else "a kept run has ended: drop --follow")
        with Remote(inv) as remote:
            if run_id is not None:
                render.kept_status(inv, remote, run_id, as_json, self.st.redact, lambda: self.running(remote))
                return
            if follow:
                click.echo(fleet.verdict(inv, render.follow(inv, remote, None, self.st.redact), remote, self.st.redact))
                return
            states = fleet.node_states(inv, remote, self.st.redact)
            watcher = fleet.watcher_of(inv, remote, states) if inv.heal.watch else None
            first = fleet.first_failure(inv, remote, fleet.witnesses(states), self.st.redact)
            # a stall named where it is shown: the culprit's node, rank and frame (deploy/observe/doctor.py)
            why = fleet.diagnose(inv, remote, self.st.redact).summary if any(s.stall for s in states.values()) else None
        untrained = fleet.nothing_trained(states)
        if as_json:
            click.echo(json.dumps([{**view.as_data(n, inv.node(n).nprocs, s),
                                    "formed": s.formed, "stopped": s.stop.as_data() if s.stop else None,
                                    "first_failure": asdict(first) if first and first.node == n else None,
                                    "stall_diagnosis": why if s.stall else None}
                                   for n, s in states.items()]))
        else:
            render.print_status(inv, states)
            render.print_findings(why, first, untrained)
            if watcher is not None:
                click.echo(safe(self.st.redact(watcher.describe(time.time()))))

    def watch(self, run_id: str | None, detach: bool) -> None:
        inv = self.inv
        if not inv.heal.watch:
            raise InputError("watch: heal.watch is not set in hosts.yaml",
                             hint="set heal.watch: true (docs/failures.md, \"A job that heals itself\"); then "
                                  "`ddp-deploy launch` starts the watcher with the job")
        from ..inventory import load

        with Remote(load(self.st.hosts).and_spares()) as remote:  # the nodes left out too: one may come back
            run = run_id or fleet.current_run(inv, remote)
            if detach:
                self._start_watcher(run)
                return
            stamped = lambda line: render.say(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}")  # noqa: E731
            outcome, said = fleet.Watch(inv, run, remote, hosts=self.st.hosts, redact=self.st.redact, say=stamped,
                                        warn=render.warn).watch()
        stamped(f"the watch ended ({outcome or 'taken over'}): {said}")
        if outcome in (healing.FAILED, healing.NOT_HEALED):
            raise click.exceptions.Exit(1)

    def _start_watcher(self, run: str) -> None:
        click.echo(fleet.start_watcher(self.inv, self.st.hosts, run).describe())

    def doctor(self, as_json: bool) -> None:
        inv = self.inv
        with Remote(inv) as remote:
            found = fleet.diagnose(inv, remote, self.st.redact)
        render.show_diagnosis(found, as_json)

    def logs(self, follow: bool, tail: int | None, only_nodes: tuple[str, ...], only_ranks: tuple[int, ...],
             run_id: str | None) -> None:
        inv = self.inv
        printing = threading.Lock()
        with Remote(inv) as remote:
            reads = fleet.log_reads(inv, remote, run_id=run_id, nodes=only_nodes, tail=tail, follow=follow,
                                    redact=self.st.redact, warn=lambda line: click.echo(safe(line), err=True))
            width = max((len(view.log_label(n, sum(m.nprocs for m in inv.nodes) - 1)) for n in reads), default=0)

            def show(line: fleet.LogLine) -> None:
                with printing:
                    click.echo(safe(f"{view.log_label(line.node, line.rank):<{width}} | {line.text}"))

            fleet.read_logs(remote, reads, show, follow=follow, ranks=only_ranks, redact=self.st.redact)

    def stop(self, dry_run: bool, now: bool) -> None:
        inv = self.inv
        if dry_run:
            grace, every = 0 if now else runtime.STOP_GRACE_S, inv.and_spares()
            for n in every.nodes:
                render.show(n.name, plan.stop_argv(every, n, grace))
            return
        with Remote(inv) as remote:
            results = fleet.stop(inv, remote, now=now, say=render.say)
        for n, r in results.items():
            click.echo(safe(self.st.redact(f"{n}: {r.stdout.strip() if r.ok else r.summary()}")))  # quotes the program
        if not all(r.ok for r in results.values()):
            raise RemoteFailure("stop", results, hint="stop it there by hand once reachable, or run stop again")

    def unlock(self, force: bool) -> None:
        with Remote(self.inv) as remote:
            done = fleet.unlock(self.inv, remote, force=force)
        for n, line in done.lines.items():
            click.echo(safe(f"{n}: {line}"))
        refused = done.refusal()
        if refused:
            raise refused

    def jobs(self, as_json: bool) -> None:
        with Remote(self.inv) as remote:
            found = fleet.jobs(self.inv, remote)
        if as_json:
            click.echo(json.dumps({"jobs": [{**asdict(j), "state": j.state} for j in found.jobs],
                                   "unanswered": found.unanswered}))
        else:
            render.jobs_table(found)
        if found.unanswered:
            said = "; ".join(f"{n}: {why}" for n, why in found.unanswered.items())
            raise RuntimeFailure(f"jobs: not known on {', '.join(found.unanswered)} ({said})",
                                 hint="the jobs shown are those of the nodes that answered")

    def running(self, remote: Remote) -> bool:
        return any(s.running for s in fleet.node_states(self.inv, remote, self.st.redact).values())


__all__ = ["FleetCommands"]
