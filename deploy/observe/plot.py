"""A PNG of a job's metrics: loss, accuracy and throughput against the global step, one colour per run.

The input is the text of the job's ``metrics.jsonl`` (or a log's ``METRICS`` lines): the records
trainer/metrics.py writes, each of a launch tagged with its run id (``"run"``). A run that file
has no record of (any program but the built-in trainer) is read from the ``METRICS`` lines of its
kept logs (deploy/job/runs.py) instead; a picture with such a run draws every numeric field, one
panel each, against ``step`` (or the line's order where the run's lines have none), the lines of
each ``kind`` (docs/own-code.md: ``train``, ``eval``) a curve of their own. The lines are
job data: one that is not a JSON object is skipped, and so is a value that is not a finite
number within :data:`LARGEST` (matplotlib cannot lay out an axis past that). Pure functions;
matplotlib is imported by :func:`render` alone, with the Agg canvas (no display, no pyplot state),
so the rest of the tool starts without it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import NamedTuple

from agent.contract import METRICS_PREFIX as PREFIX

from ..errors import InputError, RuntimeFailure
from ..inventory import Inventory
from ..job.runs import RUN_ID, runs_dir
from ..job.runtime import as_job_argv
from ..programs import node_program
from ..text import lines, safe
from .view import split_rank

NO_RUN = "(no run id)"
"""The group of records without a run id: the trainer run by hand, or before runs had ids."""

PANELS = (
    ("loss", (("train", "loss", "train"), ("eval", "eval_loss", "eval"))),
    ("accuracy", (("train", "acc", "train"), ("eval", "eval_acc", "eval"))),
    ("throughput (samples/s)", (("train", "samples_per_s", "train"),)),
)
"""(panel title, ((record kind, record key, curve name), ...)). A curve's label is ``RUN NAME``."""

SIZE_IN, DPI = (8.0, 8.0), 100
PANEL_HEIGHT_IN, MAX_PANELS = 2.2, 12
"""A picture of any program's fields: the height of each panel, and the most panels drawn."""
LARGEST = 1e100
"""The largest magnitude drawn: two values near float's limit make an axis whose span overflows."""
TRAINER_KINDS = ("train", "eval", "resumed", "final", "stopped")
"""The built-in trainer's kinds of record: a run whose records all have one gets :data:`PANELS`."""
NOT_DRAWN = ("step", "run", "time")
"""Fields a picture of any program's runs has no panel for: the x axis, the run id, and the line's
wall-clock time (docs/own-code.md's ``report`` adds it to every line)."""
FROM_FILE, FROM_LOGS = "metrics.jsonl", "its logs' METRICS lines"

# $1 = metrics.jsonl, $2 = the runs dir. The kept runs' ids, one a line, then "@@jsonl" and the
# file (none: nothing after it). The file comes last: job data, it may hold any line.
SOURCES = node_program("sources.sh")

# $1 = the runs dir, $2... = run ids. Per run "@@run ID", then the METRICS lines of its nodes'
# logs (grep prints no other line, so none of them starts with "@@").
LOG_METRICS = node_program("log_metrics.sh")


def sources_argv(inv: Inventory) -> tuple[str, ...]:
    return as_job_argv(inv, ("sh", "-c", SOURCES, "sh", f"{inv.storage.checkpoints.host}/metrics.jsonl", runs_dir(inv)))


class Sources(NamedTuple):
    """What :data:`SOURCES` printed: the kept runs' ids, the text of metrics.jsonl."""

    kept: list[str]
    text: str


def parse_sources(stdout: str) -> Sources:
    head, _, text = stdout.partition("@@jsonl\n")
    return Sources([line for line in lines(head) if RUN_ID.fullmatch(line)], text)


def log_metrics_argv(inv: Inventory, runs: Sequence[str]) -> tuple[str, ...]:
    return as_job_argv(inv, ("sh", "-c", LOG_METRICS, "sh", runs_dir(inv), *runs))


