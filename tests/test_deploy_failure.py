"""The first failure of a failed job, read from real torchrun output on each tested point of the
torch range: a bad program flag (argparse, before any process group) and an exception on one rank
after init (torch prefixes its traceback with ``[rankN]: ``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from deploy.observe.failure import Failure, LeftEarly, first_failure, program_error
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
    argv = [python, "-m", "agent.launch", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
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
    assert program_error("starting\nagent.launch: error: --entry needs a value\n") == (
        "agent.launch: error: --entry needs a value", None)
    assert first_failure({"n": "all fine\n"}) is None
    assert first_failure({"n": "agent.launch: error: --entry needs a value\n"}).describe() == (
        "n failed first: agent.launch: error: --entry needs a value")


def test_torchrun_s_log_lines_are_never_the_program_s_error_whatever_their_date():
    """torchrun's own log lines are never taken for the program's error, whatever the date."""
    for month_day in ("0523", "1123"):
        log = (f"W{month_day} 06:51:16.655000 14689 torch/distributed/run.py:982] error: not the program\n"
               "trainer: error: the program's words\n")
        assert program_error(log) == ("trainer: error: the program's words", None)


# What torch 2.14's torchrun (agent.launch: --tee 3, gloo on CPU) printed, captured from real
# runs: rank 1 of 2 returns while rank 0 is in all_reduce; rank 2 of 3 returns while rank 0 is in
# an all_reduce with it and rank 1 sleeps (torchrun stops rank 1 itself: exit -15, listed); rank
# 1 of 2 ends with os._exit(3) instead (a crash: the others see the same broken connection); the
# first case on two torchruns of one process each (two nodes), each node's log; and rank 1 of 2
# raises, and its process ends 3 s after its connections closed (a slow teardown, as on a loaded
# machine), so rank 0's broken connection ends its process first.
SAMPLES = Path(__file__).resolve().parent / "failure_logs"

RANK_ONE_RETURNS_EARLY = """
import time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} up", flush=True)
if dist.get_rank() == 0:
    t = torch.ones(1)
    for _ in range(3000):
        dist.all_reduce(t)
        time.sleep(0.01)
"""


def test_a_rank_exiting_0_mid_all_reduce_is_named_not_the_one_that_lost_it():
    """A rank that exited 0 while the other was in all-reduce is named, not the one that lost it."""
    first = first_failure({"node2": (SAMPLES / "rank1_of_2_exits_0_early.log").read_text()})
    assert isinstance(first, LeftEarly)
    assert (first.node, first.rank, first.exit_code, first.lost_by) == ("node2", 1, "0", "node2 rank 0")
    assert "Connection closed by peer" in first.says and first.time == "2026-11-25_16:07:26"
    assert first.describe().startswith("rank 1 on node2 exited 0 before 2026-11-25_16:07:26 while the others "
                                       "still trained; the others then lost their connection to it "
                                       "(node2 rank 0: RuntimeError: ")


def test_a_rank_torchrun_stopped_itself_is_not_taken_for_the_one_that_left():
    first = first_failure({"node1": (SAMPLES / "rank2_of_3_exits_0_early_rank1_stopped.log").read_text()})
    assert isinstance(first, LeftEarly) and (first.node, first.rank) == ("node1", 2)


def _raised(rank: int, message: str) -> str:
    return (f"[rank{rank}]: Traceback (most recent call last):\n[rank{rank}]:   File \"t.py\", line 9\n"
            f"[rank{rank}]: RuntimeError: {message}\n")


def test_the_rank_that_left_is_found_on_another_node_than_the_first_failure():
    lost = "[rank0]: epoch 1\n" + _raised(0, "Connection closed by peer [10.0.0.2]:4444") + _summary(
        "2026-11-23_06:51:21", 0, 1)
    left = "[rank2]: epoch 1\n[rank3]: epoch 1\n" + _raised(2, "Connection reset by peer") + _summary(
        "2026-11-23_06:51:30", 2, 1)
    first = first_failure({"node1": lost, "node2": left})
    assert isinstance(first, LeftEarly) and (first.node, first.rank, first.lost_by) == ("node2", 3, "node1 rank 0")


def test_a_crashed_rank_is_named_by_torchrun_s_summary_not_by_the_rank_it_cut_off():
    """A rank that crashed is named by torchrun's summary, without the words of the rank it cut off."""
    first = first_failure({"node1": (SAMPLES / "rank1_of_2_exits_3.log").read_text()})
    assert first == Failure("node1", 1, "3", "2026-11-25_16:18:02", None)  # rank 0's "Connection reset" is not its


def test_a_raising_rank_is_named_even_when_torchrun_named_the_rank_it_cut_off():
    """A rank that raised is named when the rank it cut off ended first, and torchrun named that one."""
    first = first_failure({"node2": (SAMPLES / "rank1_raises_and_ends_after_rank0_lost_it.log").read_text()})
    assert (first.node, first.rank, first.says) == ("node2", 1, "ValueError: rank 1 cannot read its shard")
    assert first.exit_code == "-15"  # torchrun stopped it: what the summary says of it


