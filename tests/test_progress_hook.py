"""A stall is named for any program, with no change to it: the progress hook the launcher installs
in every worker (agent/progress_hook) beats the rank's heartbeat file on the process group's forming,
each collective and each DDP step, and marks the worker's start, so that a program that prints
nothing and writes no heartbeat is judged as precisely as the built-in trainer, at start-up too.
Real torchrun, gloo on this machine's CPU."""

from __future__ import annotations

import ast
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import contract
from deploy.job import stall
from deploy.observe import doctor
from fakes import free_port
from local_job import local_hosts
from agent import heartbeat
from agent.heartbeat import Heartbeat
from agent.contract import parse_beat, verdict
from waiting import wait_until

# Rank 1 stops taking part before step 5's all-reduce (line 7), rank 0 waits in it (line 8). Nothing
# in it beats, prints or knows of this bundle.
SILENT = """\
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, t = dist.get_rank(), torch.zeros(1)
for step in range(1, 100000):
    if step == 5 and rank == 1:
        time.sleep(3600)
    dist.all_reduce(t)
    time.sleep(0.1)
"""

# The slides' start-up: local rank 0 waits in a barrier (line 5) that rank 1, still preparing its
# data (line 7), has not reached; no step ever comes.
STARTUP = """\
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
if int(os.environ["LOCAL_RANK"]) == 0:
    dist.barrier()
else:
    time.sleep(3600)
"""

# Rank 1 leaves before the process group forms (line 4); rank 0 waits for it there for good.
LEAVES = """\
import os, sys
import torch.distributed as dist
if os.environ["RANK"] == "1":
    sys.exit(0)
dist.init_process_group("gloo")
"""


def _torchrun(python: str, script: Path, beats: Path) -> subprocess.Popen:
    beats.mkdir()
    env = {**os.environ, contract.HEARTBEAT_DIR_ENV: str(beats), "PYTHONPATH": heartbeat.hooked_path(None),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), str(script)], env=env, cwd=script.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _end(proc: subprocess.Popen, beats: Path) -> str:
    pids = heartbeat.workers(str(beats))
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)  # each worker leads a session of its own
        except OSError:
            pass
    return proc.communicate(timeout=60)[0].decode(errors="replace")


def _phases(beats: Path) -> dict[int, tuple]:
    return {b[0]: b for b in heartbeat.read_beats(str(beats))}


@pytest.mark.e2e
def test_a_program_that_never_beats_beats_on_collectives_and_the_sleeper_is_named(tmp_path, torch_python):
    """A program that beats nowhere beats on its collectives, and the watchdog names the rank that sleeps."""
    script = tmp_path / "silent.py"
    script.write_text(SILENT)
    beats, record = tmp_path / "beats", tmp_path / "run"
    record.mkdir()
    proc = _torchrun(torch_python.python, script, beats)
    try:
        # both ranks' files advance with no line of the program for them: two beats each, an interval
        moving = wait_until(lambda: (lambda b: b if len(b) == 2 and all(x[3] is not None for x in b.values()) else None)(
            _phases(beats)), 180, "both ranks beating on their all-reduce", interval=0.2)
        assert {(b[2], b[1], b[5]) for b in moving.values()} == {(0, None, "run"), (1, None, "run")}, moving

        out = io.StringIO()
        dog = heartbeat.Watchdog(str(beats), 2.0, "report", record=str(record), out=out)
        wait_until(dog.check, 60, "the watchdog's stall", interval=0.5)
        assert out.getvalue().startswith("agent.launch: stalled: no rank on this node moved for "), out.getvalue()
        (kept,) = record.glob("stall-*")
        found = doctor.diagnose(doctor.parse("here", kept.read_text()), {}, 2)
        assert found.summary == ("here rank 1 is in <module> (silent.py:7); the 1 other rank waits in all_reduce "
                                 "(silent.py:8)"), found.summary
    finally:
        _end(proc, beats)


@pytest.mark.e2e
def test_a_rank_that_leaves_before_the_group_forms_is_named_even_with_auto(tmp_path, torch_python):
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    beats = tmp_path / "beats"
    proc = _torchrun(torch_python.python, script, beats)
    try:
        out = io.StringIO()
        dog = heartbeat.Watchdog(str(beats), "auto", "report", out=out)
        wait_until(dog.check, 180, "the watchdog's stall", interval=0.5)
        assert {b[0]: b[5] for b in heartbeat.read_beats(str(beats))} == {0: "init", 1: "left"}
        assert out.getvalue().startswith("agent.launch: stalled: rank 1 ended "), out.getvalue()
        assert "while the others on this node never formed the process group" in out.getvalue()
    finally:
        _end(proc, beats)



