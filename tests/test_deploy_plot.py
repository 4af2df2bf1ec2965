"""deploy/observe/plot.py: one PNG of a job's metrics, its runs overlaid, from a real metrics.jsonl.

The records come from the real trainer: one job, launched twice (two run ids), the second launch
resuming from the first one's checkpoint and training one more epoch, as an operator's job does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy
import pytest

from deploy.errors import InputError, RuntimeFailure
from deploy.observe import plot as plotting
from deploy.observe.plot import NO_RUN, PANELS, SIZE_IN, DPI, records_by_run, render, series
from agent.contract import RUN_ID_ENV
from local_job import kept_run
from trainer_helpers import ROOT, SMALL, trainer_env

FIRST, SECOND = "20261123-101500-a1b2", "20261123-104000-c3d4"
FLAGS = [*SMALL, "--device", "cpu"]  # one process; --epochs given after these wins


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> str:
    """The text of a job's metrics.jsonl after two launches: epoch 1, then (resumed) epoch 2."""
    tmp = tmp_path_factory.mktemp("job")
    for run, epochs in ((FIRST, "1"), (SECOND, "2")):
        proc = subprocess.run([sys.executable, "-m", "trainer", "--data-dir", str(tmp / "data"),
                               "--ckpt-dir", str(tmp / "ckpt"), *FLAGS, "--epochs", epochs],
                              env={**trainer_env(), RUN_ID_ENV: run}, capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return (tmp / "ckpt" / "metrics.jsonl").read_text()


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def plotted(fig) -> dict[tuple[str, str], tuple[list, list]]:
    """(panel title, line label) -> the line's (x, y) data, as drawn."""
    return {(ax.get_title(loc="left"), line.get_label()): (list(line.get_xdata()), list(line.get_ydata()))
            for ax in fig.axes for line in ax.get_lines()}


def test_records_are_grouped_by_run_in_file_order(job):
    every = records(job)
    runs = records_by_run(job)
    assert list(runs) == [FIRST, SECOND]
    assert runs[FIRST] + runs[SECOND] == every  # the first launch's records all come first
    assert [r["kind"] for r in runs[SECOND]][0] == "resumed"
    assert {r["kind"] for r in runs[FIRST]} == {"train", "eval", "final"}


def test_records_without_a_run_id_form_one_group_and_malformed_lines_are_skipped(job):
    lines = job.splitlines()
    untagged = [json.dumps({k: v for k, v in json.loads(line).items() if k != "run"}) for line in lines[:3]]
    text = "\n".join(["not json", "[1, 2]", *untagged, lines[3][:40], "[rank0]: METRICS " + lines[4], ""])
    runs = records_by_run(text)
    assert list(runs) == [NO_RUN, FIRST]
    assert runs[NO_RUN] == [json.loads(line) for line in untagged]
    assert runs[FIRST] == [json.loads(lines[4])]  # a log's METRICS line reads as the file's line


def test_the_plotted_lines_are_exactly_each_runs_records(job, tmp_path):
    runs = records_by_run(job)
    lines = plotted(render(runs, tmp_path / "job.png"))
    expected = {}
    for title, curves in PANELS:
        for run in (FIRST, SECOND):
            for kind, key, name in curves:
                mine = [r for r in runs[run] if r["kind"] == kind]
                expected[(title, f"{run} {name}")] = ([r["step"] for r in mine], [r[key] for r in mine])
    assert lines == expected
    assert lines[("loss", f"{SECOND} train")][0][0] > lines[("loss", f"{FIRST} train")][0][-1]  # resumed after it
    assert lines[("loss", f"{FIRST} eval")] == ([32], [runs[FIRST][-2]["eval_loss"]])


def test_each_run_has_its_own_colour_and_a_legend_entry(job, tmp_path):
    fig = render(records_by_run(job), tmp_path / "job.png")
    colours = {line.get_label().split()[0]: line.get_color() for ax in fig.axes for line in ax.get_lines()}
    assert len(set(colours.values())) == 2
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [line.get_label() for line in ax.get_lines()]
    assert fig.axes[-1].get_xlabel() == "global step"


def test_the_file_is_a_png_of_the_figure_size_with_both_runs_drawn(job, tmp_path):
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    path = tmp_path / "job.png"
    render(records_by_run(job), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(path)
    assert pixels.shape == (int(SIZE_IN[1] * DPI), int(SIZE_IN[0] * DPI), 4)
    rgb = pixels[..., :3]
    assert (rgb.min(axis=2) < 0.9).mean() > 0.02  # far from blank
    for colour in ("C0", "C1"):  # each run's lines are on it
        near = (numpy.abs(rgb - numpy.array(to_rgb(colour))).max(axis=2) < 0.05).sum()
        assert near > 500, colour


def test_wanted_runs_alone_are_drawn_and_the_start_of_an_id_names_one(job, tmp_path):
    fig = render(records_by_run(job), tmp_path / "one.png", wanted=[SECOND[:17]])
    assert {label.split()[0] for _, label in plotted(fig)} == {SECOND}


def test_a_run_without_records_is_an_input_error_naming_the_runs_that_have_some(job, tmp_path):
    with pytest.raises(InputError) as caught:
        render(records_by_run(job), tmp_path / "x.png", wanted=["20261124"])
    (line,) = caught.value.lines()
    assert "'20261124' has no metrics records" in line and FIRST in line and SECOND in line
    assert caught.value.exit_code == 2
    assert not (tmp_path / "x.png").exists()


def test_a_prefix_of_several_runs_asks_for_more_of_the_id(job, tmp_path):
    with pytest.raises(InputError, match="names 2 runs.*give more of the id"):
        render(records_by_run(job), tmp_path / "x.png", wanted=["20261123-10"])


@pytest.mark.parametrize("text", ["", "\n", "not json\n{\"torn\": \n"])
def test_no_records_at_all_is_a_one_line_failure(text, tmp_path):
    with pytest.raises(RuntimeFailure, match="no metrics records to plot") as caught:
        render(records_by_run(text), tmp_path / "x.png")
    assert len(caught.value.lines()) == 1 and caught.value.exit_code == 1


def test_a_run_that_has_only_resumed_is_a_failure_not_an_empty_picture(job, tmp_path):
    resumed = records_by_run(job)[SECOND][:1]
    with pytest.raises(RuntimeFailure, match=f"no train or eval records to plot in run\\(s\\) {SECOND}"):
        render({SECOND: resumed}, tmp_path / "x.png")


def test_an_unwritable_path_is_an_input_error(job, tmp_path):
    with pytest.raises(InputError, match="cannot write"):
        render(records_by_run(job), tmp_path / "missing" / "x.png")


def test_a_resumed_attempt_replaces_what_the_crashed_one_logged_after_its_checkpoint(job):
    first = [r for r in records_by_run(job)[FIRST] if r["kind"] == "train"]
    crashed_at = first[3]["step"]  # the attempt logged up to here, its checkpoint was of first[1]'s step
    again = [*first[:4], {"kind": "resumed", "step": first[1]["step"]}, *first[2:]]
    steps, values = series(again, "train", "loss")
    assert crashed_at in steps and steps == [r["step"] for r in first]
    assert values == [r["loss"] for r in first]


def test_importing_the_module_imports_neither_matplotlib_nor_torch():
    code = "import sys, deploy.observe.plot; print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# Any program's METRICS lines, as its node's kept log holds them: rank 0's, rank 1's (the same
# program printing on every rank), torchrun's own lines, and lines no parser should trust.
PROGRAM_LOG = "\n".join([
    "W1125 16:07:26.473000 8395 torch/distributed/run.py:982] setting OMP_NUM_THREADS",
    '[rank0]: METRICS {"step": 1, "loss": 2.5, "lr": 0.1, "note": "warming up", "$\\\\frac{": 1}',
    '[rank1]: METRICS {"step": 1, "loss": 9.9, "lr": 0.1}',
    "[rank0]: METRICS not json {",
    '[rank0]: METRICS ["a", "list"]',
    '[rank0]: METRICS {"step": 2, "loss": "NaN", "lr": 1e308, "huge": ' + "9" * 400 + '}',
    '[rank0]: METRICS {"step": 3, "loss": 1.5, "lr": 0.05, "flag": true, "inf": Infinity}',
    "[rank0]: epoch 1 done",
    '[rank0]: [rank0]: METRICS {"step": 4, "loss": 1.0, "lr": 0.05}',
    "",
])
RUN = "20261125-120000-beef"


def test_a_program_s_metrics_lines_are_read_from_its_log_skipping_non_objects():
    runs = plotting.log_records(f"@@run {RUN}\n{PROGRAM_LOG}@@run 20261125-130000-0000\n")
    assert list(runs) == [RUN]  # a run without a METRICS line is left out
    assert [r["step"] for r in runs[RUN]] == [1, 2, 3, 4]  # rank 0's alone, prefixed once or twice
    assert plotting.numeric_fields(runs) == ["loss", "lr", "$\\frac{"]


def test_a_log_s_metrics_line_is_of_the_rank_its_prefix_names_not_one_it_printed():
    logs = (f"@@run {RUN}\n" '[rank1]: [rank0]: METRICS {"step": 7, "loss": 0.0}\n'
            '[rank0]: METRICS {"step": 1, "loss": 2.0}\n[rank1]: METRICS {"step": 1, "loss": 3.0}\n')
    assert plotting.log_records(logs) == {RUN: [{"step": 1, "loss": 2.0}]}


# What str.splitlines takes for a line's end, and a log does not: inside a line, each is data.
BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


@pytest.mark.parametrize("brk", BREAKS)
def test_a_line_break_of_splitlines_inside_a_line_starts_no_record_nor_run(brk):
    other = "20991231-000000-ffff"
    logs = (f"@@run {RUN}\n" '[rank0]: METRICS {"step": 1, "loss": 2.0}\n'
            f'[rank1]: x{brk}[rank0]: METRICS {{"step": 5, "loss": 0.1}}\n'
            f'[rank0]: METRICS {{"step": 2, "loss": 1.0}}{brk}@@run {other}{brk}[rank0]: METRICS {{"step": 9}}\n')
    assert plotting.log_records(logs) == {RUN: [{"step": 1, "loss": 2.0}]}
    kept = json.dumps({"run": RUN, "kind": "train", "step": 1, "loss": 2.0})
    jsonl = f'{kept}\n{kept}{brk}{{"run": "forged", "kind": "train", "step": 2, "loss": 0.0}}\n'
    assert records_by_run(jsonl) == {RUN: [json.loads(kept)]}


def test_a_field_is_drawn_against_the_step_leaving_out_what_is_not_a_number():
    records = plotting.log_records(f"@@run {RUN}\n{PROGRAM_LOG}")[RUN]
    assert plotting.field_series(records, "loss") == ([1.0, 3.0, 4.0], [2.5, 1.5, 1.0])  # "NaN" is a string
    assert plotting.field_series(records, "lr") == ([1.0, 3.0, 4.0], [0.1, 0.05, 0.05])  # 1e308 is beyond LARGEST
    assert plotting.field_series(records, "huge") == ([], [])  # 400 digits: no float holds it


def test_a_secret_equal_to_the_metrics_prefix_is_masked_after_the_lines_are_read():
    from deploy.job.secretenv import Redactor

    redact = Redactor({"TOKEN": "METRICS", "KEY": "s3cr3t-field"})
    log = f'@@run {RUN}\n[rank0]: METRICS {{"step": 1, "s3cr3t-field": 2.0, "note": "METRICS"}}\n'
    runs = plotting.masked(plotting.log_records(log), redact)
    assert runs == {RUN: [{"step": 1, "***": 2.0, "note": "***"}]}


def test_lines_without_a_step_are_drawn_in_their_order():
    records = [{"loss": 3.0}, {"loss": 2.0, "step": 7}, {"acc": 0.5}, {"loss": 1.0}]
    assert plotting.field_series(records, "loss") == ([1.0, 2.0, 4.0], [3.0, 2.0, 1.0])


def test_any_program_s_fields_make_a_panel_each_with_job_data_drawn_as_text(tmp_path):
    runs = plotting.log_records(f"@@run {RUN}\n{PROGRAM_LOG}")
    fig = render(runs, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["loss", "lr", "$\\frac{"]
    assert plotted(fig)[("loss", RUN)] == ([1.0, 3.0, 4.0], [2.5, 1.5, 1.0])
    assert fig.axes[-1].get_xlabel() == "step"


def test_a_run_of_strings_alone_is_a_one_line_failure(tmp_path):
    with pytest.raises(RuntimeFailure, match="no numeric field to plot in run"):
        render({RUN: [{"step": 1, "status": "ok"}]}, tmp_path / "x.png")


@pytest.fixture
def fleet(tmp_path):
    """A one-node local inventory whose shared volume holds one kept run of a program of its own:
    a log with METRICS lines, no metrics.jsonl."""
    hosts, kept = kept_run(tmp_path, job="anyprog", run=RUN, program="-m mine")
    (kept / "log").write_text(PROGRAM_LOG)
    return hosts


def test_plot_draws_a_run_from_its_log_without_metrics_jsonl_and_says_so(ddp, fleet, tmp_path):
    r = ddp(fleet, "plot", "-o", str(tmp_path / "out.png"))
    assert r.exit_code == 0, r.output
    assert r.stdout == f"wrote {tmp_path / 'out.png'}: 1 run ({RUN} from its logs' METRICS lines)\n"
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_takes_a_run_from_metrics_jsonl_when_it_has_the_run_s_records(ddp, fleet, tmp_path, job):
    (tmp_path / "nas/ckpt/metrics.jsonl").write_text(job)
    r = ddp(fleet, "plot", "-o", str(tmp_path / "out.png"), "--run", FIRST, "--run", RUN)
    assert r.exit_code == 0, r.output
    said, _, left_out = r.stdout.partition("; ")
    assert said == (f"wrote {tmp_path / 'out.png'}: 2 runs ({FIRST} from metrics.jsonl, "
                    f"{RUN} from its logs' METRICS lines)")
    fields = plotting.numeric_fields({FIRST: records_by_run(job)[FIRST], RUN: plotting.log_records(
        f"@@run {RUN}\n{PROGRAM_LOG}")[RUN]})  # the trainer's and the program's: more than a picture holds
    assert left_out == f"{len(fields) - plotting.MAX_PANELS} more fields not drawn ({', '.join(fields[12:])})\n"
