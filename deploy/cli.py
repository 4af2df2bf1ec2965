"""ddp-deploy: one small command per verb.

Library errors become one line per problem on stderr and an exit code (2: bad input,
1: a node failed); the full traceback goes only to the debug log (``DDP_DEPLOY_LOG``,
default ``~/.cache/ddp-deploy/debug.log``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Column

from . import codesync, delivery, doctor, failure, lock, netcheck, plan, preflight, prepare, record, runs, runtime, secretenv, stall, view
from .errors import DeployError, InputError, RemoteFailure, RuntimeFailure
from .inventory import Inventory, load
from .payload import payload
from .remote import Remote, command_line
from .text import DataTable, Screen, cell, safe

log = logging.getLogger("deploy")
out = Screen(highlight=False, soft_wrap=True)  # tables at full width where stdout is no terminal


def _log_path() -> Path:
    return Path(os.environ.get("DDP_DEPLOY_LOG", Path.home() / ".cache" / "ddp-deploy" / "debug.log"))


def _setup_logging(verbose: bool) -> None:
    root = logging.getLogger("deploy")
    root.setLevel(logging.DEBUG)
    for h in list(root.handlers):
        root.removeHandler(h)
    try:
        path = _log_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(path)
        fh.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
        root.addHandler(fh)
    except OSError:
        pass
    if verbose:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(logging.Formatter("debug: %(message)s"))
        root.addHandler(sh)


class _Group(click.Group):
    """Turns library errors into one-line messages and exit codes."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DeployError as e:
            log.debug("failed", exc_info=True)
            redact = ctx.obj.redact if isinstance(ctx.obj, _State) else str
            for line in e.lines():  # they may quote the job's output: shown as text
                click.echo(safe(redact(f"error: {line}")), err=True)
            raise click.exceptions.Exit(e.exit_code) from None
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            raise click.exceptions.Exit(130) from None
        except Exception as e:
            log.exception("internal error")
            click.echo(safe(f"error: internal error: {type(e).__name__}: {e} (traceback in {_log_path()})"), err=True)
            raise click.exceptions.Exit(1) from None


class _State:
    def __init__(self, hosts: str, without: tuple[str, ...] = ()) -> None:
        self.hosts = hosts
        self.without = without
        self._inv: Inventory | None = None
        self._redactor = secretenv.Redactor()

    @property
    def inv(self) -> Inventory:
        if self._inv is None:
            inv = load(self.hosts)
            if self.without:
                inv = self._without(inv)
            self._inv = inv
            self.use_redactor(secretenv.redactor_for(self._inv))
        return self._inv

    def _without(self, whole: Inventory) -> Inventory:
        inv = whole.without(self.without)
        moved = "" if inv.rendezvous.node == whole.rendezvous.node else (
            f"; the rendezvous moves from {whole.rendezvous.node} to {inv.rdzv_node.name} "
            f"({inv.rdzv_node.address}:{inv.rendezvous.port})")
        click.echo(f"note: without {', '.join(self.without)}: {len(inv.nodes)} nodes{moved}", err=True)
        return inv

    def use_redactor(self, redactor: secretenv.Redactor) -> None:
        """Every secret value this shell can read is shown as *** in output and the debug log."""
        self._redactor = redactor
        if redactor:
            for h in logging.getLogger("deploy").handlers:
                h.addFilter(redactor.logging_filter())

    def redact(self, text: str) -> str:
        return self._redactor(text)


pass_state = click.make_pass_decorator(_State)


def slurm_variant(refused: str | None = None):
    """On a Slurm inventory (hosts.yaml's ``slurm:``) the verb is slurm_verbs' function of the same
    name, with the same options; ``refused``: why the verb does not apply there (exit 2)."""
    def wrap(verb):
        @functools.wraps(verb)
        def chosen(st: _State, **options):
            if st.inv.slurm is None:
                return verb(st, **options)
            if refused is not None:
                raise InputError(f"{verb.__name__.rstrip('_')}: not on Slurm: {refused}")
            from . import slurm_verbs

            return getattr(slurm_verbs, verb.__name__)(st, **options)
        return chosen
    return wrap
dry_run_option = click.option("--dry-run", is_flag=True, help="Print the per-node commands; touch nothing.")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--hosts", default="hosts.yaml", envvar="DDP_HOSTS", show_default=True,
              help="Inventory file (env DDP_HOSTS).")
@click.option("--without", metavar="NODE", multiple=True,
              help="Leave this node out (lost for good), repeatable: the job runs on the others, and if it "
                   "hosted the rendezvous, the first remaining node does. hosts.yaml is not changed.")
@click.option("-v", "--verbose", is_flag=True, help="Debug output on stderr.")
@click.pass_context
def cli(ctx: click.Context, hosts: str, without: tuple[str, ...], verbose: bool) -> None:
    """Deploy and run multi-node PyTorch DDP training described by hosts.yaml."""
    _setup_logging(verbose)
    ctx.obj = _State(hosts, tuple(n for item in without for n in item.split(",") if n))


