"""A hung job on the real cluster (3 nodes x 2 processes in Docker): one rank stops taking part
and the others wait in their all-reduce. `status` must call every node stalled at the step where
it stopped, within job.stall_timeout + 15 s, `doctor` must name the sleeping rank, and the built-in trainer's own heartbeats reach
`status` from inside its containers (their /dev/shm is the node's: --ipc host)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .operator_cli import ddp, ok, records, wait_until

pytestmark = pytest.mark.cluster

STALL_TIMEOUT = 5

# Global rank 3 (node2's second process) sleeps before the all-reduce of step 5; the 5 others wait
# in it. Every rank writes the documented one-line heartbeat after each step.
HANGS = """\
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, t = dist.get_rank(), torch.zeros(1)
for step in range(1, 100000):
    if step == 5 and rank == 3:
        time.sleep(3600)
    dist.all_reduce(t)
    open(f"{os.environ['DDP_HEARTBEAT_DIR']}/{os.environ['LOCAL_RANK']}", "w").write(f"{step} {os.environ['RANK']}\\n")
    if rank == 0:
        print('METRICS {"kind": "train", "step": %d}' % step, flush=True)
    time.sleep(0.2)
"""


def _states(cluster, hosts: Path) -> list[dict]:
    return json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)


def test_a_rank_that_sleeps_before_a_collective_shows_every_node_stalled_at_its_step_in_bounded_time(
        cluster, fresh_nas, tmp_path, record_fault):
    code = tmp_path / "code"
    code.mkdir()
    (code / "hangs.py").write_text(HANGS)
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", procs=2, interface="eth0",
                                     train={"script": "hangs.py", "code": str(code)},
                                     job={"stall_timeout": STALL_TIMEOUT, "max_restarts": 0})
    ok(ddp(cluster, hosts, "deploy"))
    try:
        ok(ddp(cluster, hosts, "launch"))
        moving = wait_until(lambda: (lambda s: s if all(len(n["heartbeats"]) == 2 for n in s) else None)(
            _states(cluster, hosts)), 180, "every rank's heartbeat in status", interval=0.5)
        assert all(n["state"] == "running" and n["stalled"] is None for n in moving)
        assert sorted(b["rank"] for n in moving for b in n["heartbeats"]) == list(range(6))

        stalled = wait_until(lambda: (lambda s: s if all(n["stalled"] for n in s) else None)(
            _states(cluster, hosts)), 120, "every node stalled", interval=0.5)
        seen = time.time()
        for n in stalled:
            assert n["state"] == "running" and n["stalled"]["last_step"] == 4, n
            assert {b["step"] for b in n["heartbeats"]} == {4}  # every rank ended step 4; none went on
        since = max(n["stalled"]["since"] for n in stalled)  # the last beat on any node
        detect = seen - since
        assert detect <= STALL_TIMEOUT + 15, f"the stall was shown {detect:.1f} s after the last beat"
        table = ok(ddp(cluster, hosts, "status")).stdout
        assert table.count("stalled ") == 3 and table.count("last step 4 since") == 3

        asked = time.monotonic()
        found = ok(ddp(cluster, hosts, "doctor")).stdout.splitlines()
        diagnosed = time.monotonic() - asked
        assert found[0] == "node2 rank 3 is in <module> (hangs.py:7); the 5 other ranks wait in all_reduce (hangs.py:8)", found
        data = json.loads(ok(ddp(cluster, hosts, "doctor", "--json")).stdout)
        assert data["culprits"] == ["node2 rank 3"] and data["gone"] == [] and data["silent"] == {}
        assert sorted(r["rank"] for r in data["ranks"]) == list(range(6))
    finally:
        ok(ddp(cluster, hosts, "stop", "--now"))
    for h in cluster.hosts:
        assert cluster.run_on(h.name, ["ls", "/dev/shm"]).stdout.count(f"ddp-heartbeat-ddp-test@{h.name}") == 0
    record_fault(fault="one rank sleeps before a collective (a hang)", finished="no (stopped)",
                 redone_steps=None, ckpt_every=None, detect_s=round(detect, 1),
                 detect_what=f"the last heartbeat to `status` naming every node stalled at step 4 "
                             f"(stall_timeout {STALL_TIMEOUT} s); `doctor` named node2 rank 3 in {diagnosed:.1f} s",
                 left_running="nothing after stop --now", bit_identical="n/a")


def test_the_built_in_trainers_ranks_beat_from_inside_their_containers_and_a_healthy_run_is_never_stalled(
        cluster, fresh_nas, tmp_path):
    train = ["--dataset", "synthetic", "--synthetic-size", "1536", "--batch-size", "32", "--epochs", "2",
             "--log-every", "2", "--eval-batch-size", "128"]
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", procs=2, train_args=train,
                                     interface="eth0")
    ok(ddp(cluster, hosts, "deploy"))
    try:
        ok(ddp(cluster, hosts, "launch"))
        seen = []

        def beating():
            states = _states(cluster, hosts)
            seen.append(states)
            return states if all(len(n["heartbeats"]) == 2 for n in states) else None
        states = wait_until(beating, 180, "every rank's heartbeat", interval=0.5)
        assert sorted(b["rank"] for n in states for b in n["heartbeats"]) == list(range(6))
        assert all(b["gap_s"] is not None for n in states for b in n["heartbeats"])
        followed = ok(ddp(cluster, hosts, "status", "--follow", timeout=600)).stdout
        assert "stalled" not in followed and "all nodes finished with exit code 0" in followed
        assert not any(n["stalled"] for states in seen for n in states)
        assert records(fresh_nas)[-1]["kind"] == "final"
    finally:
        ok(ddp(cluster, hosts, "stop"))
