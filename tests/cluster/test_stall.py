"""A hung job on the real cluster (3 nodes x 2 processes in Docker): one rank stops taking part
and the others wait in their all-reduce. `status` must call every node stalled at the step where
it stopped, in every status asked once job.stall_timeout has passed since the last beat, and `doctor` must name the sleeping rank. With
job.on_stall: restart, the built-in trainer hung by a stopped rank resumes and ends bit-identical;
its heartbeats reach `status` from inside its containers (their /dev/shm is the node's: --ipc host)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from hung_job import hanging_program
from local_job import beats_dir
from agent import heartbeat
from trainer_helpers import final_weights

from .operator_cli import complete_checkpoint_steps, ddp, empty_nas, ok, records, start_ddp, wait_until

pytestmark = pytest.mark.cluster

STALL_TIMEOUT = 5
STATUS_EVERY = 2
"""Seconds between two `status` asked while waiting: each is an operator process and an SSH round to
every node, over a second of a core here, taken from the job the test waits on. Asked every 0.5 s
they kept a core busy for the whole wait."""


def _states(cluster, hosts: Path) -> list[dict]:
    return json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)


def _stepping(states: list[dict]) -> list[dict] | None:
    """``states`` where both ranks of every node beat with a step: the job is training (a heartbeat
    alone is written when a worker starts, before its process group forms)."""
    return states if all(len(n["heartbeats"]) == 2 and all(b["step"] is not None for b in n["heartbeats"])
                         for n in states) else None


def _deployed_hang(cluster, tmp_path: Path, *, stall_timeout: float = STALL_TIMEOUT, on_stall: str | None = None,
                   max_restarts: int = 0, ssh: dict | None = None, **hang) -> Path:
    """hangs.py (tests/hung_job.py: ``hanging_program(**hang)``) as the train.code of a docker job of
    2 nodes x 2 processes, deployed; its hosts.yaml."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "hangs.py").write_text(hanging_program(**hang))
    job = {"stall_timeout": stall_timeout, "max_restarts": max_restarts, **({"on_stall": on_stall} if on_stall else {})}
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", procs=2, interface="eth0",
                                     train={"script": "hangs.py", "code": str(code)}, job=job,
                                     **({"ssh": ssh} if ssh else {}))
    ok(ddp(cluster, hosts, "deploy"))
    return hosts


