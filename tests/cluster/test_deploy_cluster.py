"""The deploy tool on the real cluster: 3 hosts with their own sshd and Docker daemon, a shared NAS.

Everything goes through the tool's CLI (as an operator would run it); the assertions look at
the hosts directly (their own Docker daemons, the NAS files) so the tool cannot vouch for itself.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from torch_ends import on_ends

from .netcluster import LIGHT_MODEL
from .operator_cli import containers_on, ddp, image_id_on, ok, records, trainer_processes_on

pytestmark = pytest.mark.cluster

TRAIN = ["--dataset", "synthetic", "--synthetic-size", "1536", "--batch-size", "32", "--epochs", "2",
         "--log-every", "2", "--eval-batch-size", "128", *LIGHT_MODEL]


def test_check_deploy_launch_status_logs_stop_in_docker_across_three_nodes(cluster, fresh_nas, tmp_path):
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", procs=2, train_args=TRAIN, interface="eth0")
    nodes = [h.name for h in cluster.hosts]
    for node in nodes:  # the deploy below ships to every node, whichever test deployed before this one
        cluster.run_on(node, ["docker", "image", "rm", "-f", "ddp-trainer:test"])

    ok(ddp(cluster, hosts, "check"))

    first = ok(ddp(cluster, hosts, "deploy"))
    built = subprocess.run(["docker", "-H", cluster.operator_docker_host, "image", "inspect", "--format",
                            "{{.Id}}", "ddp-trainer:test"], capture_output=True, text=True, check=True).stdout.strip()
    for node in nodes:
        assert f"{node}: shipped" in first.stdout
        assert image_id_on(cluster, node, "ddp-trainer:test") == built  # each daemon has the exact image

    again = ok(ddp(cluster, hosts, "deploy"))
    assert "shipped" not in again.stdout
    assert all(f"{node}: up to date" in again.stdout for node in nodes)

    ok(ddp(cluster, hosts, "launch", "--wait", "--timeout", "900", timeout=960))

    final = records(fresh_nas)[-1]
    assert final["kind"] == "final" and final["world_size"] == 6 and final["backend"] == "gloo"
    assert (fresh_nas / "ckpt" / "final_model.pt").exists()
    assert list((fresh_nas / "ckpt").glob("ckpt-*.pt.ok"))
    assert (fresh_nas / "data" / "synthetic" / "synthetic-1536.pt").exists()

    status = json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)
    assert {s["node"]: s["state"] for s in status} == {node: "exited(0)" for node in nodes}
    assert sum(s["ranks"] for s in status) == 6
    assert any(s["metrics"].startswith("METRICS ") for s in status)

    logs = ok(ddp(cluster, hosts, "logs")).stdout.splitlines()
    assert {line.split(" | ", 1)[0].split()[0] for line in logs} == set(nodes)
    assert {line.split(" | ", 1)[0].split()[-1] for line in logs} >= {f"rank{r}" for r in range(6)}
    said = [line for line in logs if "dataset synthetic" in line]
    assert sum("fetched" in line for line in said) == 1  # downloaded once for the whole cluster
    assert sum("found" in line for line in said) == 2

    cleared = ok(ddp(cluster, hosts, "stop")).stdout
    for node in nodes:
        assert f"{node}: cleared (had exited 0)" in cleared, cleared  # its end its own, not the stop's
        assert containers_on(cluster, node) == []

    # The containers are gone; the run stays on the NAS: its record, every node's log and exit code.
    kept = json.loads(ok(ddp(cluster, hosts, "runs", "--json")).stdout)[-1]
    assert kept["record"]["image"] == {"name": "ddp-trainer:test", "id": built}
    assert {n: [code for _, code in v["exits"]] for n, v in kept["nodes"].items()} == {node: [0] for node in nodes}
    assert kept["outcome"] == "exit 0" and kept["record"]["hosts_yaml"]["train"]["args"] == TRAIN
    again = ok(ddp(cluster, hosts, "logs", "--run", kept["id"])).stdout.splitlines()
    assert sorted(again) == sorted(logs)  # the container's launcher copied every line it printed
    on_nas = fresh_nas / "ckpt" / ".ddp-deploy" / "ddp-test" / "runs" / kept["id"]
    assert sorted(p.name for p in on_nas.iterdir()) == sorted([*nodes, "run.json"])


def test_a_model_split_into_two_stages_per_process_trains_to_the_end_on_three_nodes(cluster, fresh_nas, tmp_path):
    """job.stages: 2 (model parallelism inside each DDP process), pipelined in micro-batches; on
    CPU nodes the stages share the CPU, which is how the mechanics are checked here."""
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", procs=1, interface="eth0",
                                     train_args=[*TRAIN, "--epochs", "1", "--micro-batches", "2"],
                                     job={"stages": 2})
    ok(ddp(cluster, hosts, "deploy"))
    ok(ddp(cluster, hosts, "launch", "--wait", "--timeout", "600", timeout=660))
    said = records(fresh_nas)
    assert said[-1]["kind"] == "final" and said[-1]["world_size"] == 3
    logs = ok(ddp(cluster, hosts, "logs")).stdout
    split = [line for line in logs.splitlines() if "model lenet split: stages=2 on ['cpu', 'cpu']" in line]
    assert len(split) == 3 and all("micro_batches=2" in line for line in split), logs[-3000:]
    ok(ddp(cluster, hosts, "stop"))


@on_ends("oldest")
def test_the_same_job_runs_with_plain_torchrun_on_the_hosts(cluster, fresh_nas, tmp_path, torch_python):
    # No interface in the inventory: every hostname here resolves to loopback, so this run
    # completes only because launch detects the NIC holding each node's address. The nodes'
    # interpreter is the oldest end's venv: the host runtime on the newest torch (the tests' own
    # venv) runs in test_faults.py's host runtime test and under Slurm (test_slurm.py).
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="host", procs=2, train_args=TRAIN,
                                     train={"python": torch_python.python})
    checked = ok(ddp(cluster, hosts, "check")).stdout
    assert checked.count(f"torch {torch_python.version}, ") == len(cluster.hosts)  # check names each node's torch
    ok(ddp(cluster, hosts, "deploy"))
    run = ddp(cluster, hosts, "launch", "--wait", "--timeout", "900", timeout=960)
    # where a node fails, every node's log says why (the status table alone does not)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-2000:], ddp(cluster, hosts, "logs", "--tail", "150").stdout)
    final = records(fresh_nas)[-1]
    assert final["kind"] == "final" and final["world_size"] == 6
    status = json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)
    assert all(s["state"] == "exited(0)" for s in status)
    ok(ddp(cluster, hosts, "stop"))
    for h in cluster.hosts:
        assert trainer_processes_on(cluster, h.name) == []


def test_dry_run_prints_every_node_s_command_and_starts_nothing(cluster, fresh_nas, tmp_path):
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", procs=2, train_args=TRAIN, interface="eth0")
    out = ok(ddp(cluster, hosts, "launch", "--dry-run")).stdout
    for h in cluster.hosts:
        assert f"--local-addr {h.address}" in out
    assert out.count("is_host=1") == 1
    for h in cluster.hosts:
        assert containers_on(cluster, h.name) == []


def test_launch_refuses_to_start_anywhere_when_a_node_is_unreachable(cluster, fresh_nas, tmp_path):
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", procs=2, train_args=TRAIN, interface="eth0",
                                     ssh={"connect_timeout": 3})
    cluster.take_link_down("node3")
    try:
        r = ddp(cluster, hosts, "launch", timeout=120)
    finally:
        cluster.bring_link_up("node3")
    assert r.returncode == 1 and "node3" in r.stderr
    for h in cluster.hosts[:2]:
        assert containers_on(cluster, h.name) == []
