"""What the tool shows of any program's METRICS lines as docs/own-code.md ("Metrics") tells a user
to print them: ``acc`` as a fraction or a percentage, ``plot``'s curves of ``train`` and ``eval``
lines, and the small output defects of ``doctor``, ``logs`` and ``plot``."""

from __future__ import annotations

import json

import pytest

from deploy.observe import doctor, view
from deploy.observe import plot as plotting
from local_job import kept_run, local_hosts

RUN = "20261205-120000-abcd"


@pytest.mark.parametrize("acc, shown", [
    (0.975, "97.5%"), (0.0, "0.0%"), (1.0, "100.0%"), (1, "100.0%"),  # 0 to 1: a fraction, 1 included
    (97.5, "97.5%"), (1.5, "1.5%"), (100, "100.0%"),  # above 1 up to 100: a percentage as printed
    (250, "250"), (-0.5, "-0.5"), (100.01, "100.01"),  # outside 0..100: the number, never scaled
])
def test_acc_is_a_fraction_up_to_1_a_percentage_up_to_100_else_shown_as_printed(acc, shown):
    p = view.Progress.from_line("METRICS " + json.dumps({"kind": "eval", "step": 3, "acc": acc}))
    assert p.acc == acc  # status --json keeps the value the program printed
    assert p.cells()["acc"] == shown
    node = view.line("n1", view.NodeState("running", "METRICS " + json.dumps({"acc": acc})))
    assert node.endswith(f"acc {shown}")


# A program of its own printing what docs/own-code.md shows: train lines with the loss, eval lines
# with their loss and accuracy under the same names, the time of each.
OWN_LOG = "\n".join([
    '[rank0]: METRICS {"kind": "train", "epoch": 0, "step": 10, "loss": 2.0, "time": 1764936000.1}',
    '[rank0]: METRICS {"kind": "train", "epoch": 0, "step": 20, "loss": 1.5, "time": 1764936001.1}',
    '[rank0]: METRICS {"kind": "eval", "epoch": 0, "step": 20, "loss": 1.7, "acc": 0.61, "time": 1764936002.1}',
    '[rank0]: METRICS {"kind": "train", "epoch": 1, "step": 30, "loss": 1.1, "time": 1764936003.1}',
    '[rank0]: METRICS {"kind": "eval", "epoch": 1, "step": 30, "loss": 1.2, "acc": 0.72, "time": 1764936004.1}',
    "",
])


def _plotted(fig) -> dict[tuple[str, str], tuple[list, list]]:
    return {(ax.get_title(loc="left"), line.get_label()): (list(line.get_xdata()), list(line.get_ydata()))
            for ax in fig.axes for line in ax.get_lines()}


def test_plot_draws_eval_acc_and_train_and_eval_lines_as_curves_of_their_own(tmp_path):
    runs = plotting.log_records(f"@@run {RUN}\n{OWN_LOG}")
    fig = plotting.render(runs, tmp_path / "p.png", from_logs=[RUN])
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["epoch", "loss", "acc"]  # no panel of the time
    drawn = _plotted(fig)
    assert drawn[("acc", RUN)] == ([20.0, 30.0], [0.61, 0.72])
    assert drawn[("loss", f"{RUN} train")] == ([10.0, 20.0, 30.0], [2.0, 1.5, 1.1])
    assert drawn[("loss", f"{RUN} eval")] == ([20.0, 30.0], [1.7, 1.2])


@pytest.fixture
def fleet(tmp_path):
    """A one-node local inventory whose shared volume holds one kept run of a program of its own,
    finished: its log (``log`` below), no metrics.jsonl."""
    hosts, kept = kept_run(tmp_path, job="ownprog", run=RUN, program="train.py")
    (kept / "exits").write_text("1764936010 0\n")
    return hosts, kept / "log"


def test_plot_of_a_program_s_eval_lines_alone_draws_their_acc(ddp, fleet, tmp_path):
    hosts, log = fleet
    log.write_text('[rank0]: METRICS {"kind": "eval", "step": 5, "acc": 0.5}\n'
                   '[rank0]: METRICS {"kind": "eval", "step": 9, "acc": 0.75}\n')
    r = ddp(hosts, "plot", "-o", str(tmp_path / "out.png"))
    assert r.exit_code == 0, r.output
    assert r.stdout == f"wrote {tmp_path / 'out.png'}: 1 run ({RUN} from its logs' METRICS lines)\n"


