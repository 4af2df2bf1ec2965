"""A run's goodput and incidents (deploy/observe/goodput.py), reckoned from its trainer records."""

from __future__ import annotations

import pytest

from deploy.observe.goodput import last_time, of_run

T0 = 1_800_000_000.0


def train(t: float, step: int, each: float = 0.5) -> dict:
    return {"time": T0 + t, "kind": "train", "step": step, "step_time_s": each}


def test_a_clean_run_counts_its_logged_steps_against_its_wall_time():
    # 40 steps of 0.5 s after 10 s of start-up; the run ended 5 s after its last step (eval, exit)
    records = [train(10 + 5 * i, 10 * i) for i in range(1, 5)]  # steps 10..40: 20 s of steps
    got = of_run(records, T0, T0 + 35, now=T0 + 999)
    assert (got.training_s, got.wall_s, got.redone_steps, got.incidents) == (20.0, 35.0, 0, ())
    assert got.text() == "57%" and got.as_data()["share"] == pytest.approx(20 / 35, abs=1e-4)
    assert got.describe() == "goodput 57% (20.0 s of 35.0 s in training steps that count)"


def test_a_restart_from_a_checkpoint_takes_out_the_redone_steps_and_is_an_incident():
    """A restart from a checkpoint takes the steps done again out, and is an incident."""
    records = [train(10, 10), train(15, 20), train(20, 30),  # steps 20..30 were lost at the crash
               {"time": T0 + 34, "kind": "resumed", "step": 24, "world_size": 6, "from_world_size": 6},
               train(40, 34), train(45, 44)]
    got = of_run(records, T0, T0 + 50, now=0)
    # kept: (0,10] 5 s, (10,20] 5 s, (20,24] 2 s of (20,30], then (24,34] 5 s and (34,44] 5 s
    assert got.training_s == pytest.approx(22.0) and got.redone_steps == 6
    (incident,) = got.incidents
    assert (incident.kind, incident.last_step, incident.step, incident.redone, incident.gap_s) == \
        ("restart", 30, 24, 6, 14.0)
    assert incident.describe() == "restarted at step 24, 6 steps redone, training again 14.0 s after the last step logged"
    assert "\n  restarted at step 24" in got.describe()


def test_a_resize_and_a_stop_are_named_and_a_relaunch_s_first_resume_is_no_incident():
    records = [{"time": T0 + 5, "kind": "resumed", "step": 40, "world_size": 6, "from_world_size": 6},  # the start
               train(10, 50), {"time": T0 + 20, "kind": "resumed", "step": 48, "world_size": 4, "from_world_size": 6},
               train(25, 58), {"time": T0 + 26, "kind": "stopped", "step": 58}]
    got = of_run(records, T0, None, now=T0 + 30)  # still listed as running: up to now
    assert [i.kind for i in got.incidents] == ["resize", "stop"]
    assert got.incidents[0].world == (6, 4)
    assert got.incidents[0].describe().startswith("resized 6 -> 4 processes (its epoch replayed from its start) at step 48")
    assert got.wall_s == 30.0 and got.redone_steps == 2


def test_a_start_again_without_a_checkpoint_counts_the_first_attempt_as_redone():
    records = [train(10, 10), train(15, 20), train(30, 10), train(35, 20)]  # no checkpoint: from 0 again
    got = of_run(records, T0, T0 + 40, now=0)
    assert got.training_s == 10.0 and got.redone_steps == 20 and got.incidents[0].step == 0


def test_records_from_the_volume_that_lie_are_left_out_and_never_crash_it():
    hostile = [None, "x", [], {"kind": "train"}, {"time": "soon", "kind": "train", "step": 3},
               {"time": T0 + 1, "kind": "train", "step": True, "step_time_s": 1},
               {"time": T0 + 1, "kind": "train", "step": 10 ** 40, "step_time_s": 1},
               {"time": float("nan"), "kind": "train", "step": 5, "step_time_s": 1},
               {"time": T0 + 2, "kind": "train", "step": 5, "step_time_s": float("inf")},
               {"time": T0 + 3, "kind": "train", "step": 6, "step_time_s": -4},
               {"time": T0 + 4, "kind": "resumed", "step": -1},
               train(5, 10, each=1e300), train(6, 11, each=10 ** 400),
               {"time": 10 ** 400, "kind": "train", "step": 12, "step_time_s": 1}]
    got = of_run(hostile, T0, T0 + 10, now=0)
    assert got.training_s == 0.0 and got.share == 0.0  # no usable step time: nothing counts
    assert last_time(hostile) == T0 + 6 and last_time("x") is None
    assert of_run("not a list", T0, T0 + 10, now=0) is None
    assert of_run([train(5, 10)], None, T0 + 10, now=0) is None  # the start unknown
    assert of_run([train(5, 10, each=100)], T0, T0 + 10, now=0).share == 1.0  # never above all of it


def test_records_are_taken_in_the_order_written_not_by_a_clock_another_node_may_skew():
    # rank 0 moved to a node whose clock is 3 s behind: its records still come after
    records = [train(10, 10), train(15, 20), train(20, 30),
               {"time": T0 + 17, "kind": "resumed", "step": 24}, train(22, 34)]
    got = of_run(records, T0, T0 + 30, now=0)
    assert got.redone_steps == 6 and got.incidents[0].last_step == 30 and got.training_s == pytest.approx(17.0)


def test_twenty_thousand_restarts_are_each_an_incident_with_its_step_redone():
    records = []
    for i in range(20000):
        records += [train(i, 2 * i + 2), {"time": T0 + i + 0.5, "kind": "resumed", "step": 2 * i + 1}]
    got = of_run(records, T0, T0 + 20001, now=0)
    assert len(got.incidents) == 20000 and got.redone_steps == 20000