def test_a_traceback_s_last_line_is_the_rank_s_own_whatever_was_written_in_between():
    """Under load torchrun's agent logs (it is stopping the others) while a rank's traceback is
    still being written, and another rank prints meanwhile: the exception is the rank's own line."""
    traceback = _raised(4, "Connection closed by peer [198.18.0.12]:4444").splitlines(keepends=True)
    log = ("[rank4]: epoch 1\n[rank5]: epoch 1\n" + traceback[0] +
           "W1129 03:19:20.961000 6 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 13 "
           "closing signal SIGTERM\n" + traceback[1] + "[rank5]: still here\n" + traceback[2])
    assert program_error(log) == ("RuntimeError: Connection closed by peer [198.18.0.12]:4444", 4)
    left = "[rank2]: epoch 1\n[rank3]: epoch 1\n" + _raised(2, "Connection reset by peer") + _summary(
        "2026-11-29_03:19:22", 2, 1)
    stopped = "Failures:\n[1]:\n  time      : 2026-11-29_03:19:21\n  rank      : 5 (local_rank: 1)\n  exitcode  : -15\n"
    summary = _summary("2026-11-29_03:19:21", 4, 1).replace("Root Cause", stopped + "Root Cause")
    first = first_failure({"node3": log + summary, "node2": left})
    assert isinstance(first, LeftEarly) and (first.node, first.rank, first.lost_by) == ("node2", 3, "node3 rank 4")


def test_a_lost_connection_with_every_rank_accounted_for_blames_no_one_else():
    log = "[rank0]: epoch 1\n" + _raised(0, "Connection closed by peer [10.0.0.2]:4444") + _summary(
        "2026-11-23_06:51:21", 0, 1)
    assert first_failure({"node1": log}) == Failure("node1", 0, "1", "2026-11-23_06:51:21",
                                                    "RuntimeError: Connection closed by peer [10.0.0.2]:4444")


def test_a_real_rank_that_returns_early_is_named_as_the_cause(torch_python, tmp_path):
    script = tmp_path / "early.py"
    script.write_text(RANK_ONE_RETURNS_EARLY)
    first = first_failure({"node1": _torchrun(torch_python.python, "--script", str(script), "--")})
    assert isinstance(first, LeftEarly), first
    assert (first.node, first.rank, first.lost_by) == ("node1", 1, "node1 rank 0")


def test_a_node_whose_rank_exited_0_is_named_with_its_exit_barrier_s_time():
    """A node whose rank exited 0 is named with the time its torchrun's exit barrier dates."""
    first = first_failure({"node1": (SAMPLES / "node_of_rank0_loses_rank1.log").read_text(),
                           "node2": (SAMPLES / "node_of_rank1_exits_0_early.log").read_text()})
    assert isinstance(first, LeftEarly)
    assert (first.node, first.rank, first.left_at, first.lost_by) == ("node2", 1, "16:39:20", "node1 rank 0")
    assert first.describe().startswith("rank 1 on node2 exited 0 at 16:39:20 while the others still trained; ")
    alone = first_failure({"node1": (SAMPLES / "node_of_rank0_loses_rank1.log").read_text()})
    assert type(alone) is Failure and (alone.node, alone.rank) == ("node1", 0)  # no word of node2: no guess


def test_once_a_node_failed_the_nodes_that_exited_0_are_read_for_an_early_leaver():
    """Once a node failed, the nodes that exited 0 are read too, for a rank that left early."""
    from deploy.engines.fleet import witnesses
    from deploy.job.plan import NodeState

    states = {"n1": NodeState("exited(1)"), "n2": NodeState("exited(0)"), "n3": NodeState("running"),
              "n4": NodeState("exited(?)")}
    assert witnesses(states) == ["n1", "n2", "n4"]
    assert witnesses({"n1": NodeState("exited(0)"), "n2": NodeState("running")}) == []  # nothing failed


SPAWNS_A_WORKER_THAT_RAISES = """
import torch.multiprocessing as mp

def worker(index):
    if index == 1:
        raise ValueError("worker 1 cannot read its shard")

if __name__ == "__main__":
    mp.spawn(worker, nprocs=2)
"""


def test_an_mp_spawn_worker_is_named_with_its_own_error_not_a_bare_process_raised(torch_python, tmp_path):
    """A worker that mp.spawn started is named with its own error, not a bare 'process raised'."""
    script = tmp_path / "spawns.py"
    script.write_text(SPAWNS_A_WORKER_THAT_RAISES)
    first = first_failure({"node1": _torchrun(torch_python.python, "--script", str(script), "--")})
    assert first is not None and first.exit_code == "1"
    assert first.says == "ProcessRaisedException: process 1: ValueError: worker 1 cannot read its shard"


def test_the_launcher_s_word_on_a_write_to_the_code_is_in_the_first_failure_s_line():
    """The launcher's word on a write through the code is in the first failure's line."""
    hint = ("agent.launch: model.pth is a file of your code, a link to the read-only code snapshot: it cannot "
            "be written; leave it out of train.code (train.code.ignore) so that the program writes its own, or "
            "write to $DDP_CKPT_DIR (/ckpt)")
    forged = "[rank0]: agent.launch: x.pt is a file of your code, a link to the read-only code snapshot"
    log = (forged + "\n" + _raised(0, "[Errno 30] Read-only file system: 'model.pth'").replace("RuntimeError", "OSError")
           + _summary("2026-11-23_06:51:21", 0, 1) + hint + "\n")
    first = first_failure({"node1": log})
    assert first.explained == hint
    assert first.describe() == ("node1 rank 0 failed first (exit 1): OSError: [Errno 30] Read-only file system: "
                                f"'model.pth'; {hint}")
    assert first_failure({"node1": log.replace(hint, "")}).explained is None