@pytest.mark.e2e
def test_a_silent_program_s_start_up_hang_is_named_by_status_and_launch_wait(ddp, tmp_path, monkeypatch, torch_python):
    """A start-up hang of a silent program is named by status and launch --wait after the stall timeout."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    code = tmp_path / "code"
    code.mkdir()
    (code / "startup.py").write_text(STARTUP)
    hosts = local_hosts(tmp_path, job="startjob", train={"script": "startup.py", "code": str(code)}, procs=2)
    data = json.loads(hosts.read_text())
    data["job"]["stall_timeout"] = 3
    data["train"]["python"] = torch_python.python
    hosts.write_text(json.dumps(data))
    culprit = "here rank 1 is in <module> (startup.py:7); the 1 other rank waits in barrier (startup.py:5)"
    # (the launcher's zygote forks these workers: its hook is installed before the program runs)
    waiting = subprocess.Popen([sys.executable, "-m", "deploy", "--hosts", str(hosts), "launch", "--wait", "--timeout",
                                "120"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said: list[str] = []
    try:
        for line in waiting.stdout:  # until it names the stall (else until it ends, and the assert says why)
            said.append(line.rstrip("\n"))
            if line.startswith("stalled: "):
                break
        assert said[-1] == f"stalled: {culprit} (`ddp-deploy doctor` shows each rank)", said

        shown = json.loads(ddp(hosts, "status", "--json").stdout)[0]
        assert shown["state"] == "running" and shown["stalled"]["evidence"] == "heartbeats", shown
        assert shown["stall_diagnosis"] == culprit, shown
        assert {b["phase"] for b in shown["heartbeats"]} == {"run"}
        table = ddp(hosts, "status").stdout
        assert "stalled " in table and f"stalled: {culprit} (`ddp-deploy doctor` shows each rank)" in table, table
    finally:
        waiting.kill()
        waiting.communicate()
        assert ddp(hosts, "stop", "--now").exit_code == 0


# --- the judgment ----------------------------------------------------------------------------------

def _b(local: int, age: float, phase: str | None, step: int | None = None, gap: float | None = None) -> tuple:
    return local, step, local, gap, age, phase


def test_a_number_judges_a_rank_from_its_worker_s_start_and_auto_guesses_no_start_up():
    """A number judges each rank from its worker's start, and auto guesses nothing from a silent start-up."""
    starting = [_b(0, 40, "start"), _b(1, 40, "init")]
    assert verdict(30, starting) == (40, 30, None)  # no progress for 30 s from its start: stalled
    assert verdict("auto", starting) is None  # a start-up: its output judges it, as long as ever
    once = [_b(0, 400, "run"), _b(1, 400, "run")]  # formed, no interval shown yet (a long first step)
    assert verdict("auto", once) is None and verdict(None, once) is None
    shown = [_b(0, 400, "run", gap=2.0), _b(1, 1, "init")]
    assert verdict("auto", shown) == (1, contract.FLOOR_S, None)  # one rank still moves
    assert verdict("auto", [_b(0, 400, "run", gap=2.0)]) == (400, contract.FLOOR_S, None)
    # a program's own line (no phase) is judged as before; one that finished is not judged at all
    assert verdict("auto", [_b(0, 5, None, step=9, gap=0.5)]) == (5, contract.FLOOR_S, None)
    assert verdict(30, [_b(0, 900, "done"), _b(1, 900, "ended")]) is None


def test_a_rank_ending_while_others_wait_on_it_is_named_as_the_hang_in_any_setting():
    """A rank that ended while the others wait on it is a hang, and it is named by it under any setting."""
    for setting in ("auto", 300):
        assert verdict(setting, [_b(0, 12, "init"), _b(1, 11, "left")]) == (11, contract.LEFT_S, "rank 1")
        assert verdict(setting, [_b(0, 12, "run"), _b(1, 11, "ended")]) == (11, contract.LEFT_S, "rank 1")
    assert verdict("auto", [_b(0, 12, "init"), _b(1, 3, "left")]) is None  # not yet: it may be the job's end
    # a peer past its first collective, or one not yet in init_process_group (a program without a
    # process group), is not waiting on it
    assert verdict("auto", [_b(0, 12, "run", gap=1.0), _b(1, 11, "ended")]) == (12, contract.FLOOR_S, None)
    assert verdict("auto", [_b(0, 12, "start"), _b(1, 11, "left")]) is None


def test_the_state_a_launcher_tells_the_jobs_view_is_its_ranks_verdict():
    """What ``jobs`` is told of a node: starting, running, stalled or ending, by the same judgment."""
    state = contract.state
    assert state("auto", []) == {"state": "starting", "step": None}  # no rank has beaten
    assert state("auto", [_b(0, 40, "start"), _b(1, 40, "init")])["state"] == "starting"
    assert state(30, [_b(0, 40, "start"), _b(1, 40, "init")])["state"] == "stalled"
    assert state("auto", [_b(0, 1, "run", step=7, gap=2.0), _b(1, 2, None, step=9, gap=0.5)]) == {
        "state": "running", "step": 9}
    assert state("auto", [_b(0, 400, "run", step=7, gap=2.0)]) == {"state": "stalled", "step": 7}
    assert state(None, [_b(0, 4000, "run", step=7, gap=2.0)])["state"] == "running"  # stall_timeout null: never
    assert state("auto", [_b(0, 12, "run"), _b(1, 11, "ended")])["state"] == "stalled"  # waits on an ended rank
    assert state("auto", [_b(0, 5, "done", step=20), _b(1, 5, "ended", step=20)]) == {
        "state": "ending", "step": 20}