def test_a_rank_sleeping_before_a_collective_shows_every_node_stalled_in_time(
        cluster, fresh_nas, tmp_path, record_fault):
    # node2's second process; 2 s a step: `status` (every 2 s, each slower under load) sees every
    # rank step before the stall, 4 steps and the 5 s timeout later
    hosts = _deployed_hang(cluster, tmp_path, rank=3, pause=2.0)
    try:
        ok(ddp(cluster, hosts, "launch"))
        moving = wait_until(lambda: _stepping(_states(cluster, hosts)), 180, "every rank's step in status",
                            interval=STATUS_EVERY)
        assert all(n["state"] == "running" and n["stalled"] is None for n in moving)
        assert sorted(b["rank"] for n in moving for b in n["heartbeats"]) == list(range(6))

        stalled, seen = _shown_stalled(cluster, hosts, 120)
        for n in stalled:
            assert n["state"] == "running" and n["stalled"]["last_step"] == 4, n
            assert {b["step"] for b in n["heartbeats"]} == {4}  # every rank ended step 4; none went on
        detect = seen - max(n["stalled"]["since"] for n in stalled)  # since the last beat on any node
        table = ok(ddp(cluster, hosts, "status")).stdout
        assert table.count("stalled ") == 3 and table.count("last step 4 since") == 3
        # the fleet view, told by each node's launcher: the same stall at the same step
        listed = json.loads(ok(ddp(cluster, hosts, "jobs", "--json")).stdout)["jobs"]
        assert [(j["job"], j["state"], j["states"], j["step"]) for j in listed] == [
            ("ddp-test", "stalled", {h.name: "stalled" for h in cluster.hosts}, 4)], listed

        asked = time.monotonic()
        found = ok(ddp(cluster, hosts, "doctor")).stdout.splitlines()
        diagnosed = time.monotonic() - asked
        assert found[0] == "node2 rank 3 is in <module> (hangs.py:7); the 5 other ranks wait in all_reduce (hangs.py:8)", found
        data = json.loads(ok(ddp(cluster, hosts, "doctor", "--json")).stdout)
        assert data["culprits"] == ["node2 rank 3"] and data["gone"] == [] and data["silent"] == {}
        assert sorted(r["rank"] for r in data["ranks"]) == list(range(6))

        # each node's launcher kept the stall with the run, with the stacks its ranks were in then
        run = json.loads(ok(ddp(cluster, hosts, "runs", "--json")).stdout)[-1]["id"]
        kept = wait_until(lambda: (lambda st: st if st and len(st[0]["nodes"]) == 3 else None)(json.loads(ok(ddp(
            cluster, hosts, "status", "--run", run, "--json")).stdout)["stalls"]), 60, "the stall kept by every node")
        assert [(st["action"], st["diagnosis"]) for st in kept] == [("report", found[0])], kept
        shown = ok(ddp(cluster, hosts, "status", "--run", run)).stdout
        assert "on node1, node2, node3 (no step for " in shown and f"  why: {found[0]}" in shown, shown
    finally:
        ok(ddp(cluster, hosts, "stop", "--now"))
    for h in cluster.hosts:
        assert cluster.run_on(h.name, ["ls", "/dev/shm"]).stdout.count(f"ddp-heartbeat-docker-ddp-test@{h.name}") == 0
    record_fault(fault="one rank sleeps before a collective (a hang)", finished="no (stopped)",
                 redone_steps=None, ckpt_every=None, detect_s=round(detect, 1),
                 detect_what=f"the last heartbeat to `status` naming every node stalled at step 4 "
                             f"(stall_timeout {STALL_TIMEOUT} s); `doctor` named node2 rank 3 in {diagnosed:.1f} s",
                 left_running="nothing after stop --now", bit_identical="n/a")


# Each fault on rank 3 (node2's second process) before step 5's all-reduce: what it does there (line 7
# of the program) and what doctor must say first. The FIFO is on the shared volume, with no writer.
FAULTS = {
    "one rank spins in a Python loop": (
        "while True: pass",
        "node2 rank 3 is in <module> (hangs.py:7); the 5 other ranks wait in all_reduce (hangs.py:8)"),
    "one rank blocked reading a FIFO on the NAS": (
        'open("/ckpt/stuck.fifo").read()',
        "node2 rank 3 is in <module> (hangs.py:7); the 5 other ranks wait in all_reduce (hangs.py:8)"),
    "ranks in mismatched collectives (one in broadcast, the others in all_reduce)": (
        "dist.broadcast(t, 0)",
        "node2 rank 3 is in broadcast (hangs.py:7); the 5 other ranks wait in all_reduce (hangs.py:8)"),
}


def _all_stalled(cluster, hosts: Path, nodes=("node1", "node2", "node3")):
    states = _states(cluster, hosts)
    return states if all(n["stalled"] for n in states if n["node"] in nodes) else None


DUE_SLACK = 2
"""A status reads each heartbeat's age in whole seconds on the node, and a node is stalled once that
age is over the timeout: one asked up to about a second past the timeout may not show it yet."""


