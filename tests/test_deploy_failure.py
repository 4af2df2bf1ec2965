"""The first failure of a failed job, read from real torchrun output on both ends of the torch
range: a bad program flag (argparse, before any process group) and an exception on one rank
after init (torch prefixes its traceback with ``[rankN]: ``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from deploy.failure import Failure, first_failure, program_error
from fakes import free_port

ROOT = Path(__file__).resolve().parents[1]

RANK_ONE_RAISES = """
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("rank 1 cannot read its shard")
time.sleep(30)
"""


def _torchrun(python: str, *program: str, cwd: Path = ROOT) -> str:
    argv = [python, "-m", "trainer.launch", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0", *program]
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=180,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    return proc.stdout + proc.stderr


def test_a_bad_program_flag_reads_as_one_line_naming_node_rank_and_exit_code(torch_python):
    log = _torchrun(torch_python.python, "--", "--no-such-flag")
    first = first_failure({"node1": log})
    assert first is not None and first.node == "node1" and first.rank in (0, 1) and first.exit_code == "2"
    assert first.says == "python -m trainer: error: unrecognized arguments: --no-such-flag"
    assert first.describe() == (f"node1 rank {first.rank} failed first (exit 2): "
                                "python -m trainer: error: unrecognized arguments: --no-such-flag")


def test_an_exception_on_one_rank_names_that_rank_and_the_exception(torch_python, tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(RANK_ONE_RAISES)
    log = _torchrun(torch_python.python, "--script", str(script), "--")
    first = first_failure({"node2": log})
    assert (first.node, first.rank, first.exit_code) == ("node2", 1, "1")
    assert first.says == "ValueError: rank 1 cannot read its shard"


def _summary(time: str, rank: int, code: int) -> str:
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
            "Root Cause (first observed failure):\n[0]:\n"
            f"  time      : {time}\n  host      : h\n  rank      : {rank} (local_rank: 0)\n"
            f"  exitcode  : {code} (pid: 7)\n  error_file: <N/A>\n")


def test_the_earliest_root_cause_across_nodes_is_the_first_failure():
    logs = {"node1": "[rank0]: RuntimeError: Connection closed by peer\n" + _summary("2026-11-23_06:51:30", 0, 1),
            "node2": "[rank3]: Traceback (most recent call last):\n[rank3]:   File \"x\", line 1\n"
                     "[rank3]: MemoryError: out of memory\n" + _summary("2026-11-23_06:51:21", 3, 1)}
    assert first_failure(logs) == Failure("node2", 3, "1", "2026-11-23_06:51:21", "MemoryError: out of memory")


def test_a_node_without_torchrun_s_summary_still_says_what_its_program_said():
    assert program_error("starting\ntrainer.launch: error: --entry needs a value\n") == (
        "trainer.launch: error: --entry needs a value", None)
    assert first_failure({"n": "all fine\n"}) is None
    assert first_failure({"n": "trainer.launch: error: --entry needs a value\n"}).describe() == (
        "n failed first: trainer.launch: error: --entry needs a value")


def test_torchrun_s_own_log_lines_are_never_taken_for_the_program_s_error_whatever_the_date():
    for month_day in ("0523", "1123"):
        log = (f"W{month_day} 06:51:16.655000 14689 torch/distributed/run.py:982] error: not the program\n"
               "trainer: error: the program's words\n")
        assert program_error(log) == ("trainer: error: the program's words", None)
