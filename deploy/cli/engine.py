"""One interface for every engine a job runs on (torchx's schedulers are the model).

An engine is how the job's processes get started, watched and ended: the SSH fleet
(``hosts.yaml``'s ``nodes:``, engine_fleet.py) or Slurm (``slurm:``, engine_slurm.py);
Kubernetes is export only, from any hosts.yaml. Each engine implements the same verbs, with the
same options; a verb that does not apply to an engine is named in its ``limits``, with why, and
refused with that reason (exit 2). The CLI parses the options, picks the engine
(choose.py) and calls the verb: it knows of no engine.

The verbs that read only the shared volume (``runs``, ``plot``) and ``export`` are the same on
every engine and live here.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar, Protocol

import click
from rich.table import Column

from ..engines import fleet
from ..errors import InputError
from ..inventory import Inventory
from ..job import runs
from ..text import safe
from ..nodes.remote import Remote
from . import render
from .table import DataTable, cell


class Invocation(Protocol):
    """What a verb runs with: the inventory, the file it came from, and the masking of secrets."""

    hosts: str

    @property
    def inv(self) -> Inventory: ...

    def redact(self, text: str) -> str: ...


def _limited(verb):
    """A verb that an engine may not have: the base's version refuses it with the engine's reason."""
    verb.refuses = True
    return verb


class Engine(ABC):
    """The verbs of one engine. Every verb in ``VERBS`` is either implemented by the engine or
    named in its ``limits``, which the base's ``join`` and ``unlock`` refuse with (the abstract verbs
    every engine has; tests/test_deploy_engines.py holds each engine to the rule)."""

    name: ClassVar[str]
    VERBS: ClassVar[tuple[str, ...]] = ("validate", "check", "deploy", "launch", "join", "status", "doctor", "logs",
                                        "runs", "plot", "stop", "watch", "export", "unlock", "jobs")
    limits: ClassVar[dict[str, str]] = {}  # verb -> why it does not apply to this engine

    def __init__(self, st: Invocation) -> None:
        self.st = st

    @property
    def inv(self) -> Inventory:
        return self.st.inv

    @classmethod
    @abstractmethod
    def serves(cls, inv: Inventory) -> bool:
        """Whether this engine runs the job that ``inv`` describes."""

    def refuse(self, verb: str) -> None:
        raise InputError(f"{verb}: not on {self.name}: {self.limits[verb]}")

    # --- each engine's own ------------------------------------------------------------------------

    @abstractmethod
    def validate(self) -> None:
        """Parse and check the inventory; no connection."""

    @abstractmethod
    def check(self, network: bool, network_mb: float) -> None:
        """The preflight checks where the job will run (``network``: an all-reduce across the nodes too)."""

    @abstractmethod
    def deploy(self, dry_run: bool, build: bool, wait_lock: float = 0.0) -> None:
        """Make the shared directories and get the job's image or interpreter ready (``wait_lock``:
        seconds to wait for the same job's command that holds its lock, where there is one)."""

    @abstractmethod
    def launch(self, dry_run: bool, wait: bool, timeout: float | None, wait_lock: float = 0.0) -> None:
        """Start the job, all or nothing (``wait``: follow it to its end, exit code as its outcome;
        ``wait_lock`` as for deploy)."""

    @_limited
    def join(self, node: str, dry_run: bool) -> None:
        self.refuse("join")

    @abstractmethod
    def status(self, as_json: bool, follow: bool, run_id: str | None) -> None:
        """Each node's state and progress (``run_id``: a kept run's; ``follow``: until the job ends)."""

    @abstractmethod
    def doctor(self, as_json: bool) -> None:
        """What every rank of the running job is doing, grouped by where the ranks wait."""

    @abstractmethod
    def logs(self, follow: bool, tail: int | None, only_nodes: tuple[str, ...], only_ranks: tuple[int, ...],
             run_id: str | None) -> None:
        """Every node's output, each line labelled with its node and rank."""

    @abstractmethod
    def stop(self, dry_run: bool, now: bool) -> None:
        """End the job (a checkpoint first unless ``now``); idempotent."""

    @_limited
    def watch(self, run_id: str | None, detach: bool) -> None:
        self.refuse("watch")

    @_limited
    def unlock(self, force: bool) -> None:
        self.refuse("unlock")

    @_limited
    def jobs(self, as_json: bool) -> None:
        self.refuse("jobs")

    @abstractmethod
    def running(self, remote: Remote) -> bool:
        """Whether the job's newest run still runs."""

    @_limited
    def batch_script(self) -> str:
        """What ``export slurm`` prints: the exact batch script ``launch`` submits."""
        raise InputError("export slurm: hosts.yaml has no slurm: section",
                         hint="add slurm: (login, nodes, ...) in place of nodes: (docs/slurm-kubernetes.md)")

    # --- the same on every engine -----------------------------------------------------------------

    def runs(self, as_json: bool) -> None:
        inv, redact = self.inv, self.st.redact
        with Remote(inv) as remote:
            kept = fleet.kept_runs(inv, remote, "", redact).runs
            running = bool(kept) and kept[-1].end is None and self.running(remote)
            good = fleet.goodputs(inv, remote, kept, running, render.warn)
        if as_json:
            click.echo(json.dumps([{"id": r.id, "start": r.start, "end": r.end,
                                    "outcome": "running" if running and r is kept[-1] else r.outcome(),
                                    "stopped": r.stop_data(),
                                    "goodput": good[r.id].as_data() if good.get(r.id) else None,
                                    "heals": [e.as_data() for e in r.heals],
                                    "nodes": {n: {"exits": [list(e) for e in nr.exits], "metrics": nr.metrics,
                                                  "stopped": nr.stop.as_data() if nr.stop else None,
                                                  "formed": nr.formed,
                                                  "stalls": [k.as_data() for k in nr.stalls]}
                                              for n, nr in r.nodes.items()},
                                    "record": r.record} for r in kept]))
            return
        if not kept:
            click.echo(f"no run of {inv.job.name} is kept in {runs.runs_dir(inv)}")
            return
        table = DataTable(Column("run", no_wrap=True), Column("took", no_wrap=True), "nodes", "program", "code",
                          "image", Column("outcome", no_wrap=True), Column("goodput", no_wrap=True),
                          Column("stalls", no_wrap=True),
                          title=f"runs of {inv.job.name} (the newest {inv.job.keep_runs} are kept; the id starts "
                                "with the UTC start time)")
        for r in kept:
            outcome = cell("running", "green") if running and r is kept[-1] else r.outcome()
            table.add_row(r.id, fleet.when(r).took or "-", str(len(r.nodes)), r.field("program") or "?",
                          (r.field("code_snapshot") or "-")[:8], (r.image_id or "-").removeprefix("sha256:")[:8],
                          outcome, good[r.id].text() if good.get(r.id) else "-", r.stall_text())
        render.out.print(table)
        for r in kept:  # each decision of the job's watcher (heal.watch), with the run it was about
            for e in r.heals:
                click.echo(safe(redact(f"{r.id}: {e.describe()}")))

    def plot(self, run_ids: tuple[str, ...], output: str | None) -> None:
        path = output or f"{self.inv.job.name}-metrics.png"
        with Remote(self.inv) as remote:
            click.echo(fleet.plot(self.inv, remote, path, run_ids, self.st.redact, render.warn))

    def export(self, target: str, kind: str, namespace: str | None, pvc: str | None, image_ref: str | None,
               output: str | None) -> None:
        if target == "slurm":
            text = self.batch_script()
        else:
            from ..engines import k8s

            inv = self.inv
            text = k8s.render(inv, k8s.manifests(inv, kind=kind, namespace=namespace, pvc=pvc, image=image_ref))
        if output is None:
            click.echo(text, nl=not text.endswith("\n"))
            return
        Path(output).write_text(text)
        click.echo(f"wrote {output}", err=True)


__all__ = ["Engine", "Invocation"]
