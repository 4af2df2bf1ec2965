"""How the CLI shows what the procedures (deploy/engines/fleet/) and the nodes said: tables, command
lines, progress and warnings, every one of them as text (a node's words may hold escapes or markup)."""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import asdict
from typing import TYPE_CHECKING

import click

from ..checks import netcheck
from ..engines import fleet
from ..job import phases, record
from ..nodes.remote import command_line
from ..observe import doctor, view
from ..job.plan import NodeState
from ..text import safe
from .table import DataTable, Screen, cell

if TYPE_CHECKING:
    from rich.table import Table

out = Screen(highlight=False, soft_wrap=True)  # tables at full width where stdout is no terminal


def states_table(job: str, ranks: dict[str, int | None], states: dict[str, NodeState]) -> Table:
    """The ``status`` table; a node's ranks None: not known (a kept run's record does not say)."""
    t = DataTable(*view.COLUMNS, title=f"job {job}")
    for n, s in states.items():
        color = "yellow" if s.stall else {"running": "green", "exited(0)": "cyan"}.get(s.state, "red")
        cells = view.Progress.from_line(s.metrics).cells()
        t.add_row(n, cell(view.state_text(s), style=color), "-" if ranks[n] is None else str(ranks[n]),
                  *(cells[c] for c in view.COLUMNS[3:]))
    return t


def jobs_table(found: fleet.FleetJobs) -> None:
    """``jobs``: one row per job (its name, run and uid), its state and newest step as its launchers
    tell them, its nodes with the GPUs each holds."""
    import time

    t = DataTable("job", "run", "user", "state", "step", "nodes", "GPUs", "since", title="jobs on the nodes")
    for j in found.jobs:
        gpus = "; ".join(f"{n}: {','.join(map(str, g))}" for n, g in j.nodes.items() if g) or "-"
        t.add_row(j.job, j.run or "-", f"{j.user} (uid {j.uid})",
                  cell(j.state, style="yellow" if "stalled" in j.state else ""), "-" if j.step is None else str(j.step),
                  ", ".join(j.nodes), gpus, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.since)))
    if found.jobs:
        Screen().print(t)
    else:
        click.echo("no job of this tool runs on the nodes that answered")


def show(node: str, argv) -> None:
    """A node's command as its shell receives it, each line under the node's name (a node program
    spans lines)."""
    for line in command_line(argv).split("\n"):
        click.echo(f"[{node}] {line}")


def warn(text: str) -> None:
    click.echo(safe(f"warning: {text}"), err=True)


def say(text: str) -> None:
    """A procedure's line of progress (deploy/engines/fleet/'s ``say``), shown as text."""
    click.echo(safe(text))


@contextlib.contextmanager
def shipping():
    """A shipment's progress on stderr, one line per node that gets the image: its stage, bytes, rate."""
    from rich.console import Console  # rich's live displays: imported by the verbs that show one
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

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

        yield report


def print_network(report: dict) -> None:
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


def print_checks(checks) -> None:
    table = DataTable("node", "check", "result", "detail", title="preflight")  # a detail quotes the node
    for c in checks:
        table.add_row(c.node, c.name, cell("ok", "green") if c.ok else cell("FAIL", "red"), c.detail)
    out.print(table)


def status_table(inv, states):
    """Every node's row: a spare's too, where a --with (or the job's watcher) put the job there."""
    return states_table(inv.job.name, {n: inv.node(n).nprocs for n in states}, states)


def print_status(inv, states) -> None:
    out.print(status_table(inv, states))


def print_findings(stalled: str | None, first, untrained: str | None) -> None:
    """What ``status`` says under its table: a stall's culprit (deploy/observe/doctor.py), the first
    failure, and a run that exited 0 having trained nothing."""
    if stalled:
        click.echo(safe(f"stalled: {stalled} (`ddp-deploy doctor` shows each rank)"))
    if first:
        click.echo(f"first failure: {first.describe()}")
    if untrained:
        click.echo(f"{untrained} ({fleet.NOTHING_TRAINED_HINT})")


def show_diagnosis(found: doctor.Diagnosis, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(asdict(found)))
        return
    click.echo(safe(found.summary))
    for line in doctor.detail(found):
        click.echo(safe(line))


def follow(inv, remote, timeout, redact, run: str | None = None):
    """Waits for the job's end, showing every node's state and progress as it goes: a table
    redrawn in place on a terminal, plain lines otherwise (CI logs, pipes); with ``run`` (the
    launch's), its first step too, kept in its record (deploy/job/phases.py FirstStep)."""
    first = phases.FirstStep(say, lambda found: record.keep_first_step(inv, remote, fleet.readers(inv)[0].name, run,
                                                                      found, warn)) if run else None
    with contextlib.ExitStack() as screen:
        if out.is_terminal:
            from rich.live import Live

            live = screen.enter_context(Live(console=out, refresh_per_second=2, transient=True))
            show = lambda states: live.update(status_table(inv, states))  # noqa: E731
        else:
            show = view.PlainFollower(click.echo).update
        watched = show if first is None else lambda states: (show(states), first.see(states))  # noqa: E731
        final = fleet.wait(inv, remote, timeout, redact, show=watched, say=say,
                           last=lambda states: print_status(inv, states))
    print_status(inv, final)
    if first:
        first.end()
    return final


def kept_status(inv, remote, wanted: str, as_json: bool, redact, running=lambda: False) -> None:
    """``status --run``: how each node of a kept run ended, its last metrics, the first failure,
    its goodput (``running()``: whether the job's newest run runs still)."""
    kept = fleet.kept_run(inv, remote, wanted, redact, "status --run")
    reader, run = kept.reader, kept.run
    states = {n: r.state() for n, r in run.nodes.items()}
    ranks = {n: run.procs(n) for n in states}
    first = fleet.kept_failure(inv, remote, reader, run.id, fleet.witnesses(states), redact)
    stalls = fleet.kept_stalls(inv, remote, reader, run, redact)
    live = run.end is None and fleet.kept_runs(inv, remote, "", redact).runs[-1].id == run.id and running()
    good = fleet.goodputs(inv, remote, [run], live, warn).get(run.id)
    if as_json:
        click.echo(json.dumps({"run": run.id, "start": run.start, "end": run.end, "outcome": run.outcome(),
                               "stopped": run.stop_data(),
                               "nodes": [{**view.as_data(n, ranks[n], s), "exits": [list(e) for e in run.nodes[n].exits],
                                          "stopped": run.nodes[n].stop.as_data() if run.nodes[n].stop else None,
                                          "formed": run.nodes[n].formed,
                                          "first_failure": asdict(first) if first and first.node == n else None,
                                          "stalls": [k.as_data() for k in run.nodes[n].stalls]}
                                         for n, s in states.items()],
                               "stalls": stalls, "goodput": good.as_data() if good else None, "record": run.record}))
        return
    started, took = fleet.when(run)
    click.echo(safe(f"run {run.id}: started {started}{f', took {took}' if took else ''}: "
                    f"{run.field('program') or '?'}: {run.outcome()}"))
    prepared = phases.describe(run.record.get("launch_phases"))
    if prepared:
        click.echo(f"launch before the start {prepared}")
    click.echo(phases.describe_first(run.record.get("first_step")) or "first step: not known (kept by `launch --wait`)")
    out.print(states_table(inv.job.name, ranks, states))
    if good:
        click.echo(good.describe())
    if first:
        click.echo(f"first failure: {first.describe()}")
    for kept in stalls:
        click.echo(safe(view.kept_stall_line(kept)))
        if kept["diagnosis"]:
            click.echo(safe(f"  why: {kept['diagnosis']}"))
