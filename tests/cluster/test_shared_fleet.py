"""A fleet shared by two users, on the real cluster: two jobs of different names and users launched
at the same moment on the same 3 nodes both train; ``jobs`` lists both, each with the uid the
nodes' kernel gives its launchers; a third job asking for GPUs that a running job holds is refused
before anything starts, naming that job and its user.

The nodes have no GPUs, so the GPU job here is what a GPU job's launcher does on its node (a
``agent/holds.py`` hold of GPU indices, by the other user) and the third job's hosts.yaml declares
GPUs the nodes lack; the holds, how the nodes find them and the refusal are real. The other user
also plants silent claims (listening sockets that never answer) beside them, which neither launch
nor ``jobs`` waits on for more than one bounded read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agent import holds
from .netcluster import LIGHT_MODEL
from .operator_cli import REPO, ddp, ok, records, start_ddp, trainer_processes_on, wait_until

pytestmark = pytest.mark.cluster

TRAIN = ["--dataset", "synthetic", "--synthetic-size", "1536", "--batch-size", "32", "--epochs", "1000",
         *LIGHT_MODEL]  # until stopped

# Another user's claims on node1: listening, bound under the tool's names, never answering.
PLANT = f"""
import socket, sys, time
held = []
for key in ("{holds.JOB}", "{holds.gpu(0)}"):
    for i in range(40):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\\0{holds.PREFIX}%s/%016x" % (key, i))
        s.listen(1)
        held.append(s)
print("planted", flush=True)
time.sleep(3600)
"""


def _as(account, host, argv: list[str]) -> subprocess.Popen:
    """``argv`` as ``account`` in ``host``'s network namespace (where its abstract sockets live), in
    the background; its first line of output is read before this returns."""
    proc = subprocess.Popen(["ip", "netns", "exec", host.ns, "setpriv", f"--reuid={account.pw_uid}",
                             f"--regid={account.pw_gid}", "--init-groups", "--", *argv],
                            stdout=subprocess.PIPE, text=True, cwd="/")
    proc.first = proc.stdout.readline().strip()
    return proc


@pytest.fixture
def tenant_home(tenant):
    """The other user's own storage: a directory of its home, its alone."""
    home = Path(tempfile.mkdtemp(prefix="shared-fleet-", dir=tenant.pw_dir))
    for sub in ("", "data", "ckpt"):
        (home / sub).mkdir(exist_ok=True)
        os.chown(home / sub, tenant.pw_uid, tenant.pw_gid)
        os.chmod(home / sub, 0o700)
    yield home
    shutil.rmtree(home, ignore_errors=True)


