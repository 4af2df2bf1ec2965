"""A PNG of a job's metrics: loss, accuracy and throughput against the global step, one colour per run.

The input is the text of the job's ``metrics.jsonl`` (or a log's ``METRICS`` lines): the records
trainer/metrics.py writes, each of a launch tagged with its run id (``"run"``). Pure functions;
matplotlib is imported by :func:`render` alone, with the Agg canvas (no display, no pyplot state),
so the rest of the tool starts without it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from trainer.output import PREFIX, RANK_PREFIXES

from .errors import InputError, RuntimeFailure

NO_RUN = "(no run id)"
"""The group of records without a run id: the trainer run by hand, or before runs had ids."""

PANELS = (
    ("loss", (("train", "loss", "train"), ("eval", "eval_loss", "eval"))),
    ("accuracy", (("train", "acc", "train"), ("eval", "eval_acc", "eval"))),
    ("throughput (samples/s)", (("train", "samples_per_s", "train"),)),
)
"""(panel title, ((record kind, record key, curve name), ...)). A curve's label is ``RUN NAME``."""

SIZE_IN, DPI = (8.0, 8.0), 100


def records_by_run(text: str) -> dict[str, list[dict]]:
    """The records in ``text``, grouped by their ``run`` (:data:`NO_RUN` without one), each group
    in file order, the groups in order of their first record. Lines that are not a JSON object
    (a torn last line, a stray message) are skipped."""
    runs: dict[str, list[dict]] = {}
    for line in text.splitlines():
        line = RANK_PREFIXES.sub("", line.strip(), count=1)
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
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                steps.append(step)
                values.append(float(value))
    return steps, values


def select(runs: dict[str, list[dict]], wanted: Sequence[str] = ()) -> dict[str, list[dict]]:
    """The runs to plot: all, or those named in ``wanted`` (an id or the start of one)."""
    if not any(runs.values()):
        raise RuntimeFailure("no metrics records to plot",
                             hint="the job has not logged one yet: wait for its first logging interval, "
                                  "or check that this is the job's metrics.jsonl")
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


def render(runs: dict[str, list[dict]], path: str | Path, *, wanted: Sequence[str] = (),
           title: str = "metrics by run"):
    """Writes one PNG to ``path``: a panel per :data:`PANELS` entry, x the global step, one colour
    per run (train solid, eval dashed with dots), a legend naming the runs. Returns the
    ``matplotlib.figure.Figure`` (its lines' data are exactly :func:`series` per run)."""
    chosen = select(runs, wanted)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    plotted = 0
    for ax, (panel, curves) in zip(axes, PANELS):
        for colour, (run, records) in enumerate(chosen.items()):
            for kind, key, name in curves:
                steps, values = series(records, kind, key)
                if not steps:
                    continue
                style = {"linestyle": "-"} if kind == "train" else {"linestyle": "--", "marker": "o", "markersize": 4}
                ax.plot(steps, values, color=f"C{colour % 10}", label=f"{run} {name}", **style)
                plotted += 1
        ax.set_title(panel, loc="left", fontsize="medium")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    if not plotted:
        raise RuntimeFailure(f"no train or eval records to plot in run(s) {', '.join(chosen)}",
                             hint="the job has not finished a logging interval yet")
    axes[-1].set_xlabel("global step")
    fig.suptitle(title)
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}", hint="give a writable path") from exc
    return fig
