"""The node-side filters of a run's log, run by sh on crafted logs: a worker's line is of the rank of
its first prefix, the one torchrun's tee puts in front of every line of that worker's stream; a
prefix after it is the program's text. ``status``'s METRICS line is rank 0's (the built-in trainer
prints them there, trainer/metrics.py); a planned stop is undone only by rank 0's ``resumed``."""

from __future__ import annotations

import subprocess
from pathlib import Path

from deploy.observe import plot as plotting
from deploy.job.scripts import LAST_METRICS, STOPPED_LINE


def _filter(program: str, log: bytes) -> bytes:
    return subprocess.run(["sh", "-c", program], input=log, capture_output=True, check=True, timeout=30).stdout


def test_the_last_metrics_line_is_rank_0_s_even_when_another_rank_prints_its_prefix():
    """The last metrics line is rank 0's, never another rank's that prints rank 0's prefix."""
    log = (b'[rank0]: METRICS {"step": 1}\n[rank1]: METRICS {"step": 99}\n[rank1]: [rank0]: METRICS {"step": 98}\n'
           b'[rank2]: x\r[rank0]: METRICS {"step": 97}\n[rank0]: done\n')
    assert _filter(LAST_METRICS, log) == b'METRICS {"step": 1}\n'
    assert _filter(LAST_METRICS, b'[rank1]: METRICS {"step": 99}\n') == b""


def test_the_last_metrics_line_may_carry_rank_0_s_prefix_twice_or_none():
    assert _filter(LAST_METRICS, b'[rank0]: [rank0]: METRICS {"step": 2}\n') == b'METRICS {"step": 2}\n'
    assert _filter(LAST_METRICS, b'METRICS {"step": 3}\n') == b'METRICS {"step": 3}\n'  # no torchrun, no tee


def test_the_last_metrics_line_keeps_its_carriage_return_and_a_nul_changes_nothing():
    """The last metrics line keeps a carriage return in it, and a NUL byte in the log changes nothing."""
    log = b'[rank0]: METRICS {"step": 4}\r[rank1]: x\n[rank1]: \x00\x1b[2J\n'
    assert _filter(LAST_METRICS, log) == b'METRICS {"step": 4}\r[rank1]: x\n'


STOP = b"trainer: stopped by SIGTERM to another rank at step 16 (epoch 0); checkpoint ckpt-16 written"


def test_another_rank_s_resumed_line_does_not_undo_a_stop():
    log = b"[rank2]: " + STOP + b'\n[rank1]: METRICS {"kind": "resumed", "step": 16}\n'
    assert _filter(STOPPED_LINE, log) == b": " + STOP + b"\n"
    log = b"[rank2]: " + STOP + b'\n[rank1]: [rank0]: METRICS {"kind": "resumed", "step": 16}\n'
    assert _filter(STOPPED_LINE, log) == b": " + STOP + b"\n"
    log = b"[rank2]: " + STOP + b'\n[rank0]: METRICS {"kind": "resumed", "step": 16}\n'
    assert _filter(STOPPED_LINE, log) == b""


def test_the_stop_line_loses_its_stream_s_prefix_alone():
    assert _filter(STOPPED_LINE, b"[rank2]: [rank2]: " + STOP + b"\n") == b": " + STOP + b"\n"  # torch's twice
    assert _filter(STOPPED_LINE, b"[rank2]: [rank1]: " + STOP + b"\n") == b": [rank1]: " + STOP + b"\n"


def test_a_kept_run_s_metrics_lines_are_the_lowest_rank_s_by_the_stream_s_prefix(tmp_path: Path):
    log = tmp_path / "runs" / "20261125-120000-beef" / "n1" / "log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b'[rank1]: [rank0]: METRICS {"step": 7}\n[rank1]: x\r[rank0]: METRICS {"step": 6}\n'
                    b'[rank0]: METRICS {"step": 1}\n[rank1]: METRICS {"step": 1, "loss": 3.0}\n')
    got = subprocess.run(["sh", "-c", plotting.LOG_METRICS, "sh", str(tmp_path / "runs"), "20261125-120000-beef"],
                         capture_output=True, check=True, timeout=30).stdout.decode()
    assert plotting.log_records(got) == {"20261125-120000-beef": [{"step": 1}]}
