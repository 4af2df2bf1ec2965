"""What `status`, `status --follow` and `launch --wait` show of each node: state with restarts,
and progress (epoch of total, step, loss, accuracy, samples/s, ETA) from the last METRICS line."""

from __future__ import annotations

import json
import subprocess

from rich.console import Console

from deploy.job import plan
from deploy.cli import render
from deploy.observe import view
from deploy.job.plan import NodeState
from deploy.job.scripts import DOCKER_STATUS, HOST_STATUS
from fakes import install_command

TRAINER_LINE = 'METRICS ' + json.dumps({"time": 1.0, "kind": "train", "epoch": 1, "epochs": 8, "step": 37,
                                        "steps_left": 300, "loss": 0.123456, "acc": 0.9512, "lr": 0.01,
                                        "samples_per_s": 1234.5, "step_time_s": 0.25})


def test_the_trainer_s_line_gives_every_column_and_an_eta_from_the_steps_left():
    p = view.Progress.from_line(TRAINER_LINE)
    assert (p.epoch, p.epochs, p.step, p.eta_s) == (1, 8, 37, 75.0)
    assert p.cells() == {"epoch": "1/8", "step": "37", "loss": "0.1235", "acc": "95.1%", "samples/s": "1,234",
                         "ETA": "1m15s"}


def test_a_user_program_s_few_fields_show_and_the_rest_is_a_dash():
    p = view.Progress.from_line('METRICS {"kind": "train", "epoch": 0, "step": 5, "loss": 2.5}')
    assert p.cells() == {"epoch": "0", "step": "5", "loss": "2.5", "acc": "-", "samples/s": "-", "ETA": "-"}
    given = view.Progress.from_line('METRICS {"kind": "train", "step": 5, "eta_s": 7200}')
    assert given.cells()["ETA"] == "2h00m"
    evaluated = view.Progress.from_line('METRICS {"kind": "eval", "epoch": 2, "eval_loss": 0.5, "eval_acc": 1.0}')
    assert evaluated.cells()["acc"] == "100.0%" and evaluated.cells()["ETA"] == "-"  # no ETA once not training


def test_lines_that_are_not_metrics_or_not_numbers_show_nothing_rather_than_fail():
    for bad in ("", "unreachable: connection refused", "METRICS {not json", "METRICS [1, 2]",
                'METRICS {"step": "ten", "loss": NaN, "acc": true}'):
        assert set(view.Progress.from_line(bad).cells().values()) == {"-"}


def test_the_state_says_how_often_a_node_was_started_again():
    assert view.state_text(NodeState("running", "", 2)) == "running (2 restarts)"
    assert view.state_text(NodeState("exited(1)", "", 1)) == "exited(1) (1 restart)"
    assert view.state_text(NodeState("running")) == "running"
    assert view.state_text(NodeState("unreachable", "timed out", 0)) == "unreachable"


def test_status_table_has_one_row_per_node_with_progress_columns():
    states = {"node1": plan.parse_status(f"running\nrestarts 1\n{TRAINER_LINE}\n"),
              "node2": plan.parse_status("exited 1\nrestarts 3\n")}
    console = Console(width=200, record=True)
    console.print(render.states_table("demo", {"node1": 2, "node2": 2}, states))
    rows = [[cell.strip() for cell in row.split("│")[1:-1]] for row in console.export_text().splitlines()
            if row.startswith("│")]
    assert rows == [["node1", "running (1 restart)", "2", "1/8", "37", "0.1235", "95.1%", "1,234", "1m15s"],
                    ["node2", "exited(1) (3 restarts)", "2", "-", "-", "-", "-", "-", "-"]]
    data = view.as_data("node1", 2, states["node1"])
    assert data["restarts"] == 1 and data["epochs"] == 8 and data["eta_s"] == 75.0 and data["metrics"] == TRAINER_LINE


def test_plain_lines_follow_state_changes_at_once_and_progress_at_most_per_interval():
    """Plain lines follow state changes at once, and progress at most every interval."""
    said, now = [], [0.0]
    follow = view.PlainFollower(said.append, every=10, clock=lambda: now[0])
    running = plan.parse_status(f"running\nrestarts 0\n{TRAINER_LINE}\n")
    moved = plan.parse_status("running\nrestarts 0\n" + TRAINER_LINE.replace('"step": 37', '"step": 38') + "\n")
    follow.update({"a": running, "bb": NodeState("absent")})
    assert said == ["a   running  epoch 1/8  step 37  loss 0.1235  acc 95.1%  samples/s 1,234  ETA 1m15s",
                    "bb  absent"]
    now[0] = 5
    follow.update({"a": moved, "bb": NodeState("absent")})
    assert len(said) == 2  # progress only: not before 10 s
    now[0] = 11
    follow.update({"a": moved, "bb": NodeState("exited(0)")})
    assert said[2:] == ["a   running  epoch 1/8  step 38  loss 0.1235  acc 95.1%  samples/s 1,234  ETA 1m15s",
                        "bb  exited(0)"]


def test_the_status_scripts_report_restarts_for_both_runtimes(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "pid").write_text("999999999")
    (run / "exit").write_text("1")
    (run / "restarts").write_text("2")
    (run / "log").write_text(f"noise\n{TRAINER_LINE}\n")
    host = subprocess.run(["sh", "-c", HOST_STATUS, "sh", str(run)], capture_output=True, text=True, check=True)
    assert plan.parse_status(host.stdout) == NodeState("exited(1)", TRAINER_LINE, 2)

    for said, state in (("restarting 137 3", "restarting"), ("exited 1 3", "exited(1)")):
        install_command(tmp_path, monkeypatch, "docker",
                        f"#!/bin/sh\ncase \"$1\" in inspect) echo '{said}' ;; logs) echo '{TRAINER_LINE}' ;; esac\n")
        got = subprocess.run(["sh", "-c", DOCKER_STATUS, "sh", "ddp-c"], capture_output=True, text=True, check=True)
        parsed = plan.parse_status(got.stdout)
        assert parsed == NodeState(state, TRAINER_LINE, 3)
        assert parsed.running == (state == "restarting")


def test_a_line_s_rank_is_its_first_prefix_the_one_torchrun_s_tee_put_there():
    assert view.split_rank("[rank3]: text") == (3, "text")
    assert view.split_rank("[rank0]: [rank1]: hi") == (0, "[rank1]: hi")  # rank 0 printed "[rank1]: hi"
    assert view.split_rank("[rank1]: [rank1]: Traceback") == (1, "Traceback")  # torch's second prefix
    assert view.split_rank("[rank0]: x\r[rank1]: y") == (0, "x\r[rank1]: y")
    assert view.split_rank("[rank0]:") == (0, "")  # an empty line, its end stripped
    assert view.split_rank("torchrun's own [rank1]: x") == (None, "torchrun's own [rank1]: x")
    assert view.split_rank("[rank1]:x")[0] is None and view.split_rank("[rank\u0663]: x")[0] is None
