"""A job that stops making progress is shown as stalled, never as running:
each rank's heartbeat, the node's status script that reads it, and the judgment against
job.stall_timeout. The status scripts run for real in sh; the jobs in the e2e tests run under the
real launcher and torchrun on this machine."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent import contract
from deploy.observe import doctor, view
from deploy.job import plan, runs, stall
from deploy.job.scripts import HOST_STATUS
from deploy.text import safe
from hung_job import hanging_program
from local_job import beats_dir, local_hosts
from trainer import flight
from agent import heartbeat
from agent.heartbeat import Heartbeat
from agent.contract import parse_beat
from trainer_helpers import final_weights
from waiting import wait_until


def _beat(age: float, step: int | None = 7, gap: float | None = 0.5, local: int = 0) -> stall.Beat:
    return stall.Beat(local_rank=local, step=step, rank=local, gap_s=gap, age_s=age)


# --- the heartbeat a rank writes ----------------------------------------------------------------

def test_a_rank_beats_in_place_with_its_step_rank_and_longest_interval(tmp_path):
    now = [100.0]
    hb = Heartbeat(str(tmp_path), local_rank=1, rank=3, clock=lambda: now[0])
    hb.beat(1)
    now[0] += 2.5
    hb.beat(2)
    now[0] += 0.5
    hb.beat()  # an evaluation batch: the same step
    text = (tmp_path / "1").read_bytes()
    assert len(text) == contract.LINE_BYTES and text.split() == [b"2", b"3", b"2500"]
    hb.beat(10 ** 15)  # a longer number is written in the same fixed width: nothing of the old line is left
    assert (tmp_path / "1").read_bytes().split() == [b"1000000000000000", b"3", b"2500"]
    hb.close()


def test_a_beat_without_a_directory_writes_nothing_and_an_unwritable_one_only_warns(tmp_path, capsys):
    """Without a directory a beat writes nothing, and an unwritable one costs a warning, not the job."""
    Heartbeat(None).beat(1)
    gone = Heartbeat(str(tmp_path / "missing"), 0, 0)
    gone.beat(1)
    gone.beat(2)
    assert capsys.readouterr().err.count("no heartbeat") == 1


def test_the_launcher_empties_its_directory_and_refuses_a_link_or_file_in_its_place(tmp_path, capsys):
    """The launcher empties its own directory, and refuses a link or a file in its place."""
    mine = tmp_path / "beats"
    assert heartbeat.prepare(str(mine)) == str(mine) and mine.is_dir()
    (mine / "0").write_text("9 9 9\n")
    # a run's beats are its own; the launcher that made it is named there (`doctor` finds its workers by it)
    assert heartbeat.prepare(str(mine)) == str(mine) and [p.name for p in mine.iterdir()] == [contract.LAUNCHER_FILE]
    assert (mine / contract.LAUNCHER_FILE).read_text().split()[0] == str(os.getpid())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("theirs")
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    assert heartbeat.prepare(str(link)) is None and (elsewhere / "keep").exists()
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert heartbeat.prepare(str(plain)) is None
    assert capsys.readouterr().err.count("heartbeats off") == 2
    heartbeat.remove(str(mine))
    assert not mine.exists()


@pytest.mark.parametrize("name, age, text, read", [
    ("0", "5", "12 3 1500", (0, 12, 3, 1.5, 5.0, None)),
    ("1", "-2", "12", (1, 12, None, None, 0.0, None)),  # written after the node's clock was read: new
    ("2", "5", "", (2, None, None, None, 5.0, None)),  # a user's empty beat: its time alone
    ("3", "5", "9" * 400, (3, None, None, None, 5.0, None)),  # no number that fits
    ("4", "5", "- 2 - init", (4, None, 2, None, 5.0, "init")),  # the progress hook's, in init_process_group
    ("5", "5", "7 2 10 nosuch", (5, 7, 2, 0.01, 5.0, None)),  # no phase it writes
    ("x", "5", "1", None), ("0", "five", "1", None), ("0", "9" * 30, "1", None),
])
def test_a_beat_as_the_node_printed_it_is_read_as_numbers_or_not_at_all(name, age, text, read):
    assert parse_beat(name, age, text) == read


# --- the node's status script, run for real ---------------------------------------------------------

def _running_host_run(tmp_path: Path) -> tuple[Path, subprocess.Popen]:
    """A host runtime's run directory whose recorded process group is alive."""
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    (run / "pid").write_text(f"{proc.pid}\n")
    (run / "log").write_text('[rank0]: METRICS {"kind": "train", "step": 4}\n')
    return run, proc


def _host_status(run: Path, beats: Path) -> plan.NodeState:
    out = subprocess.run(["sh", "-c", HOST_STATUS, "sh", str(run), str(beats)], capture_output=True, text=True,
                         check=True).stdout
    return plan.parse_status(out)


def test_the_status_script_reports_each_rank_s_beat_by_node_clock_and_the_log_s_age(tmp_path):
    """The status script reports each rank's beat by the node's clock, and the log's age."""
    run, proc = _running_host_run(tmp_path)
    try:
        beats = tmp_path / "beats"
        beats.mkdir()
        for local, (step, age) in enumerate([(41, 100), (40, 130)]):
            Heartbeat(str(beats), local, 10 + local).beat(step)
            os.utime(beats / str(local), (time.time() - age, time.time() - age))
        os.utime(run / "log", (time.time() - 50, time.time() - 50))
        s = _host_status(run, beats)
        assert s.state == "running" and s.metrics.startswith("METRICS ")
        assert [(b.local_rank, b.step, b.rank) for b in s.beats] == [(0, 41, 10), (1, 40, 11)]
        assert 99 <= s.beats[0].age_s <= 102 and 129 <= s.beats[1].age_s <= 132 and 49 <= s.quiet_s <= 52

        judged = plan.with_stall(s, 60)
        assert judged.stall is not None and judged.stall.last_step == 41 and 99 <= judged.stall.for_s <= 102
        assert view.state_text(judged).startswith("stalled 1m4") and "(last step 41 since " in view.state_text(judged)
        assert plan.with_stall(s, 120).stall is None  # rank 0 moved 100 s ago: within 120 s
        assert plan.with_stall(s, None).stall is None
    finally:
        proc.kill()