def _shown_stalled(cluster, hosts: Path, timeout: float, limit: float = STALL_TIMEOUT) -> tuple[list[dict], float]:
    """`status --json` asked every STATUS_EVERY s until it shows every node stalled: that answer,
    and when it came. The stall is shown in bounded time: every status asked more than
    job.stall_timeout after the last beat on any node shows it (the answer's ``since``), however
    long a status takes on a loaded machine (a bound on when it came would measure that instead)."""
    not_yet: list[float] = []

    def look():
        asked = time.time()
        states = _all_stalled(cluster, hosts)
        if states is None:
            not_yet.append(asked)
        return states
    stalled = wait_until(look, timeout, "every node stalled", interval=STATUS_EVERY)
    seen = time.time()
    due = max(n["stalled"]["since"] for n in stalled) + limit + DUE_SLACK
    late = [asked - due for asked in not_yet if asked > due]
    assert not late, f"a status asked {max(late) + limit + DUE_SLACK:.1f} s after the last beat did not show the stall"
    return stalled, seen


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_kind_of_hang_is_shown_stalled_in_time_and_doctor_names_its_rank(
        cluster, fresh_nas, tmp_path, record_fault, fault):
    line, culprit = FAULTS[fault]
    hosts = _deployed_hang(cluster, tmp_path, rank=3, pause=0.2, fault=line)
    os.mkfifo(fresh_nas / "ckpt" / "stuck.fifo")
    try:
        ok(ddp(cluster, hosts, "launch"))
        stalled, seen = _shown_stalled(cluster, hosts, 180)
        assert all(n["state"] == "running" and n["stalled"]["last_step"] == 4 for n in stalled), stalled
        detect = seen - max(n["stalled"]["since"] for n in stalled)
        asked = time.monotonic()
        found = ok(ddp(cluster, hosts, "doctor", "--json"))
        diagnosed = time.monotonic() - asked
        data = json.loads(found.stdout)
        assert data["summary"] == culprit and data["culprits"] == ["node2 rank 3"], data["summary"]
    finally:
        ok(ddp(cluster, hosts, "stop", "--now"))
    record_fault(fault=fault, finished="no (stopped)", redone_steps=None, ckpt_every=None, detect_s=round(detect, 1),
                 detect_what=f"the last heartbeat to `status` naming every node stalled at step 4 (stall_timeout "
                             f"{STALL_TIMEOUT} s); `doctor` named node2 rank 3 in {diagnosed:.1f} s",
                 left_running="nothing after stop --now", bit_identical="n/a")


SILENT_STALL_TIMEOUT = 10


# The tutorials' start-up hang, one rank short of the first collective: the group has formed and no
# collective has returned on any rank; nothing is printed. Rank 3 sleeps (line 5), the others wait
# in the barrier (line 6).
STARTUP_HANG = """\
import time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 3:
    time.sleep(3600)
dist.barrier()
"""


def test_a_silent_hang_mid_run_or_at_start_up_is_named_by_status_and_launch_wait(
        cluster, fresh_nas, tmp_path, record_fault):
    """No heartbeat, no output, no import of this bundle: the launcher's progress hook beats each rank
    on its collectives, and the stall is named (node, rank, frame) by `status` itself and by
    `launch --wait`, whether some steps trained or no collective ever returned."""
    hosts = _deployed_hang(cluster, tmp_path, rank=3, pause=0.2, own_beat=False, stall_timeout=SILENT_STALL_TIMEOUT)
    detect = _named_silent_stall(
        cluster, hosts, "node2 rank 3 is in <module> (hangs.py:7); the 5 other ranks wait in all_reduce (hangs.py:8)")
    record_fault(fault="a program with no heartbeat of its own: one rank sleeps before a collective", finished="no (stopped)",
                 redone_steps=None, ckpt_every=None, detect_s=detect,
                 detect_what=f"the last progress the hook beat to `status` naming node2 rank 3 (stall_timeout "
                             f"{SILENT_STALL_TIMEOUT} s); `launch --wait` named it too",
                 left_running="nothing after stop --now", bit_identical="n/a")
    (tmp_path / "code" / "hangs.py").write_text(STARTUP_HANG)  # launch syncs the new code
    detect = _named_silent_stall(
        cluster, hosts, "node2 rank 3 is in <module> (hangs.py:5); the 5 other ranks wait in barrier (hangs.py:6)")
    record_fault(fault="a program with no heartbeat of its own hung at start-up: one rank short of the first barrier",
                 finished="no (stopped)", redone_steps=None, ckpt_every=None, detect_s=detect,
                 detect_what=f"the process group formed to `status` naming node2 rank 3 (stall_timeout "
                             f"{SILENT_STALL_TIMEOUT} s); `launch --wait` named it too",
                 left_running="nothing after stop --now", bit_identical="n/a")


