"""The same job on a real Slurm cluster (tests/cluster/slurmcluster.py: slurmctld on the bridge, a
slurmd per node's namespace), through ddp-deploy: hosts.yaml's slurm: instead of nodes:, node1's
sshd as the login node, the host runtime (this test's interpreter, as a shared venv would be).

The assertions read Slurm itself (squeue, scontrol) and the NAS, not the tool's word."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from deploy.engines.choose import api
from deploy.engines.handle import Outcome
from deploy.engines.slurmjob import SlurmJob
from hung_job import hanging_program

from .operator_cli import complete_checkpoint_steps, ddp, empty_nas, ok, records, start_ddp, wait_until

pytestmark = pytest.mark.cluster

PROCS, NODES = 2, 2
SAMPLES, BATCH = 3072, 16  # 48 steps an epoch on 2 nodes x 2 processes
STEPS_PER_EPOCH = SAMPLES // (NODES * PROCS * BATCH)
TRAIN = ["--dataset", "synthetic", "--synthetic-size", str(SAMPLES), "--batch-size", str(BATCH), "--epochs", "2",
         "--log-every", "2", "--ckpt-every", "8", "--eval-batch-size", "256"]


def _hosts(cluster, slurm, path: Path, train=TRAIN, job=None, program=None) -> Path:
    config = cluster.hosts_config(runtime="host", procs=PROCS, train_args=train)
    config.pop("nodes")
    config["job"] = {"name": "ddp-slurm", "runtime": "host", "max_restarts": 1, **(job or {})}
    if program is not None:
        config["train"].update(program)
    config["rendezvous"] = {"port": 29400, "join_timeout": 120}
    config["slurm"] = {"login": {"name": "login", "address": cluster.host(slurm.login).address},
                       "nodes": NODES, "procs_per_node": PROCS, "partition": slurm.partition, "time": "00:30:00"}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _queue(slurm) -> list[str]:
    """The jobs Slurm still holds (pending, running, completing): id and state."""
    return slurm.run(["squeue", "-h", "-o", "%i %T"]).stdout.split("\n")[:-1]


def _slurm_job(nas: Path) -> tuple[str, str]:
    job_id, run = (nas / "ckpt" / ".ddp-deploy" / "ddp-slurm" / "slurm-job").read_text().split()
    return job_id, run


def test_a_two_node_job_trains_to_completion_through_slurm(cluster, slurm, fresh_nas, tmp_path):
    hosts = _hosts(cluster, slurm, tmp_path / "hosts.yaml", train=[*TRAIN, "--epochs", "1"])  # nothing to stop
    checked = ok(ddp(cluster, hosts, "check")).stdout
    assert "partition" in checked and "all 5 checks passed" in checked
    ok(ddp(cluster, hosts, "deploy"))
    launched = ok(ddp(cluster, hosts, "launch", "--wait", "--timeout", "600", timeout=660)).stdout
    assert "COMPLETED" in launched
    job_id, run = _slurm_job(fresh_nas)
    assert f"as Slurm job {job_id}" in launched
    said = re.search(r"^first step after [0-9.]+ s \((node[12]): ", launched, re.M)
    assert said, launched[-3000:]  # seen while it ran, and kept with the run:
    assert said[0] in ok(ddp(cluster, hosts, "status", "--run", run)).stdout
    # without train.code, each node's task ran in its own working directory on the shared volume
    assert sorted(p.name for p in (fresh_nas / "ckpt" / "work").iterdir()) == ["node1", "node2"]
    state = slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout
    assert "JobState=COMPLETED" in state and "NodeList=node[1-2]" in state
    final = records(fresh_nas)[-1]
    assert final["kind"] == "final" and final["world_size"] == NODES * PROCS and final["run"] == run

    status = json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)
    assert (status["slurm_job"], status["state"]) == (job_id, "COMPLETED")
    assert {n["node"]: n["state"] for n in status["nodes"]} == {"node1": "exited(0)", "node2": "exited(0)"}
    logs = ok(ddp(cluster, hosts, "logs")).stdout
    for label in ("node1 rank0", "node1 rank1", "node2 rank2", "node2 rank3"):
        assert label in logs, logs[-3000:]
    only = ok(ddp(cluster, hosts, "logs", "--node", "node2", "--rank", "3", "--tail", "50")).stdout.splitlines()
    assert only and all(line.startswith("node2 rank3") for line in only)
    kept = json.loads(ok(ddp(cluster, hosts, "runs", "--json")).stdout)
    assert [(r["id"], r["outcome"]) for r in kept] == [(run, "exit 0")]
    # the same, as data, through the Python API the CLI is built on (deploy/engines/slurmjob.py)
    job = api(hosts)
    assert isinstance(job, SlurmJob)
    final = job.state()
    assert (final.job_id, final.run, final.state) == (job_id, run, "COMPLETED")
    assert job.verdict(final) == f"Slurm job {job_id} COMPLETED: all nodes finished with exit code 0"
    assert {n: s.state for n, s in job.states().items()} == {"node1": "exited(0)", "node2": "exited(0)"}
    lines = job.logs(nodes=("node2",), ranks=(3,), tail=50)
    assert lines and {(line.node, line.rank) for line in lines} == {("node2", 3)}
    assert [(r.id, r.outcome()) for r in job.runs()] == [(run, "exit 0")]
    checks = job.check()
    assert len(checks) == 5 and all(c.ok for c in checks), checks
    script = (fresh_nas / "ckpt" / ".ddp-deploy" / "ddp-slurm" / "runs" / run / "job.sbatch").read_text()
    assert script == re.sub(r"\bRUN_ID\b", run, ok(ddp(cluster, hosts, "export", "slurm")).stdout)
    # and as a notebook holds it: one connection to the login node, the run as a handle
    with api(hosts) as held:
        assert re.sub(r"\bRUN_ID\b", run, held.plan()) == script  # what launch submitted
        handle = held.run()
        assert handle.id == run and held.run(run).id == run
        assert handle.wait(timeout=120) == Outcome("finished", f"Slurm job {job_id} COMPLETED: all nodes finished "
                                                               "with exit code 0")
        assert {(line.node, line.rank) for line in handle.logs(nodes=("node2",), ranks=(3,), tail=50)} == {("node2", 3)}
    assert _queue(slurm) == []


# A loaded machine can let the 96-step job finish between its first checkpoint and the stop (as in
# test_faults.py): the stop then found nothing to stop, and the job runs again on an empty NAS.
STOP_ATTEMPTS = 3


def test_a_stopped_job_leaves_slurm_and_a_new_launch_resumes_from_its_checkpoint(cluster, slurm, fresh_nas, tmp_path):
    hosts = _hosts(cluster, slurm, tmp_path / "hosts.yaml")
    for attempt in range(1, STOP_ATTEMPTS + 1):
        waiting = start_ddp(cluster, hosts, "launch", "--wait", "--timeout", "600")
        try:
            wait_until(lambda: complete_checkpoint_steps(fresh_nas), 300, "a checkpoint", interval=1)
            job_id, first_run = _slurm_job(fresh_nas)
            state = json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)["state"]
            stopped = ok(ddp(cluster, hosts, "stop", timeout=300)).stdout
            _, waited = waiting.communicate(timeout=120)
        finally:
            if waiting.poll() is None:
                waiting.kill()
        if attempt == STOP_ATTEMPTS or "final" not in [r["kind"] for r in records(fresh_nas)]:
            break
        print(f"attempt {attempt}: Slurm job {job_id} finished before `stop` reached it; launching it again")
        assert _queue(slurm) == []
        empty_nas(fresh_nas)
    assert "RUNNING" in state
    assert f"stopped Slurm job {job_id}" in stopped
    # the `launch --wait` that watched it ends as a stop (exit 3), and status says what runs says
    assert waiting.returncode == 3, waited[-3000:]
    assert f"stopped: Slurm job {job_id}: the job was stopped by " in waited and "`ddp-deploy stop`" in waited, waited
    shown = {n["node"]: n["state"] for n in json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)["nodes"]}
    assert all(v.startswith("stopped (graceful") for v in shown.values()) and len(shown) == NODES, shown
    assert json.loads(ok(ddp(cluster, hosts, "runs", "--json")).stdout)[-1]["outcome"].startswith("stopped by ")
    assert "final" not in [r["kind"] for r in records(fresh_nas)], "stopped too late: the job had finished"
    assert _queue(slurm) == []
    saved = complete_checkpoint_steps(fresh_nas)[-1]
    assert saved < 2 * STEPS_PER_EPOCH
    ok(ddp(cluster, hosts, "launch", "--wait", "--timeout", "600", timeout=660))
    _, second_run = _slurm_job(fresh_nas)
    assert second_run != first_run
    later = [r for r in records(fresh_nas) if r.get("run") == second_run and r.get("kind") == "train"]
    assert later and min(r["step"] for r in later) > saved  # resumed after the checkpoint, not from step 0
    logs = ok(ddp(cluster, hosts, "logs", "--run", second_run)).stdout
    assert "resumed from" in logs


def test_a_job_slurm_requeues_starts_again_and_resumes_from_its_checkpoint(cluster, slurm, fresh_nas, tmp_path):
    hosts = _hosts(cluster, slurm, tmp_path / "hosts.yaml")
    ok(ddp(cluster, hosts, "launch"))
    wait_until(lambda: complete_checkpoint_steps(fresh_nas), 300, "a checkpoint", interval=1)
    job_id, run = _slurm_job(fresh_nas)
    slurm.run(["scontrol", "requeue", job_id], check=True)
    followed = ok(ddp(cluster, hosts, "status", "--follow", timeout=900)).stdout
    assert "COMPLETED" in followed
    state = slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout
    assert "Restarts=1" in state and "JobState=COMPLETED" in state
    out = (fresh_nas / "ckpt" / ".ddp-deploy" / "ddp-slurm" / "runs" / run / f"slurm-{job_id}.out").read_text()
    assert "start 1," in out and "start 2," in out
    logs = ok(ddp(cluster, hosts, "logs")).stdout
    assert "resumed from" in logs
    assert records(fresh_nas)[-1]["kind"] == "final"


STALL_TIMEOUT = 5
# node2's second process (global rank 3) sleeps before step 5's all-reduce; the 3 others wait in it
CULPRIT = "node2 rank 3 is in <module> (hangs.py:7); the 3 other ranks wait in all_reduce (hangs.py:8)"


def _hung(cluster, slurm, tmp_path: Path, on_stall: str) -> Path:
    code = tmp_path / "code"
    code.mkdir()
    (code / "hangs.py").write_text(hanging_program(rank=3, pause=0.2))
    hosts = _hosts(cluster, slurm, tmp_path / "hosts.yaml", program={"script": "hangs.py", "code": str(code)},
                   job={"stall_timeout": STALL_TIMEOUT, "on_stall": on_stall, "max_restarts": 0})
    ok(ddp(cluster, hosts, "deploy"))
    return hosts


def _no_heartbeats_left(slurm) -> None:
    left = [p.name for p in Path("/dev/shm").glob("ddp-heartbeat-slurm-*")]
    assert left == [], f"heartbeat directories left behind: {left}"


def test_a_hung_slurm_job_shows_every_node_stalled_and_doctor_names_the_rank(
        cluster, slurm, fresh_nas, tmp_path):
    hosts = _hung(cluster, slurm, tmp_path, "report")
    try:
        ok(ddp(cluster, hosts, "launch"))
        stalled = wait_until(lambda: (lambda s: s if s["nodes"] and all(n["stalled"] for n in s["nodes"]) else None)(
            json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)), 180, "every node stalled", interval=1)
        assert stalled["state"] == "RUNNING"
        for n in stalled["nodes"]:  # read on the node itself: every rank's heartbeat, stopped at step 4
            assert n["state"] == "running" and n["stalled"]["last_step"] == 4, n
            assert {b["step"] for b in n["heartbeats"]} == {4} and len(n["heartbeats"]) == PROCS, n
        table = ok(ddp(cluster, hosts, "status")).stdout
        assert table.count("stalled ") == NODES and table.count("last step 4 since") == NODES, table
        assert f"stalled: {CULPRIT} (`ddp-deploy doctor` shows each rank)" in table, table  # status names it itself
        assert json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)["stall_diagnosis"] == CULPRIT

        found = ok(ddp(cluster, hosts, "doctor")).stdout.splitlines()
        assert found[0] == CULPRIT, found
        data = json.loads(ok(ddp(cluster, hosts, "doctor", "--json")).stdout)
        assert data["culprits"] == ["node2 rank 3"] and data["silent"] == {}
        assert sorted(r["rank"] for r in data["ranks"]) == list(range(NODES * PROCS))

        # each node's launcher kept the stall with the run, with the stacks its ranks were in then
        _, run = _slurm_job(fresh_nas)
        kept = wait_until(lambda: (lambda st: st if st and len(st[0]["nodes"]) == NODES else None)(json.loads(ok(ddp(
            cluster, hosts, "status", "--run", run, "--json")).stdout)["stalls"]), 60, "the stall kept by every node")
        assert [(st["action"], st["diagnosis"]) for st in kept] == [("report", CULPRIT)], kept
    finally:
        ok(ddp(cluster, hosts, "stop", "--now", timeout=300))
    assert _queue(slurm) == []
    _no_heartbeats_left(slurm)


def test_on_stall_stop_under_slurm_ends_every_node_and_launch_wait_names_the_culprit(
        cluster, slurm, fresh_nas, tmp_path):
    hosts = _hung(cluster, slurm, tmp_path, "stop")
    try:
        ended = ddp(cluster, hosts, "launch", "--wait", "--timeout", "300", timeout=360)
        assert ended.returncode == 1, ended.stdout[-3000:] + ended.stderr[-3000:]
        assert f"the job stalled and was stopped on node1, node2 (job.on_stall: stop): {CULPRIT}" in ended.stderr, \
            ended.stderr[-3000:]
        assert _queue(slurm) == []  # each node's launcher ended its part: nothing holds the allocation
        status = json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)
        assert {n["node"]: n["state"] for n in status["nodes"]} == {"node1": "stopped (stalled)",
                                                                    "node2": "stopped (stalled)"}
        kept = json.loads(ok(ddp(cluster, hosts, "runs", "--json")).stdout)[-1]
        assert kept["outcome"] == "stalled, stopped on node1, node2 (job.on_stall: stop)", kept
    finally:
        ddp(cluster, hosts, "stop", "--now", timeout=300)
    _no_heartbeats_left(slurm)
