"""The SSH fleet (hosts.yaml's ``nodes:``): the engine whose verbs reach every node over SSH and
run the job there, in Docker or on the host (deploy/engines/engine.py is the interface). The procedures
are deploy/engines/fleet.py's, their rendering deploy/engines/render.py's; here each verb calls and shows them."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict

import click

from ..checks import netcheck, preflight
from ..errors import InputError, RemoteFailure, RuntimeFailure
from ..images import prepare
from ..job import codesync, lock, phases, plan, record, runs, runtime, secretenv
from ..job.payload import payload
from ..nodes.remote import Remote
from ..observe import view
from ..text import safe
from . import fleet, render
from .engine import Engine


class SshFleet(Engine):
    name = "the SSH fleet"

    @classmethod
    def serves(cls, inv) -> bool:
        return inv.slurm is None

    def validate(self) -> None:
        inv = self.inv
        procs = sum(n.nprocs for n in inv.nodes)
        click.echo(f"{self.st.hosts}: ok: job {inv.job.name}, runtime {inv.job.runtime}, {len(inv.nodes)} nodes, "
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

    def deploy(self, dry_run: bool, build: bool) -> None:
        inv = self.inv
        steps = prepare.deployer(inv)
        if dry_run:
            click.echo(f"[all] {lock.describe()}, held while deploy runs")
            for line in steps.dry_run(build):
                click.echo(line)
            return
        with Remote(inv) as remote, lock.held(inv, remote, "deploy", self.st.hosts, warn=render.warn) as fleet_lock:
            def ship(image_id, held):
                # The build takes minutes: an `unlock --force` meanwhile may have let another operator in.
                fleet_lock.confirm("deploy", "no image was shipped")
                return render.ship_with_progress(inv, remote, image_id, held)

            try:
                steps.run(remote, click.echo, build=build, ship=ship)
            except KeyboardInterrupt:  # a partial `docker load` registers no image: the ID check sees none
                click.echo("interrupted: a node whose load had not finished keeps the image it had; "
                           "`ddp-deploy deploy` ships the image to it again", err=True)
                raise

    def launch(self, dry_run: bool, wait: bool, timeout: float | None) -> None:
        inv = self.inv
        if dry_run:
            secrets = secretenv.resolve(inv)
            snap = codesync.snapshot_of(inv)
            click.echo(f"[all] program: {payload(inv).describe()}")
            if snap is not None:
                click.echo(f"[all] code: {snap.root} ({len(snap.files)} files, {fleet.size(snap.size)}) as snapshot "
                           f"{snap.id} in {codesync.store_dir(inv)}; each node gets the files its store lacks")
            for name in secrets:
                click.echo(f"[all] secret {name}={secretenv.MASK} (from {secretenv.source(inv, name)}), on the start "
                           "command's stdin")
            click.echo(f"[all] {lock.describe()}, held until the job has started")
            click.echo("[all] the preflight checks of `ddp-deploy check` first; any failure starts nothing")
            click.echo(f"[all] a new run id (RUN_ID below); its record, logs and exit codes kept in {runs.runs_dir(inv)}"
                       f"/RUN_ID, the newest {inv.job.keep_runs} runs (job.keep_runs)")
            for s in plan.launch_plan(inv, code=codesync.code_dir(inv, snap)):
                node = inv.node(s.node)
                render.show(s.node, s.argv)
                if node.interface is None:
                    click.echo(f"[{s.node}] GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME: the interface holding "
                               f"{node.address}, detected at launch")
                for note in runtime.runtime(inv).dry_run_notes(node):
                    click.echo(f"[{s.node}] {note}")
            return
        with Remote(inv) as remote:
            started = fleet.launch(inv, remote, hosts=self.st.hosts, redact=self.st.redact, say=render.say, warn=render.warn,
                                   failed_checks=render.print_checks)
            click.echo(started.describe())
            click.echo(f"launch {phases.describe(started.phases)}")
            if not wait:
                return
            final = render.follow(inv, remote, timeout, self.st.redact)
            click.echo(fleet.verdict(inv, final, remote, self.st.redact))

    def join(self, node: str, dry_run: bool) -> None:
        inv = self.inv
        inv.check_names("join NODE", {node})
        if not inv.elastic:
            raise InputError(f"join: job {inv.job.name} has a fixed size (job.min_nodes is not set below the "
                             f"{inv.listed} nodes listed): no node can join it while it runs",
                             hint="`ddp-deploy stop`, then `ddp-deploy launch` runs it on every node")
        secrets = secretenv.resolve(inv)
        snap = codesync.snapshot_of(inv)
        if dry_run:
            click.echo(f"[{node}] the running job's rendezvous node and size are read from its launch record "
                       f"{record.path(inv)}; shown here as hosts.yaml has them")
            click.echo(f"[{node}] the launch's preflight checks on {node} alone first; it must see that record and "
                       "reach the running job's rendezvous store")
            render.show(node, plan.launch_spec(inv, fleet.node_index(inv, node), code=codesync.code_dir(inv, snap)).argv)
            return
        with Remote(inv) as remote, lock.held(inv, remote, "join", self.st.hosts, warn=render.warn):
            states = fleet.node_states(inv, remote, self.st.redact)
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
            at, text, joined, run = fleet.running_job(inv, remote, running[0], node)
            if not states[at.rdzv_node.name].running:
                raise RuntimeFailure(f"join refused, nothing started: {at.rdzv_node.name}, which hosts the running "
                                     f"job's rendezvous, does not run it ({states[at.rdzv_node.name].state})",
                                     hint="the job cannot take a node in without it: `ddp-deploy stop`, then "
                                          f"`ddp-deploy --without {at.rdzv_node.name} launch`")
            code = fleet.sync_code(at, remote, snap, render.say, nodes=[node])
            pre = preflight.join_checks(at, remote, node, (record.path(inv), text), code)
            if pre.failed:
                render.print_checks(pre.failed)
            fleet.refuse_failed_checks(pre.failed, "join refused, nothing started: ")
            spec = plan.launch_spec(at, fleet.node_index(at, node), pre.facts.get(node, plan.NodeFacts()), code, run)
            if mine.exists:  # its finished run (restarts run out): its checkpoints stay on the shared volume
                remote.run({node: plan.stop_argv(at, at.node(node))}, check=True, timeout=120)
            stdin = {node: secretenv.stdin_lines(secrets)} if secrets else None
            started = remote.run({node: spec.argv}, check=False, timeout=120, stdin=stdin)
            if not started[node].ok:
                fleet.undo_start(at, remote, [node])
                raise RemoteFailure("join", started, hint="nothing else changed: the job runs on as it was")
        click.echo(f"{node} started: the job's nodes ({', '.join(joined)}) take it in at their next rendezvous round "
                   f"({at.rdzv_node.name}, {plan.endpoint(at)}); `ddp-deploy status` shows it training")

    def status(self, as_json: bool, follow: bool, run_id: str | None) -> None:
        inv = self.inv
        if follow and (as_json or run_id):
            raise InputError(f"status: --follow and {'--json' if as_json else '--run'} do not go together",
                             hint="poll `status --json` instead" if as_json else "a kept run has ended: drop --follow")
        with Remote(inv) as remote:
            if run_id is not None:
                render.kept_status(inv, remote, run_id, as_json, self.st.redact)
                return
            if follow:
                click.echo(fleet.verdict(inv, render.follow(inv, remote, None, self.st.redact), remote, self.st.redact))
                return
            states = fleet.node_states(inv, remote, self.st.redact)
            first = fleet.first_failure(inv, remote, fleet.witnesses(states), self.st.redact)
        if as_json:
            click.echo(json.dumps([{**view.as_data(n, inv.node(n).nprocs, s),
                                    "first_failure": asdict(first) if first and first.node == n else None}
                                   for n, s in states.items()]))
        else:
            render.print_status(inv, states)
            if first:
                click.echo(f"first failure: {first.describe()}")

    def doctor(self, as_json: bool) -> None:
        inv = self.inv
        with Remote(inv) as remote:
            found = fleet.diagnose(inv, remote, self.st.redact)
        render.show_diagnosis(found, as_json)

    def logs(self, follow: bool, tail: int | None, only_nodes: tuple[str, ...], only_ranks: tuple[int, ...],
             run_id: str | None) -> None:
        inv = self.inv
        inv.check_names("--node", set(only_nodes))
        nodes = [n for n in inv.nodes if not only_nodes or n.name in only_nodes]
        read = lambda n: plan.logs_argv(inv, n, tail=tail, follow=follow)  # noqa: E731
        if run_id is not None:
            with Remote(inv) as remote:
                run = fleet.kept_run(inv, remote, run_id, self.st.redact, "logs --run")[1]
            gone = [n for n in run.nodes if n not in {m.name for m in inv.nodes}]
            if gone:
                click.echo(safe(f"note: {', '.join(gone)} ran in {run.id} but not in hosts.yaml now: their logs are in "
                                f"{runs.runs_dir(inv)}/{run.id}"), err=True)
            nodes = [n for n in nodes if n.name in run.nodes]
            read = lambda n: runs.log_argv(inv, run.id, n.name, tail=tail, follow=follow)  # noqa: E731
        width = max((len(view.log_label(n.name, sum(m.nprocs for m in inv.nodes) - 1)) for n in nodes), default=0)
        printing = threading.Lock()

        def emit(node: str, line: str) -> None:
            rank, text = view.split_rank(line)
            if only_ranks and rank not in only_ranks:
                return
            with printing:
                click.echo(safe(self.st.redact(f"{view.log_label(node, rank):<{width}} | {text}")))

        cmds = {n.name: read(n) for n in nodes}
        with Remote(inv) as remote:
            if follow:
                results = remote.stream(cmds, emit)
            else:  # node after node, each line printed as it comes: a log can outgrow this machine's memory
                results = {}
                for n, argv in cmds.items():
                    results.update(remote.stream({n: argv}, emit))
        bad = {n: r for n, r in results.items() if not r.ok}
        if bad:
            raise RemoteFailure("logs", results, hint="no run on that node yet, or unreachable")

    def stop(self, dry_run: bool, now: bool) -> None:
        inv = self.inv
        if dry_run:
            grace = 0 if now else runtime.STOP_GRACE_S
            for n in inv.nodes:
                render.show(n.name, plan.stop_argv(inv, n, grace))
            return
        with Remote(inv) as remote:
            results = fleet.stop(inv, remote, now=now)
        for n, r in results.items():
            click.echo(safe(self.st.redact(f"{n}: {r.stdout.strip() if r.ok else r.summary()}")))  # quotes the program
        if not all(r.ok for r in results.values()):
            raise RemoteFailure("stop", results, hint="stop it there by hand once reachable, or run stop again")

    def unlock(self, force: bool) -> None:
        inv = self.inv
        with Remote(inv) as remote:
            seen = lock.survey(inv, remote)
            found = {n: s for n, s in seen.locks.items() if s is not None}
            live = [s for s in found.values() if s.stale() is None]
            if live and not force:
                raise RuntimeFailure(f"unlock refused, nothing removed: {live[0].describe()}, its heartbeat "
                                     f"{live[0].quiet} s ago", hint="that command still runs: wait for it to finish; "
                                     "--force only if you know it does not")
            removed = lock.remove(inv, remote, found)
        left = {n: r.summary() for n, r in seen.failed.items()}
        for n in (node.name for node in inv.nodes):
            s, r = found.get(n), removed.get(n)
            if n in seen.failed:
                click.echo(safe(f"{n}: {seen.failed[n].summary()}"))
            elif s is None or r.stdout.strip() == "gone":
                click.echo(f"{n}: no lock")
            elif r.stdout.strip() == "removed":
                click.echo(safe(f"{n}: removed the lock of {s.holder()} ({s.stale() or 'live, --force'})"))
            else:
                left[n] = "another lock was taken meanwhile" if r.ok else r.summary()
                click.echo(safe(f"{n}: {left[n]}"))
        if left:
            raise RuntimeFailure("unlock: not cleared on " + "; ".join(f"{n} ({why})" for n, why in left.items()),
                                 hint="run `ddp-deploy unlock` again once they answer")

    def running(self, remote: Remote) -> bool:
        return any(s.running for s in fleet.node_states(self.inv, remote, self.st.redact).values())


__all__ = ["SshFleet"]