def test_names_in_the_heartbeat_directory_cannot_add_lines_to_the_status(tmp_path):
    run, proc = _running_host_run(tmp_path)
    try:
        beats = tmp_path / "beats"
        beats.mkdir()
        (beats / "0\nrestarts 7").write_text("1\n")
        (beats / "0\nMETRICS {}").write_text("1\n")
        (beats / "x").write_text("1\n")
        (beats / "1").write_text("5\nrestarts 9\nMETRICS {\"step\": 999}\n")  # a line of the job's, not of the script's
        os.symlink("/etc/hostname", beats / "2")
        s = _host_status(run, beats)
        assert s.restarts == 0 and s.metrics == 'METRICS {"kind": "train", "step": 4}'
        assert [(b.local_rank, b.step) for b in s.beats] == [(1, 5)]
    finally:
        proc.kill()


def test_a_job_that_is_not_running_reports_no_progress(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "pid").write_text("1\n")
    (run / "exit").write_text("0\n")
    beats = tmp_path / "beats"
    beats.mkdir()
    (beats / "0").write_text("3\n")
    s = _host_status(run, beats)
    assert s.state == "exited(0)" and s.beats == () and s.quiet_s is None


def test_a_node_its_launcher_ended_on_a_stall_shows_stopped_stalled_and_only_then(tmp_path):
    run, kept = tmp_path / "run", tmp_path / "runs/20261126-120000-abcd/here"
    run.mkdir()
    kept.mkdir(parents=True)
    (run / "log").symlink_to(kept / "log")
    (run / "pid").write_text("1\n")
    (run / "exit").write_text("0\n")
    (kept / "stalls").write_text("1764072000 12 400 300 report\n1764072900 40 400 300 stop\n")
    assert _host_status(run, tmp_path / "beats").state == "stopped (stalled)"
    (kept / "stalls").write_text("1764072000 12 400 300 stop\n1764072900 40 400 300 restart\n")
    assert _host_status(run, tmp_path / "beats").state == "exited(0)"  # the last stall restarted it: it finished
    (kept / "stalls").write_text("1764072900 40 400 300 stop\n")
    (run / "exit").write_text("1\n")
    assert _host_status(run, tmp_path / "beats").state == "exited(1)"  # not the launcher's end: a failure
    (run / "exit").write_text("0\n")
    (kept / "stalls").write_text("\x1b[2J stop\n")
    assert _host_status(run, tmp_path / "beats").state == "exited(0)"  # the job's own writing is no record

# --- the judgment ------------------------------------------------------------------------------------

def test_auto_allows_ten_times_a_rank_s_longest_interval_but_at_least_the_floor():
    """auto allows ten times the longest interval a rank has shown, and never less than the floor."""
    assert stall.timeout("auto", (_beat(1, gap=2.0),)) == stall.FLOOR_S
    assert stall.timeout("auto", (_beat(1, gap=45.0), _beat(1, gap=90.0, local=1))) == 900.0  # a slow, healthy step
    assert stall.timeout("auto", (_beat(1, gap=None),)) == stall.FLOOR_S  # a user's beat says no interval
    assert stall.timeout("auto", ()) == stall.QUIET_S  # output alone says less
    assert stall.timeout(30.0, ()) == 30.0 and stall.timeout(None, (_beat(1),)) is None


def test_a_node_is_stalled_only_when_none_of_its_ranks_moved_and_only_while_it_runs():
    one_moves = (_beat(500, step=9), _beat(3, step=10, local=1))
    assert stall.judge("running", one_moves, None, 60) is None
    both_still = (_beat(500, step=9), _beat(400, step=10, local=1))
    found = stall.judge("running", both_still, 5.0, 60, now=1000.0)
    assert (found.for_s, found.last_step, found.since, found.evidence) == (400, 10, 600.0, "heartbeats")
    assert stall.judge("restarting", both_still, None, 60) is None
    assert stall.judge("exited(0)", both_still, None, 60) is None


def test_a_program_without_heartbeats_is_judged_by_its_output_and_says_so():
    found = stall.judge("running", (), 2000.0, "auto")
    assert found is not None and found.evidence == "output" and found.last_step is None
    assert view.stall_text(found).startswith("stalled 33m20s (no output since ")
    assert stall.judge("running", (), 1000.0, "auto") is None
    assert stall.judge("running", (), None, 5) is None  # nothing tells: never a guess
    # before its first METRICS line a program is starting (imports, a dataset, the rendezvous):
    # its silence is not judged by a short setting
    assert stall.judge("running", (), 60.0, 5, started=False) is None
    assert stall.judge("running", (), 60.0, 5, started=True) is not None
    assert stall.judge("running", (), 2000.0, 5, started=False) is not None


def test_a_plain_follower_prints_a_node_once_as_it_stalls_and_once_as_it_moves_again():
    """A plain follower prints a node once when it stalls, and once when it moves again."""
    shown = []
    follow = view.PlainFollower(shown.append, every=1e9)
    moving = plan.NodeState("running", 'METRICS {"step": 4}')
    stalled = lambda age: plan.with_stall(plan.NodeState("running", 'METRICS {"step": 4}',  # noqa: E731
                                                         beats=(_beat(age, step=4),)), 10)
    for s in (moving, stalled(11), stalled(12), stalled(13), moving):
        follow.update({"node1": s})
    assert [line.split("  ")[1].split(" (")[0] for line in shown] == ["running", "stalled 11s", "running"]


def test_stall_timeout_is_a_number_auto_or_null_and_anything_else_is_named(ddp, tmp_path):
    hosts = local_hosts(tmp_path, job="stalljob", train={"args": []})
    data = json.loads(hosts.read_text())
    for bad in ("soon", 0, -5, True):
        data["job"]["stall_timeout"] = bad
        hosts.write_text(json.dumps(data))
        r = ddp(hosts, "validate")
        assert r.exit_code == 2 and "job.stall_timeout" in r.stderr and "auto or null" in r.stderr, r.output


# --- jobs on this machine, for real ------------------------------------------------------------------


def _status(ddp, hosts: Path) -> dict:
    r = ddp(hosts, "status", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)[0]