def test_plot_of_a_finished_run_without_metrics_says_what_is_true_of_it(ddp, fleet, tmp_path):
    hosts, log = fleet
    log.write_text("[rank0]: epoch 0 done\n[rank0]: saved checkpoint.pth\n")
    r = ddp(hosts, "plot", "-o", str(tmp_path / "out.png"))
    assert r.exit_code == 1, r.output
    assert "wait for the job's first logging interval" not in r.output
    assert "no run printed a `METRICS {...}` line" in r.output and "a run that has ended prints none more" in r.output


def test_doctor_shows_a_rank_s_stack_on_a_line_of_its_own_with_no_escaped_newline(capsys):
    from deploy.cli import render

    dump = json.dumps([{"pid": 11, "os_thread_id": 11, "thread_name": None,
                        "frames": [{"name": "sleep_forever", "filename": "/code/train.py", "line": 7},
                                   {"name": "<module>", "filename": "/code/train.py", "line": 30}]}])
    found = doctor.diagnose(doctor.parse("node1", f"rank 11 0 0 S\nstack 11 {dump}\nworkers 1"), {}, 1)
    render.show_diagnosis(found, as_json=False)
    out = capsys.readouterr().out.splitlines()
    assert "\\n" not in "".join(out)
    head = next(i for i, line in enumerate(out) if line.startswith("node1 rank 0 (pid 11, state S"))
    assert out[head + 1] == "    sleep_forever (train.py:7) < <module> (train.py:30)"


def test_logs_of_a_job_never_launched_says_why_once(ddp, tmp_path):
    hosts = local_hosts(tmp_path, job="neverlaunched", train={"args": []})
    r = ddp(hosts, "logs")
    assert r.exit_code == 1
    said = r.output.count("cannot open")
    assert said == 1, r.output


# --- the first step ------------------------------------------------------------------------------

class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _beat(local_rank: int, step: int | None, age: float, gap: float | None = None):
    from deploy.job.stall import Beat

    return Beat(local_rank=local_rank, step=step, rank=local_rank, gap_s=gap, age_s=age)


def test_a_program_that_prints_nothing_has_its_first_step_at_its_first_collective():
    from deploy.job.phases import FirstStep

    said, clock = [], Clock()
    first = FirstStep(said.append, clock=clock)
    clock.t = 1003.0  # the progress hook's beat once the group formed: no step, no interval yet
    first.see({"n1": view.NodeState("running", beats=(_beat(0, None, 0.0), _beat(1, None, 1.0)))})
    assert said == []
    clock.t = 1006.0  # an interval: a collective returned after the group formed
    first.see({"n1": view.NodeState("running", beats=(_beat(0, None, 0.0, gap=1.5), _beat(1, None, 1.0)))})
    assert said == ["first step after 6.0 s (n1: rank 0's collectives)"]


def test_the_first_step_is_the_first_poll_s_heartbeat_with_a_step_less_its_age_once():
    from deploy.job.phases import FirstStep

    said, kept, clock = [], [], Clock()
    first = FirstStep(said.append, kept.append, clock)
    clock.t = 1005.0
    first.see({"n1": view.NodeState("running", beats=(_beat(0, None, 3.0),)), "n2": view.NodeState("absent")})
    assert said == [] and kept == []  # a beat with no step, a node not started: no step yet
    clock.t = 1009.0
    first.see({"n1": view.NodeState("running", beats=(_beat(0, 4, 1.0), _beat(1, 3, 2.0)))})
    assert kept == [{"after_s": 7.0, "time": 1007.0, "node": "n1", "by": "rank 1's heartbeat at step 3"}]
    assert said == ["first step after 7.0 s (n1: rank 1's heartbeat at step 3)"]
    clock.t = 1020.0
    first.see({"n1": view.NodeState("running", "METRICS {\"step\": 9}")})
    first.end()
    assert len(said) == len(kept) == 1  # said and kept once