def wanted_runs(known: Sequence[str], wanted: Sequence[str]) -> list[str]:
    """The runs of ``known`` that ``wanted`` names (an id or the start of one); all without it."""
    return [r for r in known if not wanted or any(r == w or r.startswith(w) for w in wanted)]


def log_records(stdout: str) -> dict[str, list[dict]]:
    """The records of each run in what :data:`LOG_METRICS` printed, in log order: those of the
    lowest rank that printed any (rank 0 prints them; a program printing them on every rank
    would draw each curve once per rank), lines without a rank only where no rank printed. A
    line's rank is its first prefix's (:func:`view.split_rank`): ``[rank1]: [rank0]: METRICS``
    is rank 1's text, no METRICS line. Runs without a record are left out."""
    runs: dict[str, dict[int | None, list[dict]]] = {}
    current = None
    for line in lines(stdout):
        if line.startswith("@@run "):
            current = runs.setdefault(line[6:].strip(), {})
            continue
        rank, rest = split_rank(line)
        if current is None or not rest.startswith(PREFIX):
            continue
        try:
            record = json.loads(rest[len(PREFIX):])
        except ValueError:
            continue
        if isinstance(record, dict):
            current.setdefault(rank, []).append(record)
    return {run: by_rank[min(by_rank, key=lambda r: (r is None, r or 0))] for run, by_rank in runs.items() if by_rank}


