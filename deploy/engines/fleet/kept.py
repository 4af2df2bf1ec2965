"""The runs kept on the shared volume: their list, one run, its failure and stalls, goodput,
metrics and plots."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple
from pathlib import Path

from ...errors import InputError, RuntimeFailure
from ...job import runs, secretenv
from ...observe import doctor, failure, goodput, view
from ...observe.goodput import Goodput
from ...observe import plot as plotting
from .common import FAILURE_TAIL, Say, on_any_node, quiet


class When(NamedTuple):
    """When a run started (local time) and how long it took (None: not every node has ended)."""

    started: str
    took: str | None


def when(run: runs.Run) -> When:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.start)) if run.start else "?"
    return When(started, view.duration(run.end - run.start) if run.start and run.end else None)


@dataclass(frozen=True)
class KeptRuns:
    """Kept runs, and the node that read them (where more of them is read: the shared volume)."""

    reader: str
    runs: list[runs.Run]


@dataclass(frozen=True)
class KeptRun:
    """One kept run, and the node that read it."""

    reader: str
    run: runs.Run


def kept_runs(inv, remote, prefix: str, redact) -> KeptRuns:
    """The kept runs whose id starts with ``prefix``, and the node that read them."""
    got = on_any_node(inv, remote, runs.list_argv(inv, prefix), f"the kept runs in {runs.runs_dir(inv)}")
    return KeptRuns(got.node, secretenv.masked(runs.parse(got.result.stdout), redact))


def kept_run(inv, remote, wanted: str, redact, verb: str) -> KeptRun:
    kept = kept_runs(inv, remote, wanted, redact)
    try:
        return KeptRun(kept.reader, runs.pick(kept.runs, wanted))
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
        got = on_any_node(inv, remote, plotting.sources_argv(inv),
                          f"the metrics in {inv.storage.checkpoints.host}").result
    except RuntimeFailure as e:
        warn(f"goodput not shown: {e}")
        return {}
    # unmasked: a secret equal to a word the reckoning reads ("train") must not change it; none of
    # the records' text is shown
    by_run = plotting.records_by_run(plotting.parse_sources(got.stdout).text)
    now = time.time()
    return {r.id: goodput.of_run(by_run.get(r.id, []), r.start, r.end,
                                 now if running and r is kept[-1] else (goodput.last_time(by_run.get(r.id, [])) or now))
            for r in kept}


@dataclass(frozen=True)
class Metrics:
    """Each run's metrics records, and where they came from for the runs read from logs."""

    by_run: dict[str, list[dict]]
    sources: dict[str, str]


def metrics(inv, remote, run_ids: tuple[str, ...] = (), redact: Callable[[str], str] = str,
            warn: Say = quiet) -> Metrics:
    """The metrics records of each run (all, or those ``run_ids`` name: an id or its start), from
    metrics.jsonl on the shared volume, or from a run's kept logs (its program's METRICS lines)
    where the file knows nothing of it; secrets masked after parsing. And where each run's came
    from, for the runs read from logs."""
    answer = on_any_node(inv, remote, plotting.sources_argv(inv), f"the metrics in {inv.storage.checkpoints.host}")
    reader, got = answer.node, answer.result
    sources = plotting.parse_sources(got.stdout)  # parsed first, masked after (below)
    by_run = plotting.records_by_run(sources.text)
    missing = [r for r in plotting.wanted_runs(sources.kept, run_ids) if r not in by_run]
    from_logs = {}
    if missing:  # runs metrics.jsonl knows nothing of: their programs' METRICS lines
        read = remote.run({reader: plotting.log_metrics_argv(inv, missing)}, check=False, timeout=120)[reader]
        if read.ok:
            from_logs = plotting.log_records(read.stdout)
        else:
            warn(f"{reader}: the logs of {', '.join(missing)} were not read: {read.summary()}")
    return Metrics(plotting.masked({**by_run, **from_logs}, redact), {run: plotting.FROM_LOGS for run in from_logs})


def plot(inv, remote, path: str | Path, run_ids: tuple[str, ...] = (), redact: Callable[[str], str] = str,
         warn: Say = quiet) -> str:
    """One PNG of the runs' metrics at ``path`` (deploy/observe/plot.py; needs matplotlib): what
    it drew, as a line."""
    plotting.require_matplotlib()
    got = metrics(inv, remote, run_ids, redact, warn)
    plotting.render(got.by_run, path, wanted=run_ids, title=f"{inv.job.name}: metrics by run", from_logs=got.sources)
    return plotting.wrote(path, plotting.select(got.by_run, run_ids), got.sources)


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
        found = kept_runs(inv, remote, "", redact)
        reader, kept = found.reader, found.runs
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