def _follow_until(hosts: Path, wanted: str, timeout: float = 60) -> list[str]:
    """`status --follow`'s plain lines (not a terminal) until one holds ``wanted``; then it is ended."""
    follow = subprocess.Popen([sys.executable, "-m", "deploy", "--hosts", str(hosts), "status", "--follow"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        for line in follow.stdout:
            lines.append(line.rstrip("\n"))
            if wanted in line or time.monotonic() > deadline:
                break
    finally:
        follow.kill()
        follow.wait()
    return lines


@pytest.mark.e2e
def test_a_rank_that_stops_taking_part_shows_its_node_stalled_at_its_last_step(ddp, tmp_path, monkeypatch):
    """A rank that stops taking part shows its node stalled at its last step, in status and in its follow."""
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # torch's log folder of a launcher that stop --now kills stays here
    code = tmp_path / "code"
    code.mkdir()
    (code / "hangs.py").write_text(hanging_program(rank=1, pause=0.1))
    hosts = local_hosts(tmp_path, job="stalljob", train={"script": "hangs.py", "code": str(code)}, procs=2)
    data = json.loads(hosts.read_text())
    data["job"]["stall_timeout"] = 3
    hosts.write_text(json.dumps(data))
    beats = Path(beats_dir(hosts))
    try:
        assert ddp(hosts, "launch").exit_code == 0
        moving = wait_until(lambda: (lambda s: s if len(s["heartbeats"]) == 2 else None)(_status(ddp, hosts)), 120,
                            "both ranks' beats", interval=0.2)
        assert moving["state"] == "running" and moving["stalled"] is None
        assert sorted(b["rank"] for b in moving["heartbeats"]) == [0, 1]

        followed = _follow_until(hosts, "stalled: ")  # the node's line, then what every rank does
        assert followed[-2].startswith("here  stalled ") and "(last step 4 since " in followed[-2], followed
        assert followed[-1].startswith("stalled: here rank 1 is in <module> (hangs.py:7); the 1 other rank waits "
                                       "in all_reduce (hangs.py:8)"), followed

        stalled = _status(ddp, hosts)
        assert stalled["state"] == "running"  # the processes are there: stalled is what they do
        assert stalled["stalled"]["last_step"] == 4 and stalled["stalled"]["evidence"] == "heartbeats"
        assert stalled["stalled"]["timeout_s"] == 3 and stalled["stalled"]["for_s"] > 3
        assert sorted((b["rank"], b["step"]) for b in stalled["heartbeats"]) == [(0, 4), (1, 4)]
        shown = ddp(hosts, "status")
        assert "stalled " in shown.stdout and "last step 4 since" in shown.stdout

        # why: rank 1 is in its sleep, outside any collective; rank 0 waits for it in the all-reduce
        found = ddp(hosts, "doctor")
        assert found.exit_code == 0, found.output
        first = found.stdout.splitlines()[0]
        assert first == "here rank 1 is in <module> (hangs.py:7); the 1 other rank waits in all_reduce (hangs.py:8)", found.stdout
        data = json.loads(ddp(hosts, "doctor", "--json").stdout)
        assert data["culprits"] == ["here rank 1"] and data["gone"] == [] and data["silent"] == {}
        assert {r["rank"]: r["state"] for r in data["ranks"]} == {0: "S", 1: "S"}

        # kept with the run by the node's launcher, once, with the stacks it found: read after the fact
        kept = wait_until(lambda: (lambda r: r if r["nodes"]["here"]["stalls"] else None)(
            json.loads(ddp(hosts, "runs", "--json").stdout)[-1]), 60, "the stall kept with the run", interval=0.2)
        assert [(st["step"], st["limit_s"], st["action"]) for st in kept["nodes"]["here"]["stalls"]] == [(4, 3, "report")]
        assert "1 (reported)" in ddp(hosts, "runs").stdout
        shown = ddp(hosts, "status", "--run", kept["id"]).stdout.splitlines()
        assert re.fullmatch(r"stalled at \d\d:\d\d:\d\d on here \(no step for \ds after step 4; job.stall_timeout 3s\): "
                            r"reported \(job.on_stall: report\)", shown[-2]), shown
        assert shown[-1] == ("  why: here rank 1 is in <module> (hangs.py:7); the 1 other rank waits in all_reduce "
                             "(hangs.py:8)"), shown
        assert "agent.launch: stalled: no rank on this node moved for " in ddp(hosts, "logs").stdout
    finally:
        assert ddp(hosts, "stop", "--now").exit_code == 0
    assert not beats.exists()  # the stop takes the run's heartbeats with it, a kill included


@pytest.mark.e2e
def test_on_stall_stop_ends_a_hung_job_names_the_culprit_and_nothing_starts_it_again(ddp, tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    code = tmp_path / "code"
    code.mkdir()
    (code / "hangs.py").write_text(hanging_program(rank=1, pause=0.1))
    # max_restarts 1: the host supervisor and torchrun would start it again after a failure
    hosts = local_hosts(tmp_path, job="stallstop", train={"script": "hangs.py", "code": str(code)}, procs=2,
                        max_restarts=1)
    data = json.loads(hosts.read_text())
    data["job"].update(stall_timeout=3, on_stall="stop")
    hosts.write_text(json.dumps(data))
    run_dir = tmp_path / "nas/ckpt/.ddp-deploy/stallstop/here"
    try:
        r = ddp(hosts, "launch", "--wait", "--timeout", "120")
        assert r.exit_code == 1, r.output
        assert ("the job stalled and was stopped on here (job.on_stall: stop): here rank 1 is in <module> (hangs.py:7); "
                "the 1 other rank waits in all_reduce (hangs.py:8)") in r.stderr, r.output
        ended = _status(ddp, hosts)
        assert ended["state"] == "stopped (stalled)" and ended["restarts"] == 0, ended
        assert (run_dir / "exit").read_text().strip() == "0"  # so that nothing starts it again
        assert heartbeat.workers(beats_dir(hosts)) == []  # its workers are gone
        assert not Path(beats_dir(hosts)).exists()
        assert "stopped (stalled)" in ddp(hosts, "status").stdout
        assert "and ending this node's part of the job, which nothing starts again (job.on_stall: stop)" in \
            ddp(hosts, "logs").stdout
        (kept,) = json.loads(ddp(hosts, "runs", "--json").stdout)
        assert kept["outcome"] == "stalled, stopped on here (job.on_stall: stop)", kept
        assert "1 (stopped)" in ddp(hosts, "runs").stdout
        shown = ddp(hosts, "status", "--run", kept["id"]).stdout
        assert "stopped (stalled)" in shown and "): stopped (job.on_stall: stop)" in shown, shown
    finally:
        assert ddp(hosts, "stop").exit_code == 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the diagnosis (deploy/observe/doctor.py) ------------------------------------------------------------

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
LOGGER = "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"


def _dump(*frames: tuple[str, str, int], pid: int = 10) -> str:
    return json.dumps([{"pid": pid, "os_thread_id": pid, "thread_name": None,
                        "frames": [{"name": n, "filename": f, "line": line} for n, f, line in frames]}])


def _node(*workers: tuple[int, int, str, str | None]) -> str:
    """A node's DIAGNOSE output: (pid, rank, state, py-spy's dump or None)."""
    lines = []
    for pid, rank, state, dump in workers:
        lines.append(f"rank {pid} {rank} {rank % 2} {state}")
        if dump is not None:
            lines.append(f"stack {pid} {dump}")
    return "\n".join([*lines, f"workers {len(workers)}"])


WAITS = _dump(("all_reduce", C10D, 2850), ("wrapper", LOGGER, 83), ("step", "/code/train.py", 88))


def test_the_rank_outside_any_collective_is_named_first_and_the_waiting_ones_after():
    ranks = (doctor.parse("node1", _node((10, 0, "S", WAITS), (11, 1, "S", WAITS)))
             + doctor.parse("node2", _node((10, 2, "S", WAITS), (11, 3, "R", _dump(("spin", "/code/train.py", 40), pid=11)))))
    d = doctor.diagnose(ranks, {}, 4)
    assert d.summary == "node2 rank 3 is in spin (train.py:40); the 3 other ranks wait in all_reduce (train.py:88)"
    assert d.culprits == ("node2 rank 3",) and list(d.groups) == ["all_reduce (train.py:88)", "spin (train.py:40)"]


def test_a_stopped_rank_a_gone_rank_and_a_silent_node_are_each_named_as_such():
    ranks = doctor.parse("node1", _node((10, 0, "S", WAITS), (11, 1, "T", None)))
    d = doctor.diagnose(ranks, {"node3": "ssh: connect timed out"}, 6)
    assert d.summary.startswith("node1 rank 1 is stopped (SIGSTOP: state T); the 1 other rank waits in all_reduce")
    assert "node3 did not answer (ssh: connect timed out)" in d.summary
    assert d.gone == ()  # a node did not answer: which ranks are gone is not known
    alone = doctor.diagnose(doctor.parse("node1", _node((10, 0, "S", WAITS))), {}, 2)
    assert alone.gone == (1,) and alone.summary == ("the one rank found is in all_reduce (train.py:88); rank 1 runs on "
                                                     "no node (exited, or never started)")


def test_a_wait_in_ddp_s_gradient_all_reduce_names_the_rank_that_holds_it_up():
    """A rank in backward waits in DDP's gradient all-reduce, and the rank that holds it up is named."""
    # DDP's all-reduce of the gradients runs from the autograd engine's hooks: py-spy sees backward
    autograd = "/venv/lib/python3.11/site-packages/torch/autograd/graph.py"
    backward = _dump(("_engine_run_backward", autograd, 1072), ("backward", "/venv/lib/python3.11/site-packages/"
                     "torch/_tensor.py", 581), ("train_step", "/app/trainer/loop.py", 130))
    ranks = doctor.parse("node1", _node((10, 0, "S", backward), (11, 1, "T", None)))
    d = doctor.diagnose(ranks, {}, 2)
    assert d.summary == "node1 rank 1 is stopped (SIGSTOP: state T); the 1 other rank waits in backward (loop.py:130)"
    assert d.culprits == ("node1 rank 1",)


def test_a_wait_in_ddp_s_buffer_broadcast_names_the_rank_that_holds_it_up():
    """A rank in DDP's broadcast of its buffers waits, and the rank that holds it up is named."""
    # every forward of a DDP model with buffers (BatchNorm's statistics) broadcasts them from rank 0 first;
    # py-spy sees DDP's own method, outside torch/distributed/
    ddp = "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py"
    forward = _dump(("_distributed_broadcast_coalesced", ddp, 2078), ("_sync_buffers", ddp, 2034),
                    ("forward", ddp, 1632), ("train_step", "/app/trainer/loop.py", 125))
    ranks = doctor.parse("node1", _node((10, 0, "S", forward), (11, 1, "T", None)) + "\nfr 10 77 broadcast")
    d = doctor.diagnose(ranks, {}, 2)
    assert d.culprits == ("node1 rank 1",)
    assert d.summary == ("node1 rank 1 is stopped (SIGSTOP: state T); the 1 other rank waits in "
                         "_distributed_broadcast_coalesced (loop.py:125) in broadcast #77")
    # py-spy on Python 3.11 and later names the method with its class (seen in a CI run, where the rank
    # waiting there was named a culprit too)
    qualified = _dump(("DistributedDataParallel._distributed_broadcast_coalesced", ddp, 2364), ("_sync_buffers", ddp, 2034),
                      ("forward", ddp, 1632), ("train_step", "/app/trainer/loop.py", 125))
    d = doctor.diagnose(doctor.parse("node1", _node((10, 0, "S", qualified), (11, 1, "T", None))), {}, 2)
    assert d.culprits == ("node1 rank 1",)
    assert d.summary == ("node1 rank 1 is stopped (SIGSTOP: state T); the 1 other rank waits in "
                         "DistributedDataParallel._distributed_broadcast_coalesced (loop.py:125)")
    # the same name in the program's own file is not DDP's
    own = _dump(("_distributed_broadcast_coalesced", "/code/train.py", 9), pid=11)
    d = doctor.diagnose(doctor.parse("node1", _node((10, 0, "S", WAITS), (11, 1, "S", own))), {}, 2)
    assert d.culprits == ("node1 rank 1",)


def test_the_flight_recorder_tells_apart_ranks_on_one_line_in_different_collectives():
    """Ranks on the same line in different collectives are told apart by the flight recorder."""
    # rank 2 called one all_reduce more than the others: py-spy sees the same line, torch's record does not
    ranks = doctor.parse("node1", _node((10, 0, "S", WAITS), (11, 1, "S", WAITS), (12, 2, "S", WAITS))
                         + "\nfr 10 1233 all_reduce\nfr 11 1233 all_reduce\nfr 12 1234 all_reduce\nfr 12 9 x;y\nfr 99 1 all_reduce")
    d = doctor.diagnose(ranks, {}, 3)
    assert d.summary == ("node1 rank 2 is in all_reduce #1234 (train.py:88); the 2 other ranks wait in all_reduce #1233 "
                         "(train.py:88)")
    assert [r.collective for r in ranks] == [(1233, "all_reduce"), (1233, "all_reduce"), (1234, "all_reduce")]
    sleeper = doctor.parse("node1", _node((10, 0, "S", WAITS), (11, 1, "S", _dump(("<module>", "/code/train.py", 7), pid=11)))
                           + "\nfr 10 5 all_reduce\nfr 11 4 all_reduce")
    d = doctor.diagnose(sleeper, {}, 2)
    assert d.summary == "node1 rank 1 is in <module> (train.py:7); the 1 other rank waits in all_reduce #5 (train.py:88)"
    assert any(line.startswith("node1 rank 1 (pid 11, state S, newest collective all_reduce #4): <module> (train.py:7)")
               for line in doctor.detail(d))


def test_a_worker_s_flight_watch_answers_with_the_default_group_s_newest_collective(tmp_path):
    """A worker's flight watch answers each request with the newest collective of the default group."""
    entries = [{"process_group": ["0", "default_pg"], "collective_seq_id": 4, "profiling_name": "gloo:all_reduce"},
               {"process_group": ["0", "default_pg"], "collective_seq_id": 5, "profiling_name": "gloo:broadcast"},
               {"process_group": ["1", "stop"], "collective_seq_id": 99, "profiling_name": "gloo:all_reduce"},
               {"process_group": ["0", "default_pg"], "collective_seq_id": 6, "profiling_name": "\x1b[2J"},
               "junk", {"collective_seq_id": "7"}]
    dumps = [json.dumps({"entries": entries}), "not json"]
    watch = flight.FlightWatch(str(tmp_path), 1, lambda collectives, active: dumps.pop(0))
    assert (tmp_path / "fr-1").read_text() == "- none\n"  # there from its start: DIAGNOSE waits for this rank
    assert not watch.check()  # nothing asked
    (tmp_path / "fr-request").write_text("123-456\n")
    assert watch.check() and (tmp_path / "fr-1").read_text() == "123-456 5 broadcast\n"
    assert not watch.check()  # answered once per request
    (tmp_path / "fr-request").write_text("124-1\n")
    assert watch.check() and (tmp_path / "fr-1").read_text() == "124-1 none\n"  # a dump that does not parse
    (tmp_path / "fr-request").write_text("$(reboot)\n")
    assert not watch.check()  # not a token: never echoed


def test_the_recorder_is_on_only_for_a_launched_job_where_torch_reads_its_backend_s(tmp_path):
    """The recorder is turned on only for a launched job, and only where torch reads the backend's."""
    env = {"DDP_HEARTBEAT_DIR": str(tmp_path)}
    assert flight.enable("gloo", env) == (flight.dumper("gloo") is not None)
    assert set(env) - {"DDP_HEARTBEAT_DIR"} == ({flight.buffer_env()} if flight.dumper("gloo") else set())
    assert not flight.enable("gloo", {}) and not flight.enable(None, dict(env))  # no heartbeats; not distributed
    own = {"DDP_HEARTBEAT_DIR": str(tmp_path), flight.buffer_env(): "4096"}
    flight.enable("gloo", own)
    assert own[flight.buffer_env()] == "4096"  # the job's own size is kept


@contextlib.contextmanager
def _answering_worker(beats: Path, rank: str, seq: int, op: str, every: float):
    """A sleeping process with the job's environment in ``beats`` (as a worker waiting in a collective
    is), and a flight watch that answers each request with ``seq`` and ``op``: yields the process."""
    beats.mkdir()
    env = {**os.environ, "DDP_HEARTBEAT_DIR": str(beats), "LOCAL_RANK": "0", "RANK": rank}
    worker = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                              env=env, stdout=subprocess.PIPE, text=True)
    watch = flight.FlightWatch(str(beats), 0, lambda collectives, active: json.dumps({"entries": [
        {"process_group": ["0", ""], "collective_seq_id": seq, "profiling_name": f"gloo:{op}"}]}), every=every)
    try:
        assert worker.stdout.readline().strip() == "ready"  # exec'd, with the job's environment (a fork not yet is not)
        # asleep, as a worker waiting in a collective is (under load it was still running its last bytecodes)
        wait_until(lambda: Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S", 10,
                   "the worker asleep", interval=0.05)
        threading.Thread(target=watch.run, daemon=True).start()
        yield worker
    finally:
        watch.close()
        worker.kill()
        worker.wait()


def test_diagnose_asks_each_worker_for_its_newest_collective_and_prints_each_answer(tmp_path):
    """diagnose asks the workers for their newest collective, and prints each answer."""
    with _answering_worker(tmp_path / "beats", "3", 41, "all_reduce", every=0.05) as worker:
        got = subprocess.run(["sh", "-c", contract.program("diagnose"), "sh", str(tmp_path / "beats"), "/bin/true"],
                             capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    assert f"rank {worker.pid} 3 0 S" in got.stdout and f"fr {worker.pid} 41 all_reduce" in got.stdout.splitlines()
    (ranked,) = doctor.parse("node1", got.stdout)
    assert ranked.collective == (41, "all_reduce")


def test_two_diagnoses_at_once_each_print_the_workers_answer(tmp_path):
    # the launcher's watch diagnoses a stall while the operator's status does: each writes its request,
    # a worker answers the newest only, and the first asker once kept its stall with no collective
    with _answering_worker(tmp_path / "beats", "0", 7, "broadcast", every=0.5) as worker:
        askers = [subprocess.Popen(["sh", "-c", contract.program("diagnose"), "sh", str(tmp_path / "beats"), "/bin/true"],
                                   stdout=subprocess.PIPE, text=True) for _ in range(2)]
        said = [asker.communicate(timeout=30)[0] for asker in askers]
    for out in said:
        assert f"fr {worker.pid} 7 broadcast" in out.splitlines(), said


def test_diagnose_never_writes_through_a_link_the_job_put_in_its_directory(tmp_path):
    """diagnose never writes its request through a link the job put in its directory."""
    beats, outside = tmp_path / "beats", tmp_path / "precious"
    beats.mkdir()
    outside.write_text("kept\n")
    (beats / "fr-0").write_text("- none\n")  # a worker keeps the recorder: DIAGNOSE asks
    (beats / "fr-request").symlink_to(outside)
    got = subprocess.run(["sh", "-c", contract.program("diagnose"), "sh", str(beats), "/bin/true"], capture_output=True,
                         text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    assert outside.read_text() == "kept\n"
    assert not (beats / "fr-request").is_symlink() and (beats / "fr-request").read_text().strip()


HOLD = """import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
print(libc.ptrace(0x4206, int(sys.argv[1]), None, None), ctypes.get_errno(), flush=True)  # PTRACE_SEIZE
libc.ptrace(0x4207, int(sys.argv[1]), None, None)  # PTRACE_INTERRUPT: stopped (t), as py-spy suspends it
time.sleep(float(sys.argv[2]))
"""
"""Another tracer of a process (as py-spy is while it dumps it) for a while: ptrace lets one at a time."""


def test_diagnose_reads_a_worker_that_another_diagnosis_holds_for_a_moment(tmp_path):
    # in CI runs the launcher's diagnosis of a stall and an operator's doctor read the same workers at once:
    # the second py-spy could not suspend them (EPERM) and the stall was kept without that rank's stack;
    # or the second found one suspended by the first (state t) and said its state was unknown
    spy = Path(sys.executable).with_name("py-spy")
    if not os.access(spy, os.X_OK):
        pytest.skip(f"py-spy is not installed beside {sys.executable} (pip install py-spy)")
    beats = tmp_path / "beats"
    beats.mkdir()
    env = {**os.environ, "DDP_HEARTBEAT_DIR": str(beats), "LOCAL_RANK": "0", "RANK": "1"}
    worker = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                              env=env, stdout=subprocess.PIPE, text=True)
    holder = None
    try:
        assert worker.stdout.readline().strip() == "ready"
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(worker.pid), "1.5"], stdout=subprocess.PIPE,
                                  text=True)
        assert holder.stdout.readline().split() == ["0", "0"]  # held
        wait_until(lambda: Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "t", 10,
                   "the worker stopped by its tracer", interval=0.02)
        alone = subprocess.run([str(spy), "dump", "--pid", str(worker.pid)], capture_output=True, text=True, timeout=30)
        assert alone.returncode != 0 and "EPERM" in alone.stdout + alone.stderr  # what a single try finds
        got = subprocess.run(["sh", "-c", contract.program("diagnose"), "sh", str(beats), str(spy)], capture_output=True,
                             text=True, timeout=60)
    finally:
        for proc in (holder, worker):
            if proc is not None:
                proc.kill()
                proc.wait()
    assert got.returncode == 0, got.stderr
    (ranked,) = doctor.parse("node1", got.stdout)
    assert ranked.rank == 1 and ranked.state == "S" and ranked.problem is None, got.stdout
    assert ranked.frames[-1].name == "<module>" and ranked.frames[-1].short == "<string>", ranked.frames


def test_ranks_in_mismatched_collectives_name_the_smaller_group():
    other = _dump(("broadcast", C10D, 2600), ("sync", "/code/train.py", 120))
    ranks = doctor.parse("node1", _node((10, 0, "S", WAITS), (11, 1, "S", WAITS), (12, 2, "S", other)))
    d = doctor.diagnose(ranks, {}, 3)
    assert d.summary == "node1 rank 2 is in broadcast (train.py:120); the 2 other ranks wait in all_reduce (train.py:88)"


@pytest.mark.parametrize("dump", ["Permission Denied: try running again with elevated permissions", "",
                                  "[1, 2]", '{"a": 1}', "[" * 100000, json.dumps([{"frames": [{"name": "\x1b[2Jx",
                                                                                               "filename": "f", "line": 10 ** 40}]}])])
def test_what_py_spy_or_the_job_printed_never_fails_the_diagnosis(dump):
    ranks = doctor.parse("node1", _node((10, 0, "S", dump)))
    d = doctor.diagnose(ranks, {}, 1)
    assert d.ranks[0].rank == 0 and isinstance(d.summary, str)
    for line in doctor.detail(d):
        assert "\x1b" not in safe(line)


def test_a_node_whose_output_is_not_the_scripts_adds_no_rank():
    assert doctor.parse("node1", "rank x 0 0 S\nrank 10 0\nstack 99 []\nworkers 0\n\x1b[2J") == []


# --- job.on_stall: restart ---------------------------------------------------------------------------

RESTART_ARGS = ["--dataset", "synthetic", "--epochs", "2", "--synthetic-size", "2048", "--batch-size", "16",
                "--log-every", "1", "--ckpt-every", "8"]


def _restart_job(tmp_path: Path, name: str, **job) -> Path:
    where = tmp_path / name
    where.mkdir()
    hosts = local_hosts(where, job="stallrestart", train={"args": RESTART_ARGS}, procs=2, max_restarts=1)
    data = json.loads(hosts.read_text())
    data["job"].update(job)
    hosts.write_text(json.dumps(data))
    return hosts


def _records(hosts: Path) -> list[dict]:
    path = hosts.parent / "nas/ckpt/metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.e2e
def test_on_stall_restart_kills_hung_workers_and_the_job_resumes_bit_identical(ddp, tmp_path, monkeypatch):
    """on_stall: restart kills a hung node's workers, and the job resumes and ends bit-identical."""
    import signal

    import torch

    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # torch's log folder of a launcher that stop --now kills stays here
    reference = _restart_job(tmp_path, "reference")
    r = ddp(reference, "launch", "--wait", "--timeout", "300")
    assert r.exit_code == 0, r.output

    # a healthy step, checkpoint or evaluation never takes 10 s, on a loaded machine either (a cluster
    # rank went 5 s without a step in a CI run: tests/cluster/test_stall.py's RESTART_STALL_TIMEOUT)
    hosts = _restart_job(tmp_path, "stalled", stall_timeout=10, on_stall="restart")
    beats = beats_dir(hosts)
    try:
        assert ddp(hosts, "launch").exit_code == 0
        # past a complete checkpoint, inside the epoch: then one rank is stopped (SIGSTOP), the other
        # waits for it in a collective, and no process exits
        wait_until(lambda: max((rec["step"] for rec in _records(hosts) if rec["kind"] == "train"), default=0) >= 12,
                   120, "training past the first checkpoint", interval=0.2)
        one = [heartbeat.ranked(beats)[1]]
        os.kill(one[0], signal.SIGSTOP)
        stopped = time.time()

        ended = wait_until(lambda: (lambda s: s if s["state"].startswith("exited") else None)(_status(ddp, hosts)), 240,
                           "the job's end", interval=0.2)
        assert ended["state"] == "exited(0)"
    finally:
        ddp(hosts, "stop", "--now")
    log = ddp(hosts, "logs").stdout
    assert "agent.launch: stalled: no rank on this node moved for " in log
    run = json.loads(ddp(hosts, "runs", "--json").stdout)[-1]["id"]
    (stall,) = json.loads(ddp(hosts, "status", "--run", run, "--json").stdout)["stalls"]
    assert stall["action"] == "restart" and stall["culprits"] == ["here rank 1"], stall
    assert stall["diagnosis"].startswith("here rank 1 is stopped (SIGSTOP: state T); the 1 other rank waits in "), stall
    if flight.dumper("gloo") is not None:  # this torch records gloo's collectives: the waiting rank's is named,
        # whichever it is: the stop may land in a step (all_reduce, or the broadcast of the buffers at its
        # forward) or at a checkpoint (broadcast)
        assert re.search(r"waits in ([\w.]+ #\d+ \(\w+\.py:\d+\)|[\w.]+ \(loop\.py:\d+\) in \w+ #\d+)$",
                         stall["diagnosis"]), stall
    assert "workers, which torchrun starts again from the newest checkpoint (job.on_stall: restart)" in log
    resumed = [rec for rec in _records(hosts) if rec["kind"] == "resumed" and rec["time"] > stopped]
    assert len(resumed) == 1 and resumed[0]["world_size"] == 2
    final = _records(hosts)[-1]
    assert final["kind"] == "final" and final["step"] == _records(reference)[-1]["step"]
    want, got = final_weights(reference.parent / "nas/ckpt"), final_weights(hosts.parent / "nas/ckpt")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_on_stall_restart_needs_restarts_left_and_a_stall_to_act_on(ddp, tmp_path):
    for job, said in (({"on_stall": "restart", "max_restarts": 0}, "which job.max_restarts 0 forbids"),
                      ({"on_stall": "restart", "max_restarts": 1, "stall_timeout": None}, "job.stall_timeout is null"),
                      ({"on_stall": "stop", "stall_timeout": None}, "job.on_stall: stop needs a stall to act on"),
                      ({"on_stall": "halt"}, "job.on_stall")):
        hosts = local_hosts(tmp_path, job="stalljob", train={"args": []})
        data = json.loads(hosts.read_text())
        data["job"].update(job)
        hosts.write_text(json.dumps(data))
        r = ddp(hosts, "validate")
        assert r.exit_code == 2 and said in r.stderr, r.output


def test_the_watchdog_acts_once_per_stall_not_before_a_beat_or_while_ranks_move(tmp_path):
    """The watchdog acts once on a stall, and not before the first beat or while ranks move."""
    out = io.StringIO()
    dog = heartbeat.Watchdog(str(tmp_path), 5.0, "restart", out=out, settle=0)
    assert not dog.check()  # no beat yet: nothing to judge
    for local in (0, 1):
        Heartbeat(str(tmp_path), local, local).beat(9)
    assert not dog.check()
    old = time.time() - 60
    os.utime(tmp_path / "0", (old, old))
    assert not dog.check()  # rank 1 still moves
    os.utime(tmp_path / "1", (old, old))
    assert dog.check() and list(tmp_path.iterdir()) == []  # acted, and its beats are gone: the next are the new workers'
    assert not dog.check() and dog.actions == 1
    assert out.getvalue().startswith("agent.launch: stalled: no rank on this node moved for 60 s (last step 9; "
                                     "job.stall_timeout 5 s); no worker of it runs, and torchrun's agent is in ")
    assert out.getvalue().endswith(": not kept (no run directory); killing its 0 workers, which torchrun starts again "
                                   "from the newest checkpoint (job.on_stall: restart)\n")


def test_a_finished_rank_leaves_no_beat_so_its_slow_exit_is_never_judged_a_stall(tmp_path):
    """A rank that finished leaves no beat, so its slow exit is never judged a stall."""
    def judged(directory: Path) -> bool:
        old = time.time() - 60  # every beat left is a minute old: past any stall_timeout here
        for beat in directory.iterdir():
            os.utime(beat, (old, old))
        return heartbeat.Watchdog(str(directory), 5.0, "report", out=io.StringIO()).check()

    for case, finishing in (("none", ()), ("one", (0,)), ("both", (0, 1))):
        beats = tmp_path / case
        beats.mkdir()
        ranks = [Heartbeat(str(beats), local, local) for local in (0, 1)]
        for rank in ranks:
            rank.beat(128)
        for local in finishing:
            ranks[local].finish()  # trained, evaluated, saved: the process now ends, however long that takes
            ranks[local].beat(129)  # and writes nothing again
        assert sorted(p.name for p in beats.iterdir()) == [str(n) for n in (0, 1) if n not in finishing]
        assert judged(beats) is (case != "both"), case  # a rank still at work and silent counts as before


def test_a_stall_with_no_worker_left_names_where_the_agent_hangs(tmp_path):
    # the workers ended and nothing started them again: the launcher's own main thread, torchrun's agent,
    # is what hangs (a store call, a rendezvous), and the watchdog's thread says where
    out = io.StringIO()
    dog = heartbeat.Watchdog(str(tmp_path), 5.0, "report", out=out)
    Heartbeat(str(tmp_path), 0, 0).beat(7)
    old = time.time() - 60
    os.utime(tmp_path / "0", (old, old))
    found = []

    def agent_hangs_here():
        watch = threading.Thread(target=lambda: found.append(dog.check()))
        watch.start()
        watch.join()

    agent_hangs_here()
    assert found == [True]
    said = out.getvalue()
    assert said.startswith("agent.launch: stalled: no rank on this node moved for 60 s (last step 7; job.stall_timeout "
                           "5 s); no worker of it runs, and torchrun's agent is in "), said
    assert " < agent_hangs_here (test_deploy_stall.py:" in said and said.count(" < ") == 4, said


def test_on_stop_the_watchdog_ends_its_launcher_so_nothing_starts_the_workers_again(tmp_path):
    """On stop the watchdog kills and ends its launcher, so that nothing starts the workers again."""
    out, ended = io.StringIO(), []
    dog = heartbeat.Watchdog(str(tmp_path), 5.0, "stop", out=out, end=lambda: ended.append(True), settle=0)
    Heartbeat(str(tmp_path), 0, 0).beat(9)
    old = time.time() - 60
    os.utime(tmp_path / "0", (old, old))
    assert dog.check() and ended == [True]
    assert out.getvalue().endswith("killing its 0 workers, and ending this node's part of the job, which nothing "
                                   "starts again (job.on_stall: stop): launch again to resume from the newest "
                                   "checkpoint\n")


# rank 1 hangs after its first beat; rank 0's all-reduce gives up after 6 s (its process group's timeout), while
# the launcher's watchdog, which found the stall at 2 s, still waits out its 5 s before killing
FAILS_DURING_THE_STOP = """\
import datetime, os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=6))
rank, t = dist.get_rank(), torch.zeros(1)
dist.all_reduce(t)
open(f"{os.environ['DDP_HEARTBEAT_DIR']}/{os.environ['LOCAL_RANK']}", "w").write(f"1 {rank}\\n")
if rank == 1:
    time.sleep(3600)
dist.all_reduce(t)
"""


@pytest.mark.e2e
def test_a_launcher_its_watchdog_stops_ends_with_0_even_if_its_workers_fail_first(tmp_path):
    """Under job.on_stall: stop every node's launcher stops its part; another node's stop (its
    workers' connections closing) may fail this node's workers before this launcher kills them:
    that is the same stop, and the node must not read as failed."""
    script = tmp_path / "fails.py"
    script.write_text(FAILS_DURING_THE_STOP)
    run, beats = tmp_path / "run", tmp_path / "beats"
    run.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "DDP_HEARTBEAT_DIR": str(beats), "DDP_ON_STALL": "stop", "DDP_STALL_TIMEOUT": "2",
           "DDP_DEPLOY_LOG_DIR": str(run)}
    port = _free_port()
    done = subprocess.run([sys.executable, "-m", "agent.launch", "--nnodes", "1", "--nproc-per-node", "2",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
                           "--script", str(script), "--"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (kept,) = [stall.StallRecord.parse(line) for line in (run / "stalls").read_text().splitlines()]
    assert kept.action == "stop" and kept.step == 1
    assert "Timed out" in (run / "log").read_text() or "timed out" in (run / "log").read_text().lower()
    assert not beats.exists()


def test_a_stall_is_kept_once_with_the_workers_stacks_and_again_only_after_progress(tmp_path):
    """Reported, a stall is kept once with the stacks of the workers, and again only after progress."""
    beats, record = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    record.mkdir()
    out = io.StringIO()

    # a real worker of the job, found by its environment as on a node, asleep in its program
    program = tmp_path / "sleeper.py"
    program.write_text("import time\n\ndef wait():\n    time.sleep(600)\n\nprint('up', flush=True)\nwait()\n")
    worker = subprocess.Popen([sys.executable, str(program)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, contract.HEARTBEAT_DIR_ENV: str(beats), "LOCAL_RANK": "0", "RANK": "0"})
    try:
        assert worker.stdout.readline() == "up\n"
        dog = heartbeat.Watchdog(str(beats), 5.0, "report", str(record), out=out)
        Heartbeat(str(beats), 0, 0).beat(12)
        now = int(time.time())
        old = now - 60
        os.utime(beats / "0", (old, old))
        assert dog.check(now) and not dog.check(now + 1)  # once per stall
        assert worker.poll() is None  # reported: nothing killed
        (line,) = (record / "stalls").read_text().splitlines()
        assert runs.StallRecord.parse(line) == runs.StallRecord(now, 12, 60, 5, "report")
        (ranks,) = [doctor.parse("here", (record / f"stall-{now}").read_text())]
        assert [(r.pid, r.rank, r.local_rank) for r in ranks] == [(worker.pid, 0, 0)]
        assert ranks[0].where() == "wait (sleeper.py:4)", ranks[0]
        assert out.getvalue() == ("agent.launch: stalled: no rank on this node moved for 60 s (last step 12; "
                                  "job.stall_timeout 5 s): the stacks of its workers are kept with the run "
                                  "(ddp-deploy status --run) (job.on_stall: report)\n")
        Heartbeat(str(beats), 0, 0).beat(13)  # it moves again; then stalls again: a new stall
        assert not dog.check()
        os.utime(beats / "0", (old, old))
        assert dog.check(now + 100) and len((record / "stalls").read_text().splitlines()) == 2
    finally:
        worker.kill()
        worker.wait()


def test_stall_records_that_are_not_exactly_what_the_launcher_writes_are_no_record():
    assert runs.StallRecord.parse("1764072063 - 400 300 restart") == runs.StallRecord(1764072063, None, 400, 300, "restart")
    for bad in ("1764072063 12 400 300 halt", "1764072063 12 400 300 report extra", "x 12 400 300 report",
                "1764072063 12 4e5 300 report", "99999999999999 12 400 300 report", "\x1b[2J 12 400 300 report"):
        assert runs.StallRecord.parse(bad) is None, bad


def test_only_the_diagnoses_that_the_stall_records_name_are_read_back(tmp_path):
    run = tmp_path / "20261126-120000-abcd"
    (run / "here").mkdir(parents=True)
    (run / "here/stall-100").write_text("rank 10 0 0 S\nworkers 1\n")
    (run / "here/stall-200").write_text("x" * 100)  # written by the job: no record names it
    (tmp_path / "secret").write_text("not this")
    (run / "here/stall-300").symlink_to(tmp_path / "secret")
    argv = ("sh", "-c", runs.STALL_DIAGNOSES, "sh", str(run), "here/100", "here/300", "there/100")
    got = runs.parse_diagnoses(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    assert got == {("here", 100): "rank 10 0 0 S\nworkers 1\n"}


def test_the_stalls_of_nodes_found_within_a_window_are_one_stall_of_the_job():
    rec = lambda t, action="restart": runs.StallRecord(t, 12, 400, 300, action)  # noqa: E731
    run = runs.Run("20261126-120000-abcd", {}, {
        "node1": runs.NodeRun(stalls=(rec(1000), rec(5000, "report"))),
        "node2": runs.NodeRun(stalls=(rec(1003),)),
        "node3": runs.NodeRun()})
    events = run.stall_events()
    assert [(t, sorted(nodes)) for t, nodes in events] == [(1000, ["node1", "node2"]), (5000, ["node1"])]
    assert run.stall_text() == "2 (1 restarted)" and runs.Run("x").stall_text() == "-"
    line = view.kept_stall_line({"time": 1000, "action": "restart", "nodes": {n: r.as_data() for n, r in events[0][1].items()}})
    assert "on node1, node2 (no step for 6m40s after step 12; job.stall_timeout 5m00s): workers restarted" in line