def _named_silent_stall(cluster, hosts: Path, culprit: str) -> float:
    """Launches the silent program with `launch --wait`; `status` shows every node stalled in bounded
    time with ``culprit`` named, and `launch --wait` names it; then `stop --now`. Returns the seconds
    from the last progress to the status that showed it."""
    waiting = start_ddp(cluster, hosts, "launch", "--wait", "--timeout", "300")
    try:
        stalled, seen = _shown_stalled(cluster, hosts, 240, SILENT_STALL_TIMEOUT)
        assert all(n["state"] == "running" and n["stalled"]["last_step"] is None for n in stalled), stalled
        assert all(n["stall_diagnosis"] == culprit for n in stalled), stalled
        assert sorted(b["rank"] for n in stalled for b in n["heartbeats"]) == list(range(6)), stalled
        assert {b["phase"] for n in stalled for b in n["heartbeats"]} == {"run"}, stalled
        last = max(n["stalled"]["since"] for n in stalled)
        table = ok(ddp(cluster, hosts, "status")).stdout
        assert f"stalled: {culprit} (`ddp-deploy doctor` shows each rank)" in table, table
        said = []
        for line in waiting.stdout:  # it has said it by now, or says it next
            said.append(line.rstrip("\n"))
            if line.startswith("stalled: "):
                break
        assert said[-1] == f"stalled: {culprit} (`ddp-deploy doctor` shows each rank)", said
    finally:
        waiting.kill()
        waiting.communicate()
        ok(ddp(cluster, hosts, "stop", "--now"))
    return round(seen - last, 1)


def test_a_node_whose_link_goes_down_is_named_and_the_others_shown_stalled(
        cluster, fresh_nas, tmp_path, record_fault):
    hosts = _deployed_hang(cluster, tmp_path, rank=-1, pause=0.2, ssh={"connect_timeout": 3})  # no rank hangs by itself
    try:
        ok(ddp(cluster, hosts, "launch"))
        wait_until(lambda: _stepping(_states(cluster, hosts)), 180, "every rank's step in status",
                   interval=STATUS_EVERY)
        cluster.take_link_down("node3")
        down = time.time()
        try:
            states = wait_until(lambda: _all_stalled(cluster, hosts, ("node1", "node2")), 120,
                                "node1 and node2 stalled", interval=STATUS_EVERY)
            seen = time.time()
            assert {n["node"]: n["state"] for n in states}["node3"] == "unreachable"
            found = json.loads(ok(ddp(cluster, hosts, "doctor", "--json")).stdout)
            assert list(found["silent"]) == ["node3"] and found["culprits"] == [], found
            assert found["summary"].startswith("all 4 ranks found are in all_reduce (hangs.py:8); node3 did not "
                                               "answer ("), found["summary"]
        finally:
            cluster.bring_link_up("node3")
    finally:
        ok(ddp(cluster, hosts, "stop", "--now"))
    record_fault(fault="a node's link down mid-training (a hang: no peer closes its connection)", finished="no (stopped)",
                 redone_steps=None, ckpt_every=None, detect_s=round(seen - down, 1),
                 detect_what=f"link down to `status` naming node3 unreachable and the others stalled (stall_timeout "
                             f"{STALL_TIMEOUT} s); `doctor`: node3 did not answer, the other ranks wait in all_reduce",
                 left_running="nothing after stop --now", bit_identical="n/a")


def test_a_rank_that_exits_0_early_is_named_as_the_cause_not_those_it_left(
        cluster, fresh_nas, tmp_path, record_fault):
    """With gloo the others do not wait for good: the leaver's connections close, their all-reduce
    fails, and the job ends; what must be named is the rank that left, not those it failed."""
    hosts = _deployed_hang(cluster, tmp_path, rank=3, pause=0.2, fault="raise SystemExit(0)")
    try:
        started = time.time()
        ended = ddp(cluster, hosts, "launch", "--wait", "--timeout", "300", timeout=400)
        took = time.time() - started
        assert ended.returncode == 1, ended.stdout[-3000:] + ended.stderr[-3000:]
        said = ended.stderr.strip().splitlines()[0]
        # the cause is the rank that left; the ranks it failed are named as what followed
        assert re.match(r"error: the job failed on node[123](, node[123])*: rank 3 on node2 exited 0 (at|before) "
                        r"[0-9_:-]+ while the others still trained; the others then lost their connection to it ",
                        said), said
        assert "stalled" not in ended.stdout
    finally:
        ok(ddp(cluster, hosts, "stop", "--now"))
    record_fault(fault="a rank exits 0 early while the others train (gloo: their all-reduce fails)",
                 finished="no (failed, the leaver named)", redone_steps=None, ckpt_every=None, detect_s=round(took, 1),
                 detect_what="`launch --wait` to its end naming rank 3 on node2 as the rank that left",
                 left_running="nothing", bit_identical="n/a")


