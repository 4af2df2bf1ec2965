"""One operator at a time per job, on the real cluster: two `ddp-deploy launch` of one job started
at the same moment against the same 3 nodes. Exactly one starts the job; the other is refused with
one line naming the holder, and starts nothing. The nodes hold the job's lock (deploy/job/lock.py)
over SSH; here they share the test's own root of the locks (tests/conftest.py), as nodes sharing a
home directory do, so they share one lock.
"""

from __future__ import annotations

import getpass
import re
import socket
import time

import pytest

from .operator_cli import ddp, node_states, ok, start_ddp, trainer_processes_on

pytestmark = pytest.mark.cluster

TRAIN = ["--dataset", "synthetic", "--synthetic-size", "1536", "--batch-size", "32", "--epochs", "1000"]  # until stopped


def test_two_launches_at_once_one_starts_the_job_the_other_is_refused_naming_it(cluster, fresh_nas,
                                                                                           tmp_path, fleet_lock_path,
                                                                                           record_fault):
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="host", procs=1, train_args=TRAIN, interface="eth0")
    job_lock = fleet_lock_path / "job-ddp-test"
    ok(ddp(cluster, hosts, "deploy"))
    assert not job_lock.exists()  # deploy let it go

    launches = [start_ddp(cluster, hosts, "launch") for _ in range(2)]
    began, ended = time.monotonic(), {}
    try:
        while len(ended) < 2 and time.monotonic() - began < 300:
            ended.update({i: time.monotonic() - began for i, p in enumerate(launches)
                          if i not in ended and p.poll() is not None})
            time.sleep(0.05)
        outputs = [p.communicate(timeout=30) for p in launches]
        codes = [p.returncode for p in launches]
        assert sorted(codes) == [0, 1], outputs
        winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
        assert re.search(r"started ddp-test run [0-9]{8}-[0-9]{6}-[0-9a-f]{4} on 3 nodes \(3 processes\)", outputs[winner][0])
        refusal = outputs[loser][1].strip().splitlines()
        assert len(refusal) == 1, refusal
        who = f"{getpass.getuser()}@{socket.gethostname()} (pid {launches[winner].pid})"
        # the nodes here share one root of the locks, so every node shows the same lock: any may be named
        assert re.match(rf"error: launch refused, nothing started: node[123] is locked by launch of job "
                        rf"ddp-test by {re.escape(who)}, started ", refusal[0]), refusal
        assert refusal[0].rstrip().endswith("if that command no longer runs: `ddp-deploy unlock --force`)")
        assert "started" not in outputs[loser][0]
        assert not job_lock.exists()  # released once the job had started
        assert node_states(cluster, hosts) == {h.name: "running" for h in cluster.hosts}
    finally:
        for p in launches:
            if p.poll() is None:
                p.kill()
                p.communicate()
        ok(ddp(cluster, hosts, "stop"))
    for h in cluster.hosts:
        assert trainer_processes_on(cluster, h.name) == []
    record_fault(fault="two launches at the same moment (same fleet)", finished="one started, one refused",
                 redone_steps=None, ckpt_every=None, detect_s=round(ended[loser], 1),
                 detect_what="start to the refusal naming the holder", left_running="the winner's job alone",
                 bit_identical=None)
