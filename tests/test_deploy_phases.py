"""deploy/job/phases.py: where a launch's time went, timed in order and shown as text from any record."""

from __future__ import annotations

import itertools

import pytest

from deploy.job import phases


def test_each_phase_is_timed_in_order_and_a_phase_run_twice_adds_up():
    ticks = itertools.count()
    took = phases.Phases(clock=lambda: float(next(ticks)))
    with took("lock"):
        pass  # 1 s
    with took("checks"):
        next(ticks)  # 2 s
    with took("lock"):
        pass
    assert took.data() == {"lock": 2.0, "checks": 2.0}
    assert phases.describe(took.data()) == "took 4.00 s: lock 2.00 s, checks 2.00 s"


def test_a_phase_that_raises_is_timed_too():
    took = phases.Phases()
    with pytest.raises(RuntimeError), took("checks"):
        raise RuntimeError("refused")
    assert list(took.data()) == ["checks"]


def test_the_tools_names_are_spelled_out():
    said = phases.describe({"states": 0.31, "code": 0.0, "image": 0.2, "cleanup": 1.5, "start": 0.71})
    assert said == ("took 2.72 s: node states 0.31 s, code sync 0.00 s, image check 0.20 s, "
                    "previous run removed 1.50 s, start 0.71 s")


@pytest.mark.parametrize("kept", [None, "lock 1 s", [], {}, {"lock": "1"}, {"lock": float("nan")},
                                  {"lock": -1}, {"lock": True}, {"lock": float("inf")}])
def test_a_record_without_usable_phases_shows_none(kept):
    assert phases.describe(kept) is None


def test_a_records_phases_are_shown_as_text_and_its_bad_values_left_out():
    said = phases.describe({"\x1b]0;owned\x07lock": 1, "checks": 1e300, "start": "soon", "image": 2})
    assert said == "took 1e+300 s: \\x1b]0;owned\\x07lock 1.00 s, checks 1e+300 s, image check 2.00 s"
