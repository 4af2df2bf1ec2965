"""trainer/startup.py: where a process's time went before its first step."""

from __future__ import annotations

import os
import subprocess
import time

from trainer import startup


def test_a_process_start_time_is_read_from_proc_and_is_in_the_past():
    mine, parent = startup.started_at(), startup.started_at(os.getppid())
    assert mine is not None and parent is not None
    assert parent <= mine <= time.time()
    assert startup.started_at(2 ** 22 + 12345) is None  # no such process


def test_a_start_time_is_right_to_a_clock_tick_not_to_btime_s_whole_second():
    for _ in range(5):
        before = time.time()
        child = subprocess.Popen(["sleep", "5"])
        after = time.time()
        try:
            at = startup.started_at(child.pid)
        finally:
            child.kill()
            child.wait()
        assert before - 0.011 <= at <= after, (before, at, after)  # a tick is 10 ms


def test_each_phase_is_named_by_the_moment_ending_it_and_an_unknown_start_left_out():
    """Each phase is named by the moment that ends it, and an unknown start is left out."""
    s = startup.Startup()
    s.marks = [("launcher", None), ("process", 100.0), ("imports", 102.5), ("process_group", 103.0),
               ("data", 103.25), ("model", 104.0), ("resume", 104.0)]
    assert s.phases() == {"imports": 2.5, "process_group": 0.5, "data": 0.25, "model": 0.75, "resume": 0.0}
    assert s.line() == ("trainer: ready to train 4.0 s after this process started: imports 2.5 s, process group 0.5 s, "
                        "data 0.2 s, model 0.8 s, resume 0.0 s")


def test_a_start_time_read_a_little_late_gives_a_phase_of_zero_not_below():
    s = startup.Startup()
    s.marks = [("launcher", 10.0), ("process", 10.5), ("imports", 10.25)]
    assert s.phases() == {"process": 0.5, "imports": 0.0}
    assert s.line() == "trainer: ready to train 0.2 s after the launcher started: launcher to this process 0.5 s, imports 0.0 s"


def test_the_moments_kept_for_a_resume_leave_out_an_unknown_start_and_keep_the_order():
    s = startup.Startup()
    s.marks = [("launcher", None), ("process", 100.0), ("imports", 102.50049), ("resume", 104.0)]
    assert s.moments() == {"process": 100.0, "imports": 102.5, "resume": 104.0}
    assert list(s.moments()) == ["process", "imports", "resume"]