def test_two_users_jobs_start_at_once_and_train_and_a_held_gpu_is_refused(cluster, fresh_nas, tenant, tenant_home,
                                                                          tmp_path, fleet_lock_path):
    ours = cluster.write_hosts_yaml(tmp_path / "ours.yaml", runtime="host", procs=1, train_args=TRAIN,
                                    interface="eth0", job={"name": "shared-ours"})
    theirs = cluster.write_hosts_yaml(
        tmp_path / "theirs.yaml", runtime="host", procs=1, train_args=TRAIN, interface="eth0",
        job={"name": "shared-theirs"}, ssh={"user": tenant.pw_name}, rendezvous={"port": 29410},
        storage={"data": {"host": str(tenant_home / "data"), "container": "/data"},
                 "checkpoints": {"host": str(tenant_home / "ckpt"), "container": "/ckpt"}})
    as_tenant = {"DDP_DEPLOY_LOCK_DIR": ""}  # its locks where a user's are: its own ~/.ddp-deploy
    node1, node2 = cluster.hosts[0], cluster.hosts[1]
    planted = _as(tenant, node1, [sys.executable, "-c", PLANT])
    gpu_job = None
    try:
        assert planted.first == "planted"
        ok(ddp(cluster, ours, "deploy"))
        ok(ddp(cluster, theirs, "deploy", env=as_tenant))
        launches = [start_ddp(cluster, ours, "launch"), start_ddp(cluster, theirs, "launch", env=as_tenant)]
        outputs = [p.communicate(timeout=300) for p in launches]
        assert [p.returncode for p in launches] == [0, 0], outputs
        for (out, _), job in zip(outputs, ("shared-ours", "shared-theirs")):
            assert re.search(rf"started {job} run \S+ on 3 nodes \(3 processes\)", out), out
        both_train = lambda: all(any(r.get("kind") == "train" for r in records(nas))  # noqa: E731
                                 for nas in (fresh_nas, tenant_home))
        wait_until(both_train, 300, "both jobs' first steps")

        # what a GPU job's launcher holds on node2, the other user's
        gpu_job = _as(tenant, node2, [sys.executable, str(REPO / "agent" / "holds.py"), "hold", "their-gpus",
                                      "0", "1"])
        assert gpu_job.first == "holding"

        # each job's launchers tell it is running once their ranks have shown a step's interval
        def running():
            seen = ok(ddp(cluster, ours, "jobs", "--json"))
            listed = {j["job"]: j for j in json.loads(seen.stdout)["jobs"]}
            return (seen, listed) if all(listed.get(j, {}).get("state") == "running"
                                         for j in ("shared-ours", "shared-theirs")) else None
        seen, listed = wait_until(running, 120, "both jobs running in the jobs view")
        assert sorted(listed) == ["shared-ours", "shared-theirs", "their-gpus"], listed
        assert listed["shared-ours"]["step"] >= 1 and listed["shared-theirs"]["step"] >= 1, listed
        assert listed["their-gpus"]["state"] == "not told"  # a hold alone tells no ranks' state
        every = {h.name: [] for h in cluster.hosts}
        assert (listed["shared-ours"]["uid"], listed["shared-ours"]["nodes"]) == (os.getuid(), every)
        assert (listed["shared-theirs"]["uid"], listed["shared-theirs"]["nodes"]) == (tenant.pw_uid, every)
        assert (listed["their-gpus"]["uid"], listed["their-gpus"]["nodes"]) == (tenant.pw_uid, {node2.name: [0, 1]})
        assert json.loads(seen.stdout)["unanswered"] == {}
        # both trained side by side; what follows needs only the GPU job's hold (and spares the CPU)
        stopped = [ddp(cluster, ours, "stop"), ddp(cluster, theirs, "stop", env=as_tenant)]
        assert [s.returncode for s in stopped] == [0, 0], [s.stderr for s in stopped]

        # a third job on GPU 0 of every node: node2's is held
        third = cluster.write_hosts_yaml(
            tmp_path / "third.yaml", runtime="host", procs=1, train_args=TRAIN, interface="eth0",
            job={"name": "shared-third"}, rendezvous={"port": 29420},
            nodes=[{"name": h.name, "address": h.address, "connection": "ssh", "gpus": 4, "procs": 1,
                    "interface": "eth0"} for h in cluster.hosts])
        refused = ddp(cluster, third, "launch")
        assert refused.returncode != 0 and "started" not in refused.stdout, refused.stdout
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith("error: launch refused, nothing started: "), refused.stderr
        assert re.search(rf"{node2.name} gpus free: GPU 0 is held by job 'their-gpus' of user '{tenant.pw_name}' "
                         rf"\(uid {tenant.pw_uid}, pid {gpu_job.pid}\) since ", line), line
        assert line.count("is held by") == 1, line  # node1's silent claims on GPU 0 hold nothing
        # the same job on GPU 2, which nobody holds: that check passes on every node
        other_gpu = cluster.write_hosts_yaml(
            tmp_path / "other-gpu.yaml", runtime="host", procs=1, train_args=TRAIN, interface="eth0",
            job={"name": "shared-third"}, rendezvous={"port": 29420},
            nodes=[{"name": h.name, "address": h.address, "connection": "ssh", "gpus": 4, "procs": 1,
                    "gpu_ids": [2], "interface": "eth0"} for h in cluster.hosts])
        checked = ddp(cluster, other_gpu, "check")
        assert checked.stdout.count("no other job holds GPUs 2") == 3, checked.stdout
        assert "is held by" not in checked.stdout + checked.stderr
        after = {j["job"] for j in json.loads(ok(ddp(cluster, ours, "jobs", "--json")).stdout)["jobs"]}
        assert after == {"their-gpus"}  # the third started nothing
    finally:
        for proc in (planted, gpu_job):
            if proc is not None:
                proc.kill()
                proc.wait()
        stopped = [ddp(cluster, ours, "stop"), ddp(cluster, theirs, "stop", env=as_tenant)]
    assert [s.returncode for s in stopped] == [0, 0], [s.stderr for s in stopped]
    assert ddp(cluster, ours, "jobs").stdout == "no job of this tool runs on the nodes that answered\n"
    for h in cluster.hosts:
        assert trainer_processes_on(cluster, h.name) == []