def number(value) -> float | None:
    """``value`` as a float to draw, or None: not a number (a bool, a string), not finite, or
    beyond :data:`LARGEST`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        v = float(value)
    except OverflowError:  # an int of hundreds of digits
        return None
    return v if math.isfinite(v) and abs(v) <= LARGEST else None


def is_trainer(records: Sequence[dict]) -> bool:
    return all(r.get("kind") in TRAINER_KINDS for r in records)


def trainer_picture(chosen: dict[str, list[dict]], from_logs: Collection[str] = ()) -> bool:
    """Whether ``chosen`` is drawn as the built-in trainer's runs (:data:`PANELS`): every run read
    from metrics.jsonl, every record of a trainer kind. A run read from its logs is any program's,
    whose ``train`` and ``eval`` lines name their fields as it likes (docs/own-code.md: an ``eval``
    line's ``acc``): every numeric field of it is drawn."""
    return not any(run in from_logs for run in chosen) and all(is_trainer(records) for records in chosen.values())


ANY_KIND = object()
""":func:`field_series`'s ``kind`` for the records of every kind."""


def kinds(records: Sequence[dict], field: str) -> list:
    """The ``kind`` of the records of ``records`` with a number in ``field``, in order of first
    appearance (None: a line without a text ``kind``): each is a curve of its own."""
    seen: dict = {}
    for record in records:
        if number(record.get(field)) is not None:
            seen.setdefault(_kind(record), None)
    return list(seen)


def _kind(record: dict) -> str | None:
    kind = record.get("kind")
    return kind if isinstance(kind, str) else None


def numeric_fields(runs: dict[str, list[dict]]) -> list[str]:
    """Every field with a number in some record of ``runs``, in order of first appearance; not
    those of :data:`NOT_DRAWN`."""
    seen: dict[str, None] = {}
    for records in runs.values():
        for record in records:
            for key, value in record.items():
                if key not in seen and key not in NOT_DRAWN and number(value) is not None:
                    seen[key] = None
    return list(seen)


def by_step(records: Sequence[dict]) -> bool:
    """Whether a run's records are drawn against their ``step`` (each has one) or their order."""
    return bool(records) and all(number(r.get("step")) is not None for r in records)


def field_series(records: Sequence[dict], field: str, kind=ANY_KIND) -> tuple[list[float], list[float]]:
    """(x, values) of ``field`` in the records of ``kind`` (:data:`ANY_KIND`: all; None: those
    without one): x the step (a ``resumed`` record drops what came after its step, as :func:`series`
    does), or the record's place among the run's METRICS lines (1, 2, ...)."""
    stepped = by_step(records)
    xs: list[float] = []
    values: list[float] = []
    for i, record in enumerate(records, 1):
        x = number(record.get("step")) if stepped else float(i)
        if stepped and record.get("kind") == "resumed":
            kept = sum(1 for s in xs if s <= x)
            xs, values = xs[:kept], values[:kept]
            continue
        value = number(record.get(field))
        if value is not None and (kind is ANY_KIND or _kind(record) == kind):
            xs.append(x)
            values.append(value)
    return xs, values


def masked(by_run: dict[str, list[dict]], redact: Callable[[str], str]) -> dict[str, list[dict]]:
    """``by_run`` with ``redact`` applied to every text in it, keys too (a program's field names are
    drawn): after parsing, so a secret equal to a word the parser reads changes nothing it decides."""
    def text(v):
        return redact(v) if isinstance(v, str) else v
    return {text(run): [{text(k): text(v) for k, v in r.items()} for r in records] for run, records in by_run.items()}


def records_by_run(text: str) -> dict[str, list[dict]]:
    """The records in ``text``, grouped by their ``run`` (:data:`NO_RUN` without one), each group
    in file order, the groups in order of their first record. Lines that are not a JSON object
    (a torn last line, a stray message) are skipped: a line ends at a newline alone, so a record
    after a ``\\r`` in another's line is that line's text, no record of its own."""
    runs: dict[str, list[dict]] = {}
    for line in lines(text):
        line = split_rank(line.strip())[1]
        if line.startswith(PREFIX):
            line = line[len(PREFIX):]
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        run = record.get("run")
        runs.setdefault(run if isinstance(run, str) and run else NO_RUN, []).append(record)
    return runs


def series(records: Sequence[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in the records of ``kind``. A ``resumed`` record drops what came
    after its step: a restarted attempt logs those steps again (TensorBoard hides them alike)."""
    steps: list[int] = []
    values: list[float] = []
    for record in records:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        if record.get("kind") == "resumed":
            kept = sum(1 for s in steps if s <= step)
            steps, values = steps[:kept], values[:kept]
        elif record.get("kind") == kind:
            value = number(record.get(key))
            if value is not None:
                steps.append(step)
                values.append(value)
    return steps, values


def require_matplotlib() -> None:
    """The operator's install (``pip install ddp-bundle``) leaves matplotlib out: say so before
    any node is asked for its metrics."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise InputError("plot needs matplotlib, which the operator's install leaves out",
                         hint="pip install 'ddp-bundle[plot]' (or [all])")


def select(runs: dict[str, list[dict]], wanted: Sequence[str] = ()) -> dict[str, list[dict]]:
    """The runs to plot: all, or those named in ``wanted`` (an id or the start of one)."""
    if not any(runs.values()):
        raise RuntimeFailure("no metrics records to plot: neither metrics.jsonl nor a kept run's logs hold one",
                             hint="no run printed a `METRICS {...}` line (docs/own-code.md: Metrics), and a run that "
                                  "has ended prints none more; a run still going prints its first after its first "
                                  "logging interval")
    chosen: dict[str, list[dict]] = {}
    for name in wanted:
        found = [run for run in runs if run == name] or [run for run in runs if run.startswith(name)]
        if not found:
            raise InputError(f"run {name!r} has no metrics records",
                             hint=f"runs with records: {', '.join(runs)}")
        if len(found) > 1:
            raise InputError(f"run {name!r} names {len(found)} runs ({', '.join(found)})",
                             hint="give more of the id")
        chosen[found[0]] = runs[found[0]]
    return chosen or dict(runs)


def wrote(path: str | Path, chosen: dict[str, list[dict]], sources: dict[str, str]) -> str:
    """What ``plot`` says it drew: the runs, where each one's records came from, and the fields
    left out of a picture of more than :data:`MAX_PANELS`."""
    runs = ", ".join(f"{run} from {sources.get(run, FROM_FILE)}" for run in chosen)
    said = f"wrote {path}: {len(chosen)} run{'s' * (len(chosen) != 1)} ({runs})"
    if not trainer_picture(chosen, [run for run in chosen if sources.get(run, FROM_FILE) != FROM_FILE]):
        left = numeric_fields(chosen)[MAX_PANELS:]
        if left:
            said += f"; {len(left)} more field{'s' * (len(left) != 1)} not drawn ({', '.join(left[:20])})"
    return safe(said)


def render(runs: dict[str, list[dict]], path: str | Path, *, wanted: Sequence[str] = (),
           title: str = "metrics by run", from_logs: Collection[str] = ()):
    """Writes one PNG to ``path``, one colour per run, a legend naming the runs: the built-in
    trainer's runs get a panel per :data:`PANELS` entry, x the global step (train solid, eval
    dashed with dots; the lines' data are exactly :func:`series` per run); a picture with any
    other program's run (``from_logs``: the runs read from their logs' METRICS lines, or of kinds
    the trainer has not) gets a panel per numeric field (:func:`numeric_fields`, the first
    :data:`MAX_PANELS`), a line per run and kind, :func:`field_series`. Returns the
    ``matplotlib.figure.Figure``."""
    chosen = select(runs, wanted)
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Run ids and field names are job data: a "$" in them is text, not mathtext to parse.
    with matplotlib.rc_context({"text.parse_math": False}):
        trainer = trainer_picture(chosen, from_logs)
        fields = [] if trainer else numeric_fields(chosen)[:MAX_PANELS]
        if not trainer and not fields:
            raise RuntimeFailure(f"no numeric field to plot in run(s) {safe(', '.join(chosen))}",
                                 hint="a METRICS line is a JSON object of numbers, e.g. "
                                      '{"step": 10, "loss": 0.5}')
        size = SIZE_IN if trainer else (SIZE_IN[0], max(4.0, PANEL_HEIGHT_IN * len(fields)))
        fig = Figure(figsize=size, dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(PANELS) if trainer else len(fields), 1, sharex=True, squeeze=False)[:, 0]
        if trainer:
            _trainer_panels(axes, chosen)
        else:
            _field_panels(axes, chosen, fields)
        fig.suptitle(safe(title))
        try:
            fig.savefig(path, format="png")
        except OSError as exc:
            raise InputError(f"cannot write {path}: {exc.strerror or exc}", hint="give a writable path") from exc
    return fig


def _trainer_panels(axes, chosen: dict[str, list[dict]]) -> None:
    plotted = 0
    for ax, (panel, curves) in zip(axes, PANELS):
        for colour, (run, records) in enumerate(chosen.items()):
            for kind, key, name in curves:
                steps, values = series(records, kind, key)
                if not steps:
                    continue
                style = {"linestyle": "-"} if kind == "train" else {"linestyle": "--", "marker": "o", "markersize": 4}
                ax.plot(steps, values, color=f"C{colour % 10}", label=safe(f"{run} {name}"), **style)
                plotted += 1
        ax.set_title(panel, loc="left", fontsize="medium")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    if not plotted:
        raise RuntimeFailure(f"no train or eval records to plot in run(s) {safe(', '.join(chosen))}",
                             hint="a run that has ended logged none; a run still going logs its first after its "
                                  "first logging interval")
    axes[-1].set_xlabel("global step")


def _field_panels(axes, chosen: dict[str, list[dict]], fields: Sequence[str]) -> None:
    for ax, field in zip(axes, fields):
        for colour, (run, records) in enumerate(chosen.items()):
            of_kinds = kinds(records, field)
            for kind in of_kinds:
                xs, values = field_series(records, field, kind)
                if not xs:
                    continue
                label = run if len(of_kinds) == 1 or kind is None else f"{run} {kind}"
                style = ({"linestyle": "--", "marker": "o", "markersize": 4} if kind == "eval"
                         else {"marker": "." if len(xs) < 50 else None})
                ax.plot(xs, values, color=f"C{colour % 10}", label=safe(label), **style)
        ax.set_title(safe(field), loc="left", fontsize="medium")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    stepped = {by_step(records) for records in chosen.values()}
    axes[-1].set_xlabel("step" if stepped == {True} else "METRICS line (1 = the run's first)" if stepped == {False}
                        else "step, or METRICS line where a run's lines have no step")
