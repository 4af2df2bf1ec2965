"""The Python API the CLI is built on (deploy/engines/fleet.py): a program launches, follows and stops a
job without a shell, on the `local` connection with the real trainer; what it gets back is data."""

from __future__ import annotations

import pytest

from deploy.errors import InputError, RuntimeFailure
from deploy.engines.fleet import Fleet, Started
from local_job import local_hosts

pytestmark = pytest.mark.e2e

TRAIN_ARGS = ["--dataset", "synthetic", "--epochs", "1", "--synthetic-size", "256", "--batch-size", "32",
              "--log-every", "1"]


def test_a_program_launches_follows_and_stops_a_job_and_gets_data_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    hosts = local_hosts(tmp_path, job="apitest", train={"args": TRAIN_ARGS}, procs=2)
    said, warned = [], []
    fleet = Fleet(hosts, say=said.append, warn=warned.append)
    (tmp_path / "nas" / "ckpt").mkdir(parents=True, exist_ok=True)
    (tmp_path / "nas" / "data").mkdir(parents=True, exist_ok=True)

    started = fleet.launch()
    assert isinstance(started, Started) and started.nodes == ("here",) and started.procs == 2
    assert started.describe().startswith(f"started apitest run {started.run} on 1 nodes (2 processes): ")
    assert list(started.phases) == ["lock", "states", "code", "checks", "image", "record", "start"]
    with pytest.raises(RuntimeFailure, match="a previous run of apitest is still running on here"):
        fleet.launch()  # one run at a time, refused as the CLI refuses it

    polls = []
    final = fleet.wait(timeout=240, show=polls.append)
    assert final["here"].state == "exited(0)" and polls and polls[-1] == final
    assert final["here"].metrics.startswith("METRICS {")
    assert fleet.verdict(final) == "all nodes finished with exit code 0"
    assert fleet.states()["here"].state == "exited(0)"
    assert fleet.stop() == {"here": "cleared (had exited 0)"}  # each node's answer
    assert fleet.stop() == {"here": "absent"}  # idempotent
    assert fleet.states()["here"].state == "absent"
    (kept,) = fleet.runs()  # the run, as `runs` keeps it
    assert kept.id == started.run and kept.outcome() == "exit 0" and kept.nodes["here"].exits[-1][1] == 0
    found = fleet.doctor()  # no rank runs now, and the diagnosis says so
    assert found.ranks == () and "no rank of the job runs on any node" in found.summary, found.summary


def test_a_program_runs_the_preflight_checks_and_gets_each_one_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    hosts = local_hosts(tmp_path, job="apicheck", train={"args": TRAIN_ARGS}, procs=2)
    checks = Fleet(hosts).check()
    assert checks and all(c.node == "here" for c in checks)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert {"local", "torch", "program", "shared storage"} <= {c.name for c in checks}, [c.name for c in checks]


def test_the_api_refuses_a_slurm_inventory_naming_the_cli(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("job: {name: demo, runtime: host}\n"
                     "slurm: {login: {name: login, address: 198.18.0.2}, nodes: 2}\n"
                     "storage: {data: {host: /nas/data, container: /data}, "
                     "checkpoints: {host: /nas/ckpt, container: /ckpt}}\n")
    with pytest.raises(InputError, match="a Slurm inventory; this API drives an SSH fleet"):
        Fleet(hosts)