@cli.command()
@pass_state
@slurm_variant()
def validate(st: _State) -> None:
    """Parse and validate hosts.yaml only (no connection)."""
    inv = st.inv
    procs = sum(n.nprocs for n in inv.nodes)
    click.echo(f"{st.hosts}: ok: job {inv.job.name}, runtime {inv.job.runtime}, {len(inv.nodes)} nodes, "
               f"{procs} processes, rendezvous {inv.rdzv_node.address}:{inv.rendezvous.port}")


@cli.command()
@click.option("--network", is_flag=True,
              help="Then a short all-reduce across every node with the job's backend, image and interfaces.")
@click.option("--network-mb", type=click.FloatRange(min=0.001), default=32, show_default=True,
              help="With --network: the all-reduce buffer, in MiB.")
@pass_state
@slurm_variant()
def check(st: _State, network: bool, network_mb: float) -> None:
    """Preflight checks on every node, in parallel (with train.code: the code is synced first, so
    that the program's import is checked where it will run)."""
    inv = st.inv
    secretenv.resolve(inv)  # a secret this shell cannot read fails here, not at launch
    snap = codesync.snapshot_of(inv)
    with Remote(inv) as remote:
        code = _sync_code(inv, remote, snap)
        pre = preflight.run_checks(inv, remote, for_launch=network, code=code)  # --network needs the image there
        _print_checks(pre.checks)
        _refuse_failed_checks(pre.checks, "")
        click.echo(f"all {len(pre.checks)} checks passed")
        if network:
            report = netcheck.run(inv, remote, pre.facts, network_mb)
    if network:
        _print_network(report)
        slow = report.get("slow") or []
        if slow:
            raise RuntimeFailure(f"network: {', '.join(slow)} much slower than the other nodes "
                                 f"({netcheck.describe_slow(report)})",
                                 hint="check that node's link, cabling and interface (nodes[].interface)")


def _sync_code(inv, remote, snap, nodes=None) -> runtime.CodeDir | None:
    """The code snapshot on every node (only the files their store lacks travel), reported per node."""
    if snap is None:
        return None
    click.echo(f"code: {snap.root}: {len(snap.files)} files, {_size(snap.size)}, snapshot {snap.id[:12]}")

    def report(node: str, sent: codesync.Sent) -> None:
        for said in sent.moved:  # a program wrote into its snapshot, or something was planted there
            click.echo(f"{node}: warning: code snapshot {snap.id[:12]} was not your code; moved aside: {safe(said)}")
        if sent.present:
            click.echo(f"{node}: code snapshot {snap.id[:12]} present")
        else:
            click.echo(f"{node}: code sent {sent.files} file{'s' * (sent.files != 1)} ({_size(sent.bytes)}), "
                       f"snapshot {snap.id[:12]} stored")

    codesync.sync(inv, remote, snap, on_node=report, nodes=nodes)
    return codesync.code_dir(inv, snap)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _print_network(report: dict) -> None:
    table = DataTable("node", "interface", "transport", "bus bandwidth", "pairs",
                      title=f"network: {report['backend']} all-reduce of {report['size_bytes'] / 2**20:g} MiB")
    for n in report["nodes"]:
        pairs = ", ".join(f"{peer} {netcheck.rate(bw)}" for peer, bw in n["pairs"].items())
        table.add_row(n["node"], n["interface"], n["transport"], netcheck.rate(n["busbw"]), pairs)
    out.print(table)
    if report.get("allreduce_busbw"):
        click.echo(f"all nodes together: {netcheck.rate(report['allreduce_busbw'])} bus bandwidth")
    if report.get("note"):
        click.echo(f"note: {report['note']}")


def _print_checks(checks) -> None:
    table = DataTable("node", "check", "result", "detail", title="preflight")  # a detail quotes the node
    for c in checks:
        table.add_row(c.node, c.name, cell("ok", "green") if c.ok else cell("FAIL", "red"), c.detail)
    out.print(table)


def _refuse_failed_checks(checks, doing: str) -> None:
    failed = [c for c in checks if not c.ok]
    if failed:
        raise RuntimeFailure(f"{doing}{len(failed)} check(s) failed: "
                             + " | ".join(f"{c.node} {c.name}: {c.detail}" for c in failed),
                             hint="see the table above; `ddp-deploy check` runs them alone")


@cli.command()
@dry_run_option
@click.option("--build/--no-build", default=True, help="Build the image here first (docker runtime).")
@pass_state
@slurm_variant()
def deploy(st: _State, dry_run: bool, build: bool) -> None:
    """Create the shared directories; get the image (docker) or check the interpreter (host)."""
    inv = st.inv
    steps = prepare.deployer(inv)
    if dry_run:
        click.echo(f"[all] {lock.describe()}, held while deploy runs")
        for line in steps.dry_run(build):
            click.echo(line)
        return
    with Remote(inv) as remote, lock.held(inv, remote, "deploy", st.hosts, warn=_warn) as fleet:
        def ship(image_id, held):
            # The build takes minutes: an `unlock --force` meanwhile may have let another operator in.
            fleet.confirm("deploy", "no image was shipped")
            return _ship_with_progress(inv, remote, image_id, held)

        try:
            steps.run(remote, click.echo, build=build, ship=ship)
        except KeyboardInterrupt:  # a partial `docker load` registers no image: the ID check sees none
            click.echo("interrupted: a node whose load had not finished keeps the image it had; "
                       "`ddp-deploy deploy` ships the image to it again", err=True)
            raise