def test_a_metrics_line_is_a_first_step_never_placed_before_the_poll_that_saw_none():
    from deploy.job.phases import FirstStep

    said, kept, clock = [], [], Clock()
    first = FirstStep(said.append, kept.append, clock)
    clock.t = 1004.0
    first.see({"n1": view.NodeState("running", "unreachable: no route")})
    clock.t = 1005.0  # the heartbeat's age would place it before the poll at 1004, which saw nothing
    first.see({"n1": view.NodeState("running", beats=(_beat(0, 1, 30.0),)),
               "n2": view.NodeState("exited(0)", 'METRICS {"kind": "eval", "acc": 0.5}')})
    assert kept == [{"after_s": 4.0, "time": 1004.0, "node": "n1", "by": "rank 0's heartbeat at step 1"}]


def test_a_job_that_ends_without_a_step_says_so():
    from deploy.job.phases import NO_FIRST_STEP, FirstStep

    said = []
    first = FirstStep(said.append, clock=Clock())
    first.see({"n1": view.NodeState("exited(0)", "")})
    first.end()
    assert said == [NO_FIRST_STEP]


@pytest.mark.parametrize("kept, shown", [
    ({"after_s": 12.34, "node": "n1", "by": "a METRICS line"}, "first step after 12.3 s (n1: a METRICS line)"),
    ({"after_s": float("nan"), "node": "n1", "by": "x"}, None), ({"after_s": -1, "node": "n1", "by": "x"}, None),
    ({"after_s": 1, "node": "\x1b[2Jn1", "by": "x"}, "first step after 1.0 s (\\x1b[2Jn1: x)"), ("12.3", None),
])
def test_a_kept_first_step_is_read_back_as_data_from_the_volume(kept, shown):
    from deploy.job.phases import describe_first

    assert describe_first(kept) == shown


def test_the_first_step_is_kept_in_the_run_s_record_once_beside_the_launch_phases(tmp_path):
    import subprocess

    from deploy.inventory import load
    from deploy.job import record

    inv = load(local_hosts(tmp_path, job="firststep", train={"args": []}))
    root = tmp_path / "nas/ckpt"
    run_dir = root / ".ddp-deploy/firststep/runs" / RUN
    run_dir.mkdir(parents=True, mode=0o755)
    for d in (root, root / ".ddp-deploy", root / ".ddp-deploy/firststep", root / ".ddp-deploy/firststep/runs"):
        d.chmod(0o755)
    written = {"run": RUN, "launch_phases": {"lock": 0.1, "start": 0.5}, "hosts_yaml": {"nodes": [{"name": "here"}]}}
    (run_dir / "run.json").write_bytes(record.encode(written))

    def keep(found: dict):
        return subprocess.run(record.first_step_argv(inv, RUN), input=record.first_step_line(found),
                              capture_output=True, timeout=30)

    assert keep({"after_s": 3.5, "time": 1.0, "node": "here", "by": "a METRICS line"}).returncode == 0
    assert keep({"after_s": 9.0, "time": 2.0, "node": "here", "by": "again"}).returncode == 0  # the first stays
    kept = record.decode((run_dir / "run.json").read_text())
    assert kept == {**written, "first_step": {"after_s": 3.5, "time": 1.0, "node": "here", "by": "a METRICS line"}}
    lines = (run_dir / "run.json").read_text().splitlines()
    assert lines[-2:] == [' "first_step": ' + json.dumps(kept["first_step"]), "}"] and "," not in lines  # its own line
    (run_dir / "run.json").write_text('{"forged": 1}')  # not as the tool writes a record: left as it is
    assert keep({"after_s": 1.0, "time": 1.0, "node": "here", "by": "x"}).returncode == 1
    assert (run_dir / "run.json").read_text() == '{"forged": 1}'


@pytest.mark.parametrize("example", ["charlm", "regress"])
def test_an_example_s_readme_describes_its_train_section_and_metrics_as_they_are(example):
    import re

    import yaml

    from deploy.inventory import Train
    from trainer_helpers import ROOT

    text = (ROOT / "examples" / example / "README.md").read_text()
    assert "placeholder" not in text and "not final" not in text
    snippet = yaml.safe_load(re.search(r"```yaml\n(train: .*)\n```", text)[1])
    train = Train.model_validate(snippet["train"])  # the fields the README shows are the schema's
    assert (ROOT / train.code.path).is_dir()