def test_on_stall_stop_ends_every_node_names_the_culprit_and_nothing_restarts(
        cluster, fresh_nas, tmp_path, record_fault):
    # max_restarts 1: Docker's restart policy is on, and would start a container that failed
    hosts = _deployed_hang(cluster, tmp_path, rank=3, pause=0.2, on_stall="stop", max_restarts=1)
    try:
        waited = ddp(cluster, hosts, "launch", "--wait", "--timeout", "300", timeout=400)
        returned = time.time()
        assert waited.returncode == 1, waited.stdout[-3000:] + waited.stderr[-3000:]
        said = waited.stderr.strip().splitlines()[0]
        # (the others wait in all_reduce: each launcher reads its ranks' stacks before any kills its own)
        assert said.startswith("error: the job stalled and was stopped on node1, node2, node3 (job.on_stall: stop): "
                               "node2 rank 3 is in <module> (hangs.py:7); the "), waited.stderr
        states = _states(cluster, hosts)
        assert [(n["state"], n["restarts"]) for n in states] == [("stopped (stalled)", 0)] * 3, states
        run = json.loads(ok(ddp(cluster, hosts, "runs", "--json")).stdout)[-1]
        assert run["outcome"] == "stalled, stopped on node1, node2, node3 (job.on_stall: stop)", run
        (stall,) = json.loads(ok(ddp(cluster, hosts, "status", "--run", run["id"], "--json")).stdout)["stalls"]
        assert stall["action"] == "stop" and stall["culprits"] == ["node2 rank 3"], stall
        last_beat = min(r["time"] - r["quiet_s"] for r in stall["nodes"].values())
    finally:
        ok(ddp(cluster, hosts, "stop"))
    record_fault(fault="one rank sleeps before a collective, `job.on_stall: stop`", finished="no (stopped, as asked)",
                 redone_steps=None, ckpt_every=None, detect_s=round(returned - last_beat, 1),
                 detect_what=f"the last heartbeat to `launch --wait` naming node2 rank 3, every node stopped "
                             f"(stall_timeout {STALL_TIMEOUT} s)",
                 left_running="nothing: every launcher ended with 0, no container restarted", bit_identical="n/a")


# The restart test's own stall_timeout: its fault-free run must never be called stalled, and on a
# loaded 2-core machine (the whole suite beside it) a healthy rank can go 5 s without a step
# (the follow diagnosed a stall in the fault-free run); 15 s keeps the claim true there.
RESTART_STALL_TIMEOUT = 15
RESTART_TRAIN = ["--dataset", "synthetic", "--synthetic-size", "3072", "--batch-size", "16", "--epochs", "1",
                 "--log-every", "1", "--ckpt-every", "8", "--eval-batch-size", "256"]  # 32 steps: the stop lands
# past step 12, and the rank it stops holds every other one there until the restart