def test_status_judges_a_hooked_node_as_its_watchdog_does():
    beats = (stall.Beat(0, None, 0, None, 40, "start"), stall.Beat(1, None, 1, None, 40, "init"))
    found = stall.judge("running", beats, 40, 30, now=1000.0)
    assert found is not None and found.evidence == "heartbeats" and (found.for_s, found.timeout_s) == (40, 30)
    assert stall.judge("running", beats, 40, "auto", now=1000.0) is None  # 40 s of start-up output silence
    left = stall.judge("running", (beats[1], stall.Beat(1, None, 1, None, 20, "left")), 20, "auto", now=1000.0)
    assert left is not None and left.left == "rank 1"


def test_the_hook_s_line_carries_its_phase_and_a_self_beating_program_keeps_its_step(tmp_path):
    """The hook's line is read with its phase, and a program that beats itself keeps its step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hook_under_test", Path(heartbeat.HOOK_DIR) / "ddp_deploy_progress.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    beats = hook._Beats(str(tmp_path / "0"), "3")
    beats.put("start", create=True)
    first = (tmp_path / "0").read_bytes().split(b"\n")[0].decode()
    assert parse_beat("0", "2", first) == (0, None, 3, None, 2.0, "start")
    assert parse_beat("0", "2", first.replace("start", "s;rm")) == (0, None, 3, None, 2.0, None)  # not a phase
    beats.progress()
    Heartbeat(str(tmp_path), 0, 3).beat(41)  # the program's own beat, in between
    beats.progress()
    beats.progress()  # a second collective in the same step: the step stays
    line = (tmp_path / "0").read_bytes().split(b"\n")[0].decode()
    local, step, rank, gap, _, phase = parse_beat("0", "0", line)
    assert (local, step, rank, phase) == (0, 41, 3, "run") and gap is not None
    beats.end()
    assert parse_beat("0", "0", (tmp_path / "0").read_bytes().split(b"\n")[0].decode())[5] == "ended"


def test_the_hook_chains_to_the_sitecustomize_it_hides_and_leaves_no_name_trainer(tmp_path):
    """The hook chains to the sitecustomize it hides, and leaves nothing under the name trainer."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE'] = 'ran'\n")
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("MINE = True\n")
    probe = ("import os, sys, trainer; print(os.environ.get('OTHER_SITE'), trainer.MINE, "
             "sorted(m for m in sys.modules if m.startswith('trainer')), 'ddp_deploy_progress' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": heartbeat.hooked_path(str(other)), contract.HEARTBEAT_DIR_ENV: str(tmp_path),
           "LOCAL_RANK": "0", "RANK": "0"}
    got = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert got.stdout.split() == ["ran", "True", "['trainer']", "True"], got.stdout + got.stderr
    assert parse_beat("0", "0", (tmp_path / "0").read_text().split("\n")[0])[5] == "left"  # no group formed in it


# One rank's process group (world size 1): its file after the group formed, then after one DDP
# forward, with no collective called by the program in between.
DDP_STEP = """\
import os
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
beat = lambda: open(os.path.join(os.environ["DDP_HEARTBEAT_DIR"], "0")).read().split()
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
print(beat())
model(torch.randn(2, 4)).sum().backward()
print(beat())
"""


@pytest.mark.e2e
def test_each_ddp_step_beats_the_rank_with_no_collective_of_the_program(tmp_path):
    env = {**os.environ, "PYTHONPATH": heartbeat.hooked_path(None), contract.HEARTBEAT_DIR_ENV: str(tmp_path),
           "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    got = subprocess.run([sys.executable, "-c", DDP_STEP], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    formed, stepped = [ast.literal_eval(line) for line in got.stdout.splitlines()[-2:]]
    assert formed == ["-", "0", "-", "run"], got.stdout + got.stderr  # the group formed: one beat, no interval yet
    assert stepped[0] == "-" and stepped[2].isdigit() and stepped[3] == "run", stepped  # the forward beat again


def test_a_child_forked_from_the_worker_that_exits_does_not_end_the_rank(tmp_path):
    # the child runs the worker's atexit handlers when it exits normally; the rank goes on
    probe = ("import os, sys\npid = os.fork()\nif pid == 0:\n    sys.exit(0)\nos.waitpid(pid, 0)\n"
             "print(open(os.path.join(os.environ['DDP_HEARTBEAT_DIR'], '0')).read().split()[3])")
    env = {**os.environ, "PYTHONPATH": heartbeat.hooked_path(None), contract.HEARTBEAT_DIR_ENV: str(tmp_path),
           "LOCAL_RANK": "0", "RANK": "0"}
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert got.stdout.split() == ["start"], got.stdout + got.stderr
