"""Every benchmark of bench/ that runs without the test cluster, in its smoke mode (tiny sizes, no
timing asserted, nothing written to bench/results): none of them can rot unnoticed again."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_rank_smoke(script: str, tmp_path) -> subprocess.CompletedProcess:
    """A benchmark that runs as a one-rank job (bench_trainer.one_rank), in its smoke mode on the CPU,
    on a free port; it must end well."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    before = _scratch()
    r = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--device", "cpu",
                        "--out", str(tmp_path / "results")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _scratch() <= before, "its scratch folders were left behind"
    return r


def _scratch() -> set[Path]:
    """bench_trainer.one_rank's scratch folders: the dataset's and the heartbeats'."""
    return {*Path(tempfile.gettempdir()).glob("ddp-bench-*"), *Path("/dev/shm").glob("ddp-bench-beats-*")}


@pytest.mark.e2e
def test_the_trainer_benchmark_runs_the_trainer_and_both_loops_and_writes_nothing(tmp_path):
    """The trainer benchmark runs the trainer, the tutorial's loop and the bare loop, and writes nothing."""
    r = _one_rank_smoke("bench_trainer.py", tmp_path)
    shown = [line.split()[0] for line in r.stdout.splitlines() if "samples/s" in line]
    assert shown == ["a_ours", "b_reference", "c_bare"], r.stdout
    assert "a/c = " in r.stdout and "a/b = " in r.stdout
    assert not (tmp_path / "results").exists()


@pytest.mark.e2e
def test_the_step_parts_benchmark_times_every_rung_to_the_trainer_and_writes_nothing(tmp_path):
    """The step-parts benchmark times every rung from the bare loop to the trainer, and writes nothing."""
    r = _one_rank_smoke("bench_step_parts.py", tmp_path)
    table = r.stdout[r.stdout.index("rung "):].splitlines()[1:]
    assert [line.split()[0] for line in table] == ["bare", "+gather", "+stats", "+sched", "+beat", "+stop", "+log",
                                                   "trainer", "bare+ddp"], r.stdout
    assert not (tmp_path / "results").exists()


@pytest.mark.e2e
def test_the_parallelism_benchmark_compares_dp_ddp_and_stages_and_writes_nothing(tmp_path):
    """The parallelism benchmark compares DP, DDP and DDP with stages, and writes nothing."""
    r = subprocess.run([sys.executable, str(BENCH / "bench_parallel.py"), "--smoke", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [line.split()[0] for line in r.stdout.splitlines()] == ["dp", "ddp", "ddp-stages", "ddp-pipeline"]
    assert all(line.endswith(" x ddp") and " samples/s " in line for line in r.stdout.splitlines())
    assert not (tmp_path / "out").exists()


def test_the_heartbeat_benchmark_runs():
    r = subprocess.run([sys.executable, str(BENCH / "bench_heartbeat.py"), "--smoke"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("beat ") and " us, lenet step " in r.stdout and "beat/step " in r.stdout


def test_the_cli_start_benchmark_runs_each_command_and_reports_its_cpu():
    r = subprocess.run([sys.executable, str(BENCH / "bench_cli_start.py"), "--smoke"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["new"]
    assert set(got) == {"help", "import", "validate", "status_local"}
    assert all(0 < row["cpu_s"] <= row["cpu_s_max"] for row in got.values()), got


def test_the_exit_benchmark_ends_each_process_both_ways_and_reports_the_cpu_of_each():
    r = subprocess.run([sys.executable, str(BENCH / "bench_exit.py"), "--smoke"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["cases"]
    assert list(got) == ["import torch"]
    assert all(len(v) == 1 and v[0] > 0 for v in got["import torch"]["core_s"].values()), got


def test_the_flight_recorder_benchmark_runs():
    r = subprocess.run([sys.executable, str(BENCH / "bench_flight.py"), "--smoke"], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("all_reduce ") and " per collective; x2 per lenet step of " in r.stdout, r.stdout


def test_the_faults_table_is_made_from_the_recorded_figures():
    recorded = BENCH / "results" / "faults.jsonl"
    rows = [json.loads(line) for line in recorded.read_text().splitlines() if line.strip()]
    r = subprocess.run([sys.executable, str(BENCH / "faults_table.py"), str(recorded)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    faults, _, recovery = r.stdout.partition("\n\n")
    table = [line for line in faults.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # the header and one row per recorded fault
    assert all(table[i + 1].startswith(f"| {row['fault']} |") for i, row in enumerate(rows))
    # where a recovery's time went: one row per fault that recorded its phases, their sum at the end
    timed = [row for row in rows if row.get("recovery_phases")]
    lines = [line for line in recovery.splitlines() if line.startswith("| ")]
    assert len(lines) == (1 + len(timed) if timed else 0)
    for line, row in zip(lines[1:], timed):
        assert line.startswith(f"| {row['fault']} |")
        assert line.endswith(f"| {sum(row['recovery_phases'].values()):.1f} s |")


def test_suite_cpu_classes_each_ended_process_by_the_command_line_it_started_with(tmp_path, capsys):
    """suite_cpu's report on a recording made here: process accounting's records (struct acct_v3)
    matched to the sampled command lines by pid and start second; a pid used again later is
    another process; one never sampled is classed by its command name. (Recording needs root and
    `accton`, which CI does not install.)"""
    sys.path.insert(0, str(BENCH))
    try:
        import suite_cpu
    finally:
        sys.path.remove(str(BENCH))

    def record(pid, start, ticks, comm, parent=1):  # CPU time in 1/100 s, below comp_t's first exponent
        return suite_cpu.ACCT.pack(0, 3, 0, 0, 0, 0, pid, parent, start, 0.0, ticks, 0, 0, 0, 0, 0, 0, 0,
                                   comm.encode())

    (tmp_path / "pacct").write_bytes(
        record(100, 1000, 500, "python3.11") + record(101, 1000, 300, "python3.11")
        + record(100, 2000, 120, "python3.11") + record(102, 1000, 7, "docker")
        + record(103, 1000, 1, "x\x1b]0;pwn\x07")
        # a launcher's zygote (agent/zygote.py) and a worker it forked, which shows the launcher's command line
        + record(104, 1000, 40, "ddp-zygote", 101) + record(105, 1000, 200, "python", 104) + b"\0" * 10)
    sampled = [(100, 1000.4, "/opt/venv/bin/python -u -m trainer --epochs 1"),
               (101, 999.6, "python -c import runpy, sys; runpy.run_module(sys.argv.pop(1)) agent.launch --nnodes 3"),
               (100, 2000.2, "python -m agent.probe --gpus 0"),
               (105, 1000.1, "python -c import runpy, sys; runpy.run_module(sys.argv.pop(1)) agent.launch --nnodes 3")]
    (tmp_path / "cmdlines.jsonl").write_text("".join(json.dumps({"pid": p, "start": s, "cmd": c}) + "\n"
                                                     for p, s, c in sampled))
    summary = suite_cpu.report(tmp_path)
    got = {c["class"]: (c["core_s"], c["processes"]) for c in summary["classes"]}
    assert got == {"trainer worker": (5.0, 1), "launcher and torchrun agent": (3.0, 1), "preflight probe": (1.2, 1),
                   "docker": (0.1, 1), "x\x1b]0;pwn\x07": (0.0, 1), "worker zygote": (0.4, 1),
                   "trainer worker (forked)": (2.0, 1)}
    assert summary["total_core_s"] == 11.7
    printed = capsys.readouterr().out  # a process names itself: shown as text, never to the terminal
    assert "x\\x1b]0;pwn\\x07" in printed and "\x1b" not in printed
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