def test_on_stall_restart_resumes_a_hung_job_and_it_ends_bit_identical(
        cluster, fresh_nas, tmp_path, record_fault):
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", procs=2, interface="eth0",
                                     train_args=RESTART_TRAIN,
                                     job={"stall_timeout": RESTART_STALL_TIMEOUT, "on_stall": "restart", "max_restarts": 1})
    ok(ddp(cluster, hosts, "deploy"))
    # The run without a fault: a healthy run is never called stalled nor restarted, with a 15 s
    # stall_timeout. (Its 32 steps may be over before any status sees them: a fast machine trains
    # them before the test's first status comes.)
    ok(ddp(cluster, hosts, "launch"))
    followed = ok(ddp(cluster, hosts, "status", "--follow", timeout=600)).stdout
    assert "stalled" not in followed and "all nodes finished with exit code 0" in followed
    assert [r["kind"] for r in records(fresh_nas)].count("resumed") == 0 and records(fresh_nas)[-1]["kind"] == "final"
    reference = final_weights(fresh_nas / "ckpt")
    ok(ddp(cluster, hosts, "stop"))
    empty_nas(fresh_nas)
    try:
        ok(ddp(cluster, hosts, "launch"))
        wait_until(lambda: complete_checkpoint_steps(fresh_nas) and max(
            r["step"] for r in records(fresh_nas) if r["kind"] == "train") >= complete_checkpoint_steps(fresh_nas)[-1] + 4,
                   300, "training past a checkpoint", interval=0.2)
        # node2's second process, seen from the node (the container's processes are the node's too)
        beats = beats_dir(hosts, "node2")
        one = [heartbeat.ranked(beats)[1]]
        os.kill(one[0], signal.SIGSTOP)
        stopped = time.time()
        # Every rank's heartbeat reaches status from inside its container: the job hung by the stopped
        # rank shows them all for the stall_timeout (15 s) at least, whatever this machine's speed.
        states = _states(cluster, hosts)
        assert time.time() - stopped < RESTART_STALL_TIMEOUT, "status took longer than the stall_timeout"
        assert [n["state"] for n in states] == ["running"] * 3 and not any(n["stalled"] for n in states), states
        assert sorted(b["rank"] for n in states for b in n["heartbeats"]) == list(range(6)), states
        assert all(len(n["heartbeats"]) == 2 and all(b["gap_s"] is not None for b in n["heartbeats"]) for n in states)
        followed = ddp(cluster, hosts, "status", "--follow", timeout=600)
        assert followed.returncode == 0, followed.stdout[-3000:] + followed.stderr[-3000:]
    finally:
        ddp(cluster, hosts, "stop", "--now")
    resumed = [r for r in records(fresh_nas) if r["kind"] == "resumed" and r["time"] > stopped]
    assert resumed and resumed[0]["world_size"] == 6
    assert records(fresh_nas)[-1]["kind"] == "final"
    got = final_weights(fresh_nas / "ckpt")
    assert reference.keys() == got.keys() and all(torch.equal(reference[k], got[k]) for k in reference)
    log = ok(ddp(cluster, hosts, "logs", "--run", json.loads(ok(ddp(cluster, hosts, "runs", "--json")).stdout)[-1]["id"])).stdout
    assert re.search(r"^node2 +\| agent\.launch: stalled: no rank on this node moved for \d+ s \(last step \d+; "
                     rf"job\.stall_timeout {RESTART_STALL_TIMEOUT} s\): the stacks of its workers are kept with the run \(ddp-deploy status "
                     r"--run\); killing its 2 workers", log, re.M), log[-3000:]
    # kept with the run by each node's launcher, with the stacks it found before it acted
    run = json.loads(ok(ddp(cluster, hosts, "runs", "--json")).stdout)[-1]["id"]
    (stall,) = json.loads(ok(ddp(cluster, hosts, "status", "--run", run, "--json")).stdout)["stalls"]
    assert stall["action"] == "restart" and "node2" in stall["nodes"] and stall["culprits"] == ["node2 rank 3"], stall
    assert stall["diagnosis"].startswith("node2 rank 3 is stopped (SIGSTOP: state T)"), stall
    redone = max(r["step"] for r in records(fresh_nas) if r["kind"] == "train" and r["time"] <= stopped) - resumed[0]["step"]
    assert 0 <= redone <= 8
    record_fault(fault="one rank stopped (SIGSTOP), `job.on_stall: restart`", finished=True,
                 redone_steps=redone, ckpt_every=8, detect_s=round(resumed[0]["time"] - stopped, 1),
                 detect_what=f"SIGSTOP to the job resumed on all nodes (stall_timeout {RESTART_STALL_TIMEOUT} s)",
                 left_running="nothing (all exited 0)", bit_identical=True)
