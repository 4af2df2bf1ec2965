"""What the operator's terminal shows of a job's data (its output, METRICS lines, the files on the
shared volume): text, never a control sequence the terminal acts on nor rich markup; a number
that does not fit shows as ``-``, never crashes a verb; tables print whole where stdout is a pipe.

The verbs run for real (the CLI, a one-node ``connection: local`` host-runtime inventory, real sh
reading real files); the job's state, log and kept runs are files the tests write where a job
would, so that a program's worst output is reproduced exactly, without a program."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.observe import failure, view
from deploy.job import runs
from deploy.job.plan import NodeState
from deploy.text import safe
from test_deploy_local import _inventory

# What a hostile program prints: clear screen, a window title (OSC 0, BEL-terminated), a hyperlink
# (OSC 8, ST-terminated), a clipboard write (OSC 52), a C1 CSI, a lone CR, a bidi override, a tab.
HOSTILE = ("clear\x1b[2J title\x1b]0;pwned\x07 link\x1b]8;;https://evil.example\x1b\\here\x1b]8;;\x1b\\ "
           "clip\x1b]52;c;cm0gLXJmIH4=\x07 csi\x9b31m over\rwrite bidi\u202etxt.exe\ttabbed")
CONTROLS = {chr(c) for c in [*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0)]} | {
    "\u202e", "\u202d", "\u2066", "\u2067", "\u2068", "\u2069", "\u200e", "\u200f", "\u061c"}
MARKUP = "[red]x[/red] [link=https://evil.example]y[/link]"
HUGE = "9" * 400
BAD_TIMES = ("nan", "1e999", "-1e999", "99999999999999999999999")


def _raw(text: str) -> set[str]:
    """The control characters in ``text`` that a terminal would act on (a line's end is no such)."""
    return {c for c in text.replace("\n", "") if c in CONTROLS}


@pytest.fixture
def ddp(ddp):
    """conftest's, at the width rich assumes in a pipe."""
    return lambda hosts, *args: ddp(hosts, *args, env={"COLUMNS": "80"})


@pytest.fixture
def hosts(tmp_path) -> Path:
    return _inventory(tmp_path, ["--epochs", "1"], procs=1)


def _job(tmp_path: Path) -> Path:
    return tmp_path / "nas/ckpt/.ddp-deploy/localtest"


def _ended(tmp_path: Path, exit_file: str, log: str) -> None:
    """Node ``here`` as the host runtime leaves it once its launcher has ended (scripts.HOST_STATUS)."""
    state = _job(tmp_path) / "here"
    state.mkdir(parents=True)
    (state / "pid").write_text("4194304\n")
    (state / "exit").write_text(exit_file)
    (state / "log").write_text(log)


def _kept(tmp_path: Path, record: dict, exits: str, log: str = "", node: str = "here",
          start: float = 1_700_000_000) -> str:
    """A kept run as a launch leaves it on the shared volume (runs.py): its record, a node's log and exits."""
    run = runs.new_id(start)
    d = _job(tmp_path) / "runs" / run / node
    d.mkdir(parents=True)
    (d.parent / "run.json").write_text(json.dumps(record) if isinstance(record, dict) else record)
    (d / "exits").write_text(exits)
    (d / "log").write_text(log)
    return run


def _strict(text: str):
    """JSON as every other reader takes it: NaN and Infinity are no JSON."""
    def refuse(word):
        raise ValueError(f"{word} in --json output")
    return json.loads(text, parse_constant=refuse)


# ---------------------------------------------------------------- control characters

def test_every_character_a_terminal_acts_on_is_escaped_and_the_rest_written_as_is():
    """Every character a terminal acts on is written as its escape, and the rest as it is."""
    shown = safe(HOSTILE + " \u00fc\u65e5\u672c \\x1b")
    assert not _raw(shown)
    assert "clear\\x1b[2J" in shown and "title\\x1b]0;pwned\\x07" in shown and "csi\\x9b31m" in shown
    assert "over\\rwrite" in shown and "bidi\\u202etxt.exe" in shown
    assert "\ttabbed" in shown and "\u00fc\u65e5\u672c" in shown  # tab and any script's letters stay
    assert safe(shown) == shown  # a backslash is left alone: escaping twice changes nothing
    assert safe('"\ud800"') == '"\\ud800"'  # a JSON "\ud800" parses to a lone surrogate no encoder writes


def test_logs_show_escape_sequences_a_program_printed_as_text(ddp, hosts, tmp_path):
    _ended(tmp_path, "0", f"[rank0]: {HOSTILE}\n")
    r = ddp(hosts, "logs")
    assert r.exit_code == 0, r.output
    assert not _raw(r.output), repr(r.output)
    assert "here rank0 | clear\\x1b[2J title\\x1b]0;pwned\\x07" in r.stdout
    assert "clip\\x1b]52;c;cm0gLXJmIH4=\\x07" in r.stdout and "bidi\\u202etxt.exe\ttabbed" in r.stdout


def test_a_kept_run_s_log_shows_its_escape_sequences_as_text(ddp, hosts, tmp_path):
    run = _kept(tmp_path, {"time": 1_700_000_000}, "1700000100 0\n", log=f"{HOSTILE}\n")
    r = ddp(hosts, "logs", "--run", run)
    assert r.exit_code == 0, r.output
    assert not _raw(r.output) and "link\\x1b]8;;https://evil.example\\x1b\\here" in r.stdout


def test_the_first_failure_line_shows_the_program_s_escape_sequences_as_text(ddp, hosts, tmp_path):
    _ended(tmp_path, "1", f"[rank0]: trainer: error: {HOSTILE}\n")
    for args in (("status",), ("status", "--follow")):  # --follow ends as launch --wait does
        r = ddp(hosts, *args)
        assert r.exit_code == (1 if "--follow" in args else 0), r.output
        assert not _raw(r.output), (args, repr(r.output))
        assert "here rank 0 failed first: trainer: error: clear\\x1b[2J title\\x1b]0;pwned\\x07" in r.output


def test_a_state_and_a_kept_run_s_node_name_with_escape_sequences_show_as_text(ddp, hosts, tmp_path):
    _ended(tmp_path, "3 \x1b]0;pwned\x07\x1b[2J", "")
    r = ddp(hosts, "status", "--follow")
    assert r.exit_code == 1 and not _raw(r.output), repr(r.output)
    assert "here  exited(3 \\x1b]0;pwned\\x07\\x1b[2J)" in r.stdout  # the plain line, then the table
    assert "│ exited(3 \\x1b]0;pwned\\x07\\x1b[2J) │" in r.stdout
    run = _kept(tmp_path, {"time": 1_700_000_000, "program": f"train\x1b[2J{HOSTILE}"}, "1700000100 0\n",
                node="evil\x1b[2J\x9b1m")
    for args in (("runs",), ("status", "--run", run), ("logs", "--run", run)):  # logs: a note names it
        r = ddp(hosts, *args)
        assert r.exit_code == 0 and not _raw(r.output), (args, repr(r.output))
        assert args == ("runs",) or "evil\\x1b[2J\\x9b1m" in r.output, args


def test_what_stop_says_of_a_node_shows_as_text(ddp, hosts, tmp_path):
    _ended(tmp_path, "1 \x1b]0;pwned\x07", "")
    r = ddp(hosts, "stop")
    assert r.exit_code == 0 and not _raw(r.output), repr(r.output)
    assert "1 \\x1b]0;pwned\\x07" in r.stdout


@pytest.mark.filterwarnings("ignore:Glyph .* missing from font")  # the PNG is no terminal: its labels are E's
def test_plot_names_runs_whose_ids_hold_escape_sequences_as_text(ddp, hosts, tmp_path):
    records = [{"run": "r1\x1b]0;pwned\x07", "kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2)]
    (tmp_path / "nas/ckpt").mkdir(parents=True)
    (tmp_path / "nas/ckpt/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r = ddp(hosts, "plot", "-o", str(tmp_path / "m.png"))
    assert r.exit_code == 0 and not _raw(r.output), repr(r.output)
    assert "r1\\x1b]0;pwned\\x07" in r.stdout


def test_a_slurm_job_s_progress_line_escapes_its_state():
    from deploy.engines import slurm, slurmjob

    said = slurmjob.progress_line(slurm.SlurmState("7", "r", "RUNNING\x1b[2J"))
    assert said == "Slurm job 7: RUNNING\\x1b[2J"


def test_a_check_s_detail_with_markup_and_escapes_is_printed_as_text(monkeypatch):
    import io

    import deploy.cli.render
    from deploy.checks.node_checks import Check
    from deploy.cli.table import Screen

    screen = io.StringIO()
    monkeypatch.setattr(deploy.cli.render, "out", Screen(file=screen, width=200))
    deploy.cli.render.print_checks([Check("n1", "storage", False, f"{MARKUP} \x1b[2J")])
    assert f"{MARKUP} \\x1b[2J" in screen.getvalue() and "FAIL" in screen.getvalue()
    assert not _raw(screen.getvalue())


def test_failure_description_escapes_what_the_program_said():
    said = failure.Failure("here", 0, "1", None, "RuntimeError: \x1b]52;c;eHg=\x07 boom\u202e")
    assert said.describe() == "here rank 0 failed first (exit 1): RuntimeError: \\x1b]52;c;eHg=\\x07 boom\\u202e"


def test_a_plain_progress_line_escapes_the_state():
    assert view.line("n1", NodeState("exited(1\x1b[2J)")) == "n1  exited(1\\x1b[2J)"


# ---------------------------------------------------------------- whose line it is

# What str.splitlines takes for a line's end, and a log does not: inside a line, each is data.
BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


def test_status_takes_its_columns_from_rank_0_s_metrics_lines_alone(ddp, hosts, tmp_path):
    mine = 'METRICS {"kind": "train", "epoch": 1, "epochs": 2, "step": 5, "loss": 0.5}'
    _ended(tmp_path, "0", f"[rank0]: {mine}\n"
                          '[rank1]: METRICS {"kind": "train", "epoch": 2, "epochs": 2, "step": 999, "loss": 9}\n'
                          '[rank1]: [rank0]: METRICS {"kind": "train", "step": 998}\n[rank1]: done\n')
    data = _strict(ddp(hosts, "status", "--json").stdout)[0]
    assert (data["metrics"], data["epoch"], data["step"], data["loss"]) == (mine, 1, 5, 0.5)


def test_a_job_whose_only_metrics_lines_are_another_rank_s_shows_no_progress(ddp, hosts, tmp_path):
    _ended(tmp_path, "0", '[rank1]: METRICS {"kind": "train", "step": 999}\n[rank0]: x\n')
    data = _strict(ddp(hosts, "status", "--json").stdout)[0]
    assert data["metrics"] == "" and data["step"] is None


def test_a_program_run_without_torchrun_s_prefixes_still_shows_its_progress(ddp, hosts, tmp_path):
    _ended(tmp_path, "0", 'METRICS {"kind": "train", "step": 3}\n')
    assert _strict(ddp(hosts, "status", "--json").stdout)[0]["step"] == 3


def test_the_first_failure_is_the_rank_whose_stream_said_it_not_a_printed_prefix(ddp, hosts, tmp_path):
    """The first failure is of the rank whose stream said it, not of the prefix it printed."""
    # torchrun's tee ends a line at a "\r" too: rank 0's "x\r[rank1]: ..." reaches the log so
    _ended(tmp_path, "1", "[rank0]: x\n[rank0]: [rank1]: trainer: error: boom\n")
    r = ddp(hosts, "status")
    assert r.exit_code == 0, r.output
    assert "here rank 0 failed first: [rank1]: trainer: error: boom" in r.stdout


@pytest.mark.parametrize("brk", BREAKS)
def test_a_splitlines_break_inside_a_failed_rank_s_line_is_shown_escaped_in_it(brk):
    """A line break of str.splitlines inside a failed rank's line is shown escaped, in that line."""
    found = failure.first_failure({"here": f"[rank0]: x{brk}[rank1]: trainer: error: boom\n"})
    assert found.describe() == f"here rank 0 failed first: x{repr(brk)[1:-1]}[rank1]: trainer: error: boom"


# ---------------------------------------------------------------- rich markup

def test_markup_in_a_state_a_program_name_or_a_node_directory_is_printed_literally(ddp, hosts, tmp_path):
    _ended(tmp_path, f"2 {MARKUP}", f"[rank0]: trainer: error: {MARKUP}\n")
    r = ddp(hosts, "status")
    assert r.exit_code == 0, r.output
    assert f"exited(2 {MARKUP})" in r.stdout and f"first failure: here rank 0 failed first: trainer: error: {MARKUP}" \
        in r.stdout
    run = _kept(tmp_path, {"time": 1_700_000_000, "program": f"prog {MARKUP}", "code_snapshot": "[b]c[/b]",
                           "image": {"id": "sha256:[i]x[/i]"}}, "1700000100 1\n", node="[bold]n")
    listed = ddp(hosts, "runs")
    assert listed.exit_code == 0, listed.output
    assert f"prog {MARKUP}" in listed.stdout and "│ [b]c[/b] │" in listed.stdout and "[i]x[/i]" in listed.stdout
    assert "exit 1 ([bold]n)" in listed.stdout
    kept = ddp(hosts, "status", "--run", run)
    assert kept.exit_code == 0, kept.output
    assert f": prog {MARKUP}: exit 1 ([bold]n)" in kept.stdout and "│ [bold]n │" in kept.stdout


# ---------------------------------------------------------------- numbers that do not fit

@pytest.mark.parametrize("metrics", [
    {"kind": "train", "step": int(HUGE), "loss": int(HUGE), "epoch": int(HUGE), "samples_per_s": int(HUGE)},
    {"kind": "train", "step": 1e300, "acc": 1e300, "samples_per_s": 1e300, "eta_s": 1e300},
    {"kind": "train", "steps_left": 1e200, "step_time_s": 1e200},
])
def test_a_metrics_field_that_does_not_fit_shows_a_dash(metrics):
    line = "METRICS " + json.dumps(metrics)
    p = view.Progress.from_line(line)
    assert set(p.cells().values()) == {"-"}
    assert json.dumps(view.as_data("n1", 1, NodeState("running", line)))  # --json: no NaN, no overflow


def test_a_metrics_line_nested_past_the_parser_s_depth_shows_nothing():
    assert set(view.Progress.from_line("METRICS " + "[" * 100_000).cells().values()) == {"-"}


def test_a_huge_loss_still_shows_in_four_digits():
    assert view.Progress.from_line('METRICS {"loss": 1e300}').cells()["loss"] == "1e+300"


def test_status_and_its_follow_survive_a_metrics_line_with_a_400_digit_step_and_loss(ddp, hosts, tmp_path):
    _ended(tmp_path, "0", f'[rank0]: METRICS {{"kind": "train", "step": {HUGE}, "loss": {HUGE}, "epoch": 1}}\n')
    table = ddp(hosts, "status")
    assert table.exit_code == 0, table.output
    assert "│ here │ exited(0) │ 1     │ 1     │ -    │ -    │" in table.stdout
    data = _strict(ddp(hosts, "status", "--json").stdout)
    assert data[0]["step"] is None and data[0]["loss"] is None and data[0]["epoch"] == 1
    followed = ddp(hosts, "status", "--follow")  # the path of launch --wait
    assert followed.exit_code == 0 and "all nodes finished with exit code 0" in followed.stdout, followed.output


@pytest.mark.parametrize("when", BAD_TIMES)
def test_an_exits_line_whose_time_is_no_time_shows_a_dash_in_runs_and_status_run(ddp, hosts, tmp_path, when):
    run = _kept(tmp_path, {"time": 1_700_000_000, "program": "p"}, f"{when} 1\n")
    listed = ddp(hosts, "runs")
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.stdout.splitlines() if run in line)
    assert row.split("│")[2].strip() == "-" and "exit 1 (here)" in row  # took: unknown; the code is read
    data = _strict(ddp(hosts, "runs", "--json").stdout)
    assert data[0]["end"] is None and data[0]["nodes"]["here"]["exits"] == [[None, 1]]
    kept = ddp(hosts, "status", "--run", run)
    assert kept.exit_code == 0 and f"run {run}: started " in kept.stdout and "took" not in kept.stdout, kept.output
    node = _strict(ddp(hosts, "status", "--run", run, "--json").stdout)["nodes"][0]
    assert node["state"] == "exited(1)" and node["exits"] == [[None, 1]]


@pytest.mark.parametrize("code", ["99999999999999999999999", "nan", "1e999", "-1e999", "256"])
def test_an_exits_line_whose_code_is_no_exit_status_reads_as_an_unknown_code(ddp, hosts, tmp_path, code):
    run = _kept(tmp_path, {"time": 1_700_000_000}, f"1700000100 {code}\n")
    listed = ddp(hosts, "runs")
    assert listed.exit_code == 0 and "exit ? (here)" in listed.stdout, listed.output
    node = _strict(ddp(hosts, "status", "--run", run, "--json").stdout)["nodes"][0]
    assert node["state"] == "exited(?)" and node["exits"] == [[1700000100.0, None]]


def test_a_record_with_numbers_that_do_not_fit_lists_without_them(ddp, hosts, tmp_path):
    record = ('{"time": 1e999, "program": 5, "code_snapshot": 7, "image": {"id": 9}, "nan": NaN, '
              f'"nodes": [{{"name": "here", "procs": {HUGE}}}, {{"name": ["x"]}}], "big": {HUGE}}}')
    run = _kept(tmp_path, record, "1700000100 0\n")
    (_job(tmp_path) / "runs" / run / "here" / "group-formed").touch()  # its launcher saw a process group form
    listed = ddp(hosts, "runs")
    assert listed.exit_code == 0, listed.output
    assert [c.strip() for c in next(line for line in listed.stdout.splitlines() if run in line).split("│")[1:-1]] \
        == [run, "-", "1", "?", "-", "-", "exit 0", "-", "-"]  # goodput: no start time, none reckoned
    data = _strict(ddp(hosts, "runs", "--json").stdout)
    assert data[0]["start"] is None and data[0]["record"]["nan"] is None and data[0]["record"]["time"] is None
    kept = ddp(hosts, "status", "--run", run)
    assert kept.exit_code == 0 and "│ here │ exited(0) │ -     │" in kept.stdout, kept.output
    assert _strict(ddp(hosts, "status", "--run", run, "--json").stdout)["nodes"][0]["ranks"] is None


# ---------------------------------------------------------------- full values in a pipe

def test_in_a_pipe_the_status_table_prints_a_long_state_whole(ddp, hosts, tmp_path):
    long_state = "137 " + "-".join(f"part{i}" for i in range(40))
    _ended(tmp_path, long_state, "")
    r = ddp(hosts, "status")
    assert r.exit_code == 0, r.output
    assert f"│ exited({long_state}) │" in r.stdout and "…" not in r.stdout


def test_in_a_pipe_the_runs_table_prints_a_long_program_whole(ddp, hosts, tmp_path):
    program = "python -m trainer " + " ".join(f"--flag{i} value{i}" for i in range(20))
    run = _kept(tmp_path, {"time": 1_700_000_000, "program": program}, "1700000100 137\n")
    r = ddp(hosts, "runs")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.stdout.splitlines() if run in line)
    assert f"│ {program} │" in row and "exit 137 (here)" in row and "…" not in r.stdout


# ---------------------------------------------------------------- a real hostile program

HOSTILE_PROGRAM = r'''
import json, sys
print("METRICS " + json.dumps({"kind": "train", "epoch": 0, "step": int("9" * 400), "loss": 1e308 * 10}), flush=True)
print("clear\x1b[2J title\x1b]0;pwned\x07 clip\x1b]52;c;cm0gLXJmIH4=\x07 [red]x[/red]", flush=True)
sys.exit("trainer: error: bad\x1b[2J\x1b]8;;https://evil.example\x1b\\link\x1b]8;;\x1b\\ [link=https://evil.example]y[/link]")
'''


@pytest.mark.e2e
def test_launch_wait_on_escapes_and_huge_numbers_fails_with_one_line_of_text(ddp, tmp_path):
    """launch --wait of a program printing escapes and huge numbers fails with one line of text."""
    project = tmp_path / "hostile"
    project.mkdir()
    (project / "hostile.py").write_text(HOSTILE_PROGRAM)
    hosts = _inventory(tmp_path, [], procs=1)
    data = json.loads(hosts.read_text())
    data["train"].update({"script": "hostile.py", "code": str(project)})
    hosts.write_text(json.dumps(data))
    r = ddp(hosts, "launch", "--wait", "--timeout", "120")
    assert r.exit_code == 1 and not _raw(r.output), repr(r.output)
    said = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "internal error" not in said[0], r.stderr
    assert ("failed first (exit 1): trainer: error: bad\\x1b[2J\\x1b]8;;https://evil.example\\x1b\\link"
            "\\x1b]8;;\\x1b\\ [link=https://evil.example]y[/link]") in said[0]
    shown = ddp(hosts, "status")
    assert shown.exit_code == 0 and not _raw(shown.output) and "│ here │ exited(1) │ 1     │ 0     │ -    │ -    │" \
        in shown.stdout, shown.output
    logs = ddp(hosts, "logs")
    assert logs.exit_code == 0 and not _raw(logs.output) and "title\\x1b]0;pwned\\x07" in logs.stdout
    assert "[red]x[/red]" in logs.stdout
    assert ddp(hosts, "stop").exit_code == 0