cli.add_command(deploy, name="sync")


def _ship_with_progress(inv, remote, image_id, held):
    """One line per node that gets the image: its stage, bytes, rate (deploy/delivery.py)."""
    way = delivery.delivery(inv)
    columns = (TextColumn("{task.fields[node]:<12} {task.fields[stage]:<10}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        tasks: dict[str, int] = {}
        lock = threading.Lock()

        def report(node: str, stage: str, done: int, total: int | None) -> None:
            with lock:
                if node not in tasks:
                    tasks[node] = progress.add_task(node, total=total, node=node, stage=stage)
                progress.update(tasks[node], completed=done, total=total, stage=stage)

        return way.ship(remote, image_id, held, report)


@cli.command()
@dry_run_option
@click.option("--wait", is_flag=True, help="Follow until torchrun exits on every node.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
@pass_state
@slurm_variant()
def launch(st: _State, dry_run: bool, wait: bool, timeout: float | None) -> None:
    """Start the job on every node (all or nothing)."""
    inv = st.inv
    secrets = secretenv.resolve(inv)
    snap = codesync.snapshot_of(inv)
    if dry_run:
        click.echo(f"[all] program: {payload(inv).describe()}")
        if snap is not None:
            click.echo(f"[all] code: {snap.root} ({len(snap.files)} files, {_size(snap.size)}) as snapshot "
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
            _show(s.node, s.argv)
            if node.interface is None:
                click.echo(f"[{s.node}] GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME: the interface holding "
                           f"{node.address}, detected at launch")
            for note in runtime.runtime(inv).dry_run_notes(node):
                click.echo(f"[{s.node}] {note}")
        return
    with Remote(inv) as remote, contextlib.ExitStack() as fleet:
        held = fleet.enter_context(lock.held(inv, remote, "launch", st.hosts, warn=_warn))
        states = _states(inv, remote, st.redact)
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
        code = _sync_code(inv, remote, snap)
        # Everything `check` proves (engine, torch and CUDA where the job runs, the program
        # importing there, GPUs, shared storage, the rendezvous port free and reachable: so no
        # other job's store can absorb this one) holds before anything starts.
        pre = preflight.run_checks(inv, remote, for_launch=True, code=code)
        if pre.failed:
            _print_checks(pre.failed)
        _refuse_failed_checks(pre.failed, "launch refused, nothing started: ")
        _warn_without_interface(inv, pre.facts)
        image_id = _one_image(inv, remote)
        run = runs.new_id()
        specs = plan.launch_plan(inv, pre.facts, code, run)
        # Preparing took a while: an `unlock --force` meanwhile may have let another operator in,
        # whose run the cleanup below or a second start would break.
        held.confirm("launch")
        finished = {n: plan.stop_argv(inv, inv.node(n)) for n, s in states.items() if s.exists}
        if finished:  # a finished run's container or pid files; its checkpoints and kept logs stay
            remote.run(finished, check=True, timeout=120)
        _start_run(inv, remote, run, record.launch_record(inv, code, run, image_id, st.redact))
        stdin = {s.node: secretenv.stdin_lines(secrets) for s in specs} if secrets else None
        try:
            results = remote.run({s.node: s.argv for s in specs}, check=False, timeout=120, stdin=stdin)
        except KeyboardInterrupt:  # half-way: some nodes may run, none must be left running
            stuck = _undo_start(inv, remote, [s.node for s in specs])
            click.echo("interrupted: " + (f"could NOT stop {', '.join(stuck)}: run `ddp-deploy stop`" if stuck
                                           else "stopped every node it had started"), err=True)
            raise
        if not all(r.ok for r in results.values()):
            started = [n for n, r in results.items() if r.ok]
            stuck = _undo_start(inv, remote, list(results))
            hint = f"stopped the nodes that had started ({', '.join(started) or 'none'})"
            if stuck:
                hint = f"could NOT stop {', '.join(stuck)}: run `ddp-deploy stop` once they are reachable"
            raise RemoteFailure("launch", results, hint=hint)
        fleet.close()  # the job has started: following it (--wait) only reads, and can last hours
        click.echo(f"started {inv.job.name} run {run} on {len(specs)} nodes "
                   f"({sum(n.nprocs for n in inv.nodes)} processes): {payload(inv).describe()}"
                   + (f", code snapshot {code.snapshot[:12]}" if code else ""))
        if not wait:
            return
        final = _follow(inv, remote, timeout, st.redact)
        _verdict(inv, final, remote, st.redact)


def _one_image(inv, remote) -> str | None:
    """The id of the image every node holds (None: the job runs in no image), as the config's
    digest on Docker's classic store and the containerd image store alike (image.comparable_id);
    refuses a launch across nodes whose images differ (one left behind by an earlier deploy)."""
    from . import image

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


def _start_run(inv, remote, run: str, kept: dict) -> None:
    """The run's record on the shared volume, as the job's current one too; the oldest runs
    beyond job.keep_runs removed. Not fatal: the job runs without it, and says so."""
    first = _readers(inv)[0].name
    done = remote.run({first: runs.start_argv(inv, run)}, stdin={first: record.encode(kept)}, check=False,
                      timeout=60)[first]
    if not done.ok:
        click.echo(f"warning: {first}: the record of run {run} was not written in {runs.runs_dir(inv)}: "
                   f"{done.summary()}", err=True)
        return
    pruned = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("pruned ")]
    if pruned:
        click.echo(f"removed the oldest run{'s' * (len(pruned) > 1)} ({', '.join(pruned)}): job.keep_runs is "
                   f"{inv.job.keep_runs}")


def _undo_start(inv, remote, nodes) -> list[str]:
    """Stops the job on ``nodes`` at once (a launch that did not start everywhere); the nodes it
    could not stop."""
    undo = remote.run({n: plan.stop_argv(inv, inv.node(n)) for n in nodes}, check=False, timeout=120)
    return [n for n, r in undo.items() if not r.ok]


def _follow(inv, remote, timeout, redact):
    """Waits for the job's end, showing every node's state and progress as it goes: a table
    redrawn in place on a terminal, plain lines otherwise (CI logs, pipes)."""
    if out.is_terminal:
        with Live(console=out, refresh_per_second=2, transient=True) as live:
            final = _wait(inv, remote, timeout, redact, show=lambda states: live.update(_status_table(inv, states)))
    else:
        final = _wait(inv, remote, timeout, redact, show=view.PlainFollower(click.echo).update)
    _print_status(inv, final)
    return final


def _verdict(inv, final, remote, redact) -> None:
    """The end of a followed job: exit 0 if every node (of an elastic job: every node not lost)
    exited with 0, else a failure naming the nodes and the first failure (node, rank, exit code,
    the program's first error line)."""
    lost = [n for n, s in final.items() if s.state in ("unreachable", "unknown")] if inv.elastic else []
    failed = [n for n, s in final.items() if s.state != "exited(0)" and n not in lost]
    stalled = [n for n, s in final.items() if s.state == stall.STOPPED]
    if stalled:  # the cause of any other node's end: each launcher ends its part when it finds the stall
        raise _stalled_and_stopped(inv, remote, stalled, redact)
    if failed:
        first = _first_failure(inv, remote, witnesses(final), redact)
        raise RuntimeFailure(f"the job failed on {', '.join(failed)}" + (f": {first.describe()}" if first else ""),
                             hint=f"`ddp-deploy logs{f' --tail {FAILURE_TAIL}' if first else ''}` shows the rest")
    if lost:
        click.echo(f"finished without {', '.join(lost)} (lost; job.min_nodes {inv.job.min_nodes}): the other "
                   "nodes exited with code 0")
        return
    click.echo("all nodes finished with exit code 0")


def _stalled_and_stopped(inv, remote, stalled: list[str], redact) -> RuntimeFailure:
    """The end of a job whose nodes' launchers stopped it on a stall, with the kept diagnosis."""
    why = _newest_stall(inv, remote, redact)
    return RuntimeFailure(f"the job stalled and was stopped on {', '.join(stalled)} (job.on_stall: stop)"
                          + (f": {why}" if why else ""),
                          hint="`ddp-deploy status --run ID` shows each stall and where the ranks were; "
                               "launch again to resume from the newest checkpoint")


@cli.command()
@click.argument("node")
@dry_run_option
@pass_state
@slurm_variant("Slurm allocates the nodes; a requeued job comes back on its own")
def join(st: _State, node: str, dry_run: bool) -> None:
    """Start NODE in the elastic job running on the other nodes (job.min_nodes): a node back after
    a loss, one whose restarts ran out, or a spare left out with --without. The running nodes take
    it in at their next rendezvous round, from the newest checkpoint."""
    inv = st.inv
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
        _show(node, plan.launch_spec(inv, _index(inv, node), code=codesync.code_dir(inv, snap)).argv)
        return
    with Remote(inv) as remote, lock.held(inv, remote, "join", st.hosts, warn=_warn):
        states = _states(inv, remote, st.redact)
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
        at, text, joined, run = _running_job(inv, remote, running[0], node)
        if not states[at.rdzv_node.name].running:
            raise RuntimeFailure(f"join refused, nothing started: {at.rdzv_node.name}, which hosts the running "
                                 f"job's rendezvous, does not run it ({states[at.rdzv_node.name].state})",
                                 hint="the job cannot take a node in without it: `ddp-deploy stop`, then "
                                      f"`ddp-deploy --without {at.rdzv_node.name} launch`")
        code = _sync_code(at, remote, snap, nodes=[node])
        pre = preflight.join_checks(at, remote, node, (record.path(inv), text), code)
        if pre.failed:
            _print_checks(pre.failed)
        _refuse_failed_checks(pre.failed, "join refused, nothing started: ")
        spec = plan.launch_spec(at, _index(at, node), pre.facts.get(node, plan.NodeFacts()), code, run)
        if mine.exists:  # its finished run (restarts run out): its checkpoints stay on the shared volume
            remote.run({node: plan.stop_argv(at, at.node(node))}, check=True, timeout=120)
        stdin = {node: secretenv.stdin_lines(secrets)} if secrets else None
        started = remote.run({node: spec.argv}, check=False, timeout=120, stdin=stdin)
        if not started[node].ok:
            _undo_start(at, remote, [node])
            raise RemoteFailure("join", started, hint="nothing else changed: the job runs on as it was")
    click.echo(f"{node} started: the job's nodes ({', '.join(joined)}) take it in at their next rendezvous round "
               f"({at.rdzv_node.name}, {plan.endpoint(at)}); `ddp-deploy status` shows it training")


def _index(inv: Inventory, node: str) -> int:
    return [n.name for n in inv.nodes].index(node)


def _running_job(inv: Inventory, remote: Remote, reader: str, node: str) -> tuple[Inventory, str, list[str], str]:
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


def _warn_without_interface(inv, facts) -> None:
    for n in inv.nodes:
        if n.interface is None and facts.get(n.name, plan.NodeFacts()).interface is None:
            click.echo(f"warning: {n.name}: no interface holds {n.address}; gloo/NCCL pick one from "
                       f"the hostname (set nodes[].interface if the job hangs)", err=True)


UNREACHABLE_POLLS = 30  # consecutive 1-s polls before a silent node ends --wait


def _wait(inv, remote, timeout, redact, show=lambda states: None):
    deadline = None if timeout is None else time.monotonic() + timeout
    silent = {n.name: 0 for n in inv.nodes}
    floor = inv.job.min_nodes or len(inv.nodes)  # an elastic job goes on without lost nodes, down to this
    diagnosed = False
    while True:
        states = _states(inv, remote, redact)
        show(states)
        stalled = any(s.stall for s in states.values())
        if stalled and not diagnosed:  # once per stall: what every rank is doing, the odd ones first
            click.echo(safe(f"stalled: {_diagnose(inv, remote, redact).summary} (`ddp-deploy doctor` shows each rank)"))
        diagnosed = stalled
        for n, s in states.items():
            silent[n] = silent[n] + 1 if s.state in ("unreachable", "unknown") else 0
        lost = [n for n, count in silent.items() if count >= UNREACHABLE_POLLS]
        if len(inv.nodes) - len(lost) >= floor and all(
                s.ended or s.state == "absent" or n in lost for n, s in states.items()):
            return states
        if lost and len(inv.nodes) - len(lost) < floor:
            _print_status(inv, states)
            raise RuntimeFailure(f"lost contact with {', '.join(lost)} while the job ran",
                                 hint="`ddp-deploy stop` ends it on the nodes still reachable; launch again to resume "
                                      f"(`ddp-deploy --without {lost[0]} launch` leaves a node out for good)")
        if deadline is not None and time.monotonic() > deadline:
            _print_status(inv, states)
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


def _first_failure(inv, remote, nodes, redact) -> failure.Failure | None:
    if not nodes:
        return None
    got = remote.run({n: plan.logs_argv(inv, inv.node(n), tail=FAILURE_TAIL, follow=False) for n in nodes},
                     check=False, timeout=60)
    return secretenv.masked(failure.first_failure({n: r.stdout for n, r in got.items() if r.ok}), redact)


def _states(inv, remote, redact) -> dict[str, plan.NodeState]:
    """Every node's state; ``redact`` hides secret values in the metrics (a program may print them),
    once parsed: what a node's state is never depends on them."""
    res = remote.run({n.name: plan.status_argv(inv, n) for n in inv.nodes}, check=False, timeout=60)
    return {n: plan.with_stall(secretenv.masked(plan.parse_status(r.stdout) if r.ok else plan.NodeState(
                "unknown" if r.connected else "unreachable", r.summary()), redact), inv.job.stall_timeout)
            for n, r in res.items()}


def _diagnose(inv, remote, redact) -> doctor.Diagnosis:
    """Every node's workers and their stacks, grouped (deploy/doctor.py); what the job's stacks
    say is masked like its output (a secret in a function's name or a path)."""
    res = remote.run({n.name: plan.diagnose_argv(inv, n) for n in inv.nodes}, check=False, timeout=60)
    ranks, silent = [], {}
    for n, r in res.items():
        if r.ok:
            ranks += doctor.parse(n, redact(r.stdout))
        else:
            silent[n] = redact(r.summary())
    return doctor.diagnose(ranks, silent, sum(n.nprocs for n in inv.nodes))


def _status_table(inv, states):
    return view.table(inv.job.name, {n.name: n.nprocs for n in inv.nodes}, states)


def _print_status(inv, states) -> None:
    out.print(_status_table(inv, states))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("-f", "--follow", is_flag=True, help="Keep showing it until the job ends (exit code as launch --wait).")
@click.option("--run", "run_id", metavar="ID", help="A kept run instead (`ddp-deploy runs`; the start of its id is "
                                                   "enough): how each node ended, its last metrics, the first failure.")
@pass_state
@slurm_variant()
def status(st: _State, as_json: bool, follow: bool, run_id: str | None) -> None:
    """Every node's state (restarts, exit code) and progress: epoch, step, loss, accuracy,
    samples/s and ETA, from the program's last METRICS line."""
    inv = st.inv
    if follow and (as_json or run_id):
        raise InputError(f"status: --follow and {'--json' if as_json else '--run'} do not go together",
                         hint="poll `status --json` instead" if as_json else "a kept run has ended: drop --follow")
    with Remote(inv) as remote:
        if run_id is not None:
            _kept_status(inv, remote, run_id, as_json, st.redact)
            return
        if follow:
            _verdict(inv, _follow(inv, remote, None, st.redact), remote, st.redact)
            return
        states = _states(inv, remote, st.redact)
        first = _first_failure(inv, remote, witnesses(states), st.redact)
    if as_json:
        click.echo(json.dumps([{**view.as_data(n, inv.node(n).nprocs, s),
                                "first_failure": asdict(first) if first and first.node == n else None}
                               for n, s in states.items()]))
    else:
        _print_status(inv, states)
        if first:
            click.echo(f"first failure: {first.describe()}")


@cli.command(name="doctor")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_state
@slurm_variant()
def doctor_(st: _State, as_json: bool) -> None:
    """What every rank of the running job is doing: its Python stack (py-spy), grouped by where
    the ranks wait, the ones holding the others up named first (a hung job: README, "When a job hangs")."""
    inv = st.inv
    with Remote(inv) as remote:
        found = _diagnose(inv, remote, st.redact)
    _show_diagnosis(found, as_json)


def _show_diagnosis(found: doctor.Diagnosis, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(asdict(found)))
        return
    click.echo(safe(found.summary))
    for line in doctor.detail(found):
        click.echo(safe(line))


@cli.command()
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (one Ctrl-C ends it).")
@click.option("-n", "--tail", type=click.IntRange(min=0), default=None, help="Last N lines per node.")
@click.option("--node", "only_nodes", metavar="NAME", multiple=True, help="Only this node's lines (repeatable).")
@click.option("--rank", "only_ranks", metavar="N", type=click.IntRange(min=0), multiple=True,
              help="Only this global rank's lines (repeatable); torchrun's own lines carry no rank.")
@click.option("--run", "run_id", metavar="ID", help="A kept run's logs (`ddp-deploy runs`; the start of its id is "
                                                   "enough), read from the shared volume.")
@pass_state
@slurm_variant()
def logs(st: _State, follow: bool, tail: int | None, only_nodes: tuple[str, ...], only_ranks: tuple[int, ...],
         run_id: str | None) -> None:
    """Every node's output, each line prefixed with the node and the rank that printed it."""
    inv = st.inv
    inv.check_names("--node", set(only_nodes))
    nodes = [n for n in inv.nodes if not only_nodes or n.name in only_nodes]
    read = lambda n: plan.logs_argv(inv, n, tail=tail, follow=follow)  # noqa: E731
    if run_id is not None:
        with Remote(inv) as remote:
            run = _kept_run(inv, remote, run_id, st.redact, "logs --run")[1]
        gone = [n for n in run.nodes if n not in {m.name for m in inv.nodes}]
        if gone:
            click.echo(safe(f"note: {', '.join(gone)} ran in {run.id} but not in hosts.yaml now: their logs are in "
                            f"{runs.runs_dir(inv)}/{run.id}"), err=True)
        nodes = [n for n in nodes if n.name in run.nodes]
        read = lambda n: runs.log_argv(inv, run.id, n.name, tail=tail, follow=follow)  # noqa: E731
    width = max((len(view.log_label(n.name, sum(m.nprocs for m in inv.nodes) - 1)) for n in nodes), default=0)
    lock = threading.Lock()

    def emit(node: str, line: str) -> None:
        rank, text = view.split_rank(line)
        if only_ranks and rank not in only_ranks:
            return
        with lock:
            click.echo(safe(st.redact(f"{view.log_label(node, rank):<{width}} | {text}")))

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


@cli.command(name="runs")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with each run's whole record.")
@pass_state
def runs_(st: _State, as_json: bool) -> None:
    """The job's kept runs, oldest first: id, start, duration, nodes, program, code snapshot,
    image and how they ended (`logs --run ID`, `status --run ID` read one; job.keep_runs
    says how many are kept)."""
    inv = st.inv
    with Remote(inv) as remote:
        kept = _kept_runs(inv, remote, "", st.redact)[1]
        running = bool(kept) and kept[-1].end is None and _job_running(inv, remote, st.redact)
    if as_json:
        click.echo(json.dumps([{"id": r.id, "start": r.start, "end": r.end,
                                "outcome": "running" if running and r is kept[-1] else r.outcome(),
                                "stopped": r.stop_data(),
                                "nodes": {n: {"exits": [list(e) for e in nr.exits], "metrics": nr.metrics,
                                              "stopped": nr.stop.as_data() if nr.stop else None,
                                              "stalls": [k.as_data() for k in nr.stalls]}
                                          for n, nr in r.nodes.items()},
                                "record": r.record} for r in kept]))
        return
    if not kept:
        click.echo(f"no run of {inv.job.name} is kept in {runs.runs_dir(inv)}")
        return
    table = DataTable(Column("run", no_wrap=True), Column("took", no_wrap=True), "nodes", "program", "code", "image",
                      Column("outcome", no_wrap=True), Column("stalls", no_wrap=True), title=f"runs of {inv.job.name} (the newest "
                      f"{inv.job.keep_runs} are kept; the id starts with the UTC start time)")
    for r in kept:
        outcome = cell("running", "green") if running and r is kept[-1] else r.outcome()
        table.add_row(r.id, _when(r)[1] or "-", str(len(r.nodes)), r.field("program") or "?",
                      (r.field("code_snapshot") or "-")[:8], (r.image_id or "-").removeprefix("sha256:")[:8], outcome,
                      r.stall_text())
    out.print(table)


def _job_running(inv, remote, redact) -> bool:
    if inv.slurm is not None:
        from . import slurm_verbs

        return slurm_verbs.running(inv, remote)
    return any(s.running for s in _states(inv, remote, redact).values())


def _when(run: runs.Run) -> tuple[str, str | None]:
    """When a run started (local time) and how long it took (None: not every node has ended)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.start)) if run.start else "?"
    return started, view.duration(run.end - run.start) if run.start and run.end else None


def _readers(inv):
    """Where the tool reads and writes the shared volume: the nodes, or Slurm's login node."""
    return (inv.slurm.login,) if inv.slurm else inv.nodes


def _on_any_node(inv, remote, argv, what: str):
    """``argv`` run on the first node that answers (the shared volume is the same on all): that
    node and its result; a failure naming each node tried."""
    tried = []
    for n in _readers(inv):
        got = remote.run({n.name: argv}, check=False, timeout=60)[n.name]
        if got.ok:
            return n.name, got
        tried.append(f"{n.name}: {got.summary()}")
        if got.connected:
            break
    raise RuntimeFailure(f"cannot read {what} ({'; '.join(tried)})", hint="`ddp-deploy check` names the cause")


def _kept_runs(inv, remote, prefix: str, redact) -> tuple[str, list[runs.Run]]:
    """The kept runs whose id starts with ``prefix``, and the node that read them."""
    reader, got = _on_any_node(inv, remote, runs.list_argv(inv, prefix), f"the kept runs in {runs.runs_dir(inv)}")
    return reader, secretenv.masked(runs.parse(got.stdout), redact)


def _kept_run(inv, remote, wanted: str, redact, verb: str) -> tuple[str, runs.Run]:
    reader, kept = _kept_runs(inv, remote, wanted, redact)
    try:
        return reader, runs.pick(kept, wanted)
    except ValueError as e:
        raise InputError(f"{verb}: {e}", hint="`ddp-deploy runs` lists the kept runs") from None


def _kept_failure(inv, remote, reader: str, run: str, nodes, redact) -> failure.Failure | None:
    """The first failure among ``nodes`` of a kept run, from their logs read on ``reader``."""
    logs = {}
    for n in nodes:
        got = remote.run({reader: runs.log_argv(inv, run, n, tail=FAILURE_TAIL, follow=False)}, check=False,
                         timeout=60)[reader]
        if got.ok:
            logs[n] = got.stdout
    return secretenv.masked(failure.first_failure(logs), redact) if logs else None


def _kept_status(inv, remote, wanted: str, as_json: bool, redact) -> None:
    """``status --run``: how each node of a kept run ended, its last metrics, the first failure."""
    reader, run = _kept_run(inv, remote, wanted, redact, "status --run")
    states = {n: r.state() for n, r in run.nodes.items()}
    ranks = {n: run.procs(n) for n in states}
    first = _kept_failure(inv, remote, reader, run.id, witnesses(states), redact)
    stalls = _kept_stalls(inv, remote, reader, run, redact)
    if as_json:
        click.echo(json.dumps({"run": run.id, "start": run.start, "end": run.end, "outcome": run.outcome(),
                               "stopped": run.stop_data(),
                               "nodes": [{**view.as_data(n, ranks[n], s), "exits": [list(e) for e in run.nodes[n].exits],
                                          "stopped": run.nodes[n].stop.as_data() if run.nodes[n].stop else None,
                                          "first_failure": asdict(first) if first and first.node == n else None,
                                          "stalls": [k.as_data() for k in run.nodes[n].stalls]}
                                         for n, s in states.items()],
                               "stalls": stalls, "record": run.record}))
        return
    started, took = _when(run)
    click.echo(safe(f"run {run.id}: started {started}{f', took {took}' if took else ''}: "
                    f"{run.field('program') or '?'}: {run.outcome()}"))
    out.print(view.table(inv.job.name, ranks, states))
    if first:
        click.echo(f"first failure: {first.describe()}")
    for kept in stalls:
        click.echo(safe(view.kept_stall_line(kept)))
        if kept["diagnosis"]:
            click.echo(safe(f"  why: {kept['diagnosis']}"))


def _newest_stall(inv, remote, redact) -> str | None:
    """The diagnosis of the newest run's last kept stall (None: none kept, or not read)."""
    try:
        reader, kept = _kept_runs(inv, remote, "", redact)
    except RuntimeFailure:
        return None
    stalls = _kept_stalls(inv, remote, reader, kept[-1], redact) if kept else []
    return stalls[-1]["diagnosis"] if stalls else None


def _kept_stalls(inv, remote, reader: str, run: runs.Run, redact) -> list[dict]:
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


@cli.command()
@click.option("--run", "run_ids", metavar="ID", multiple=True,
              help="Only this run (repeatable: overlaid; the start of its id is enough). Default: every run.")
@click.option("-o", "--output", metavar="FILE", default=None, help="The PNG to write [default: JOB-metrics.png].")
@pass_state
def plot(st: _State, run_ids: tuple[str, ...], output: str | None) -> None:
    """A PNG of the job's loss, accuracy and samples/s against the step, one colour per run, from
    the built-in trainer's metrics.jsonl on the shared volume (TensorBoard reads the event files
    beside it: tensorboard --logdir CHECKPOINTS/tensorboard). A run of any other program is drawn
    from the METRICS lines of its kept logs: every numeric field against the step."""
    from . import plot as plotting  # matplotlib: only for this verb

    plotting.require_matplotlib()
    inv = st.inv
    path = output or f"{inv.job.name}-metrics.png"
    with Remote(inv) as remote:
        reader, got = _on_any_node(inv, remote, plotting.sources_argv(inv),
                                   f"the metrics in {inv.storage.checkpoints.host}")
        kept, text = plotting.parse_sources(got.stdout)  # parsed first, masked after (below)
        by_run = plotting.records_by_run(text)
        missing = [r for r in plotting.wanted_runs(kept, run_ids) if r not in by_run]
        from_logs = {}
        if missing:  # runs metrics.jsonl knows nothing of: their programs' METRICS lines
            read = remote.run({reader: plotting.log_metrics_argv(inv, missing)}, check=False, timeout=120)[reader]
            if read.ok:
                from_logs = plotting.log_records(read.stdout)
            else:
                _warn(safe(f"{reader}: the logs of {', '.join(missing)} were not read: {read.summary()}"))
    sources = {run: plotting.FROM_LOGS for run in from_logs}
    by_run = plotting.masked({**by_run, **from_logs}, st.redact)
    plotting.render(by_run, path, wanted=run_ids, title=f"{inv.job.name}: metrics by run")
    click.echo(plotting.wrote(path, plotting.select(by_run, run_ids), sources))


@cli.command()
@dry_run_option
@click.option("--now", is_flag=True, help="Kill at once: no checkpoint, the work since the last one is redone.")
@pass_state
@slurm_variant()
def stop(st: _State, dry_run: bool, now: bool) -> None:
    """End the job on every reachable node (idempotent). The job first gets SIGTERM and up to
    45 s to finish its step and write a checkpoint, so a later launch redoes nothing."""
    inv = st.inv
    grace = 0 if now else runtime.STOP_GRACE_S
    cmds = {n.name: plan.stop_argv(inv, n, grace) for n in inv.nodes}
    if dry_run:
        for n, argv in cmds.items():
            _show(n, argv)
        return
    with Remote(inv) as remote:
        results = remote.run(cmds, check=False, timeout=grace + 120)
    for n, r in results.items():
        click.echo(safe(st.redact(f"{n}: {r.stdout.strip() if r.ok else r.summary()}")))  # quotes the program
    if not all(r.ok for r in results.values()):
        raise RemoteFailure("stop", results, hint="stop it there by hand once reachable, or run stop again")


@cli.command()
@click.argument("target", type=click.Choice(["slurm", "k8s"]))
@click.option("--kind", type=click.Choice(["job", "pytorchjob"]), default="job", show_default=True,
              help="k8s: an indexed Job with a headless Service, or Kubeflow's PyTorchJob.")
@click.option("--namespace", default=None, help="k8s: the namespace of every object.")
@click.option("--pvc", metavar="CLAIM", default=None,
              help="k8s: a PersistentVolumeClaim holding data/ and checkpoints/ (default: the storage host paths).")
@click.option("--image", "image_ref", metavar="REF", default=None,
              help="k8s: the image the cluster pulls (default: image.name).")
@click.option("-o", "--output", metavar="FILE", default=None, help="Write it to FILE instead of stdout.")
@pass_state
def export(st: _State, target: str, kind: str, namespace: str | None, pvc: str | None, image_ref: str | None,
           output: str | None) -> None:
    """Print the job for another engine: the exact Slurm batch script `launch` submits (hosts.yaml
    with slurm:), or Kubernetes manifests (any hosts.yaml). Secrets are named, never included."""
    inv = st.inv
    if target == "slurm":
        if inv.slurm is None:
            raise InputError("export slurm: hosts.yaml has no slurm: section",
                             hint="add slurm: (login, nodes, ...) in place of nodes: (README, \"Running on Slurm\")")
        from . import slurm_verbs

        text = slurm_verbs.export(inv)
    else:
        from . import k8s

        text = k8s.render(inv, k8s.manifests(inv, kind=kind, namespace=namespace, pvc=pvc, image=image_ref))
    if output is None:
        click.echo(text, nl=not text.endswith("\n"))
        return
    Path(output).write_text(text)
    click.echo(f"wrote {output}", err=True)


def _show(node: str, argv) -> None:
    click.echo(f"[{node}] {command_line(argv)}")


@cli.command()
@click.option("--force", is_flag=True,
              help="Also remove a live lock (fresh heartbeat): only when you know its command no longer runs.")
@pass_state
@slurm_variant("there is no fleet lock: Slurm queues the job")
def unlock(st: _State, force: bool) -> None:
    """Remove the fleet lock that launch and deploy hold, on every reachable node: a stale one
    (its command has ended), or a live one with --force."""
    inv = st.inv
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


def _warn(text: str) -> None:
    click.echo(f"warning: {text}", err=True)


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="ddp-deploy")


__all__ = ["cli", "main", "InputError"]
