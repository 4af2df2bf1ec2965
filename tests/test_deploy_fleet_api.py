"""The Python API the CLI is built on (deploy/engines/fleet/; Slurm's, slurmjob.py, is tested on the
cluster): a program launches, follows and stops a job without a shell, on the `local` connection with
the real trainer; what it gets back is data."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from deploy.cli import cli
from deploy.errors import InputError, RuntimeFailure
from deploy.engines.choose import api
from deploy.engines.fleet import Fleet, LogLine, Started
from deploy.engines.slurmjob import SlurmJob
from deploy.job import launchplan
from deploy.nodes.remote import command_line
from local_job import local_hosts

pytestmark = pytest.mark.e2e

TRAIN_ARGS = ["--dataset", "synthetic", "--epochs", "1", "--synthetic-size", "256", "--batch-size", "32",
              "--log-every", "1"]


def test_a_program_launches_follows_and_stops_a_job_and_gets_data_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    hosts = local_hosts(tmp_path, job="apitest", train={"args": TRAIN_ARGS}, procs=2, interface="lo")
    said, warned = [], []
    fleet = Fleet(hosts, say=said.append, warn=warned.append)
    readied = fleet.deploy()  # the shared directories made, the interpreter checked: each node's line
    assert list(readied) == ["here"] and "has trainer and torch" in readied["here"], readied
    assert (tmp_path / "nas" / "ckpt").is_dir() and (tmp_path / "nas" / "data").is_dir()
    assert any(line.startswith("directories ready: ") for line in said), said

    planned = fleet.plan()  # what `launch --dry-run` prints, and what the launch below runs
    dry = CliRunner().invoke(cli, ["--hosts", str(hosts), "launch", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    shown = [f"[here] {line}" for line in command_line(planned.commands()["here"]).split("\n")]
    assert dry.output.splitlines()[-len(shown):] == shown, dry.output
    assert [f"[all] {line}" for line in planned.lines()] == dry.output.splitlines()[:len(planned.lines())]

    started = fleet.launch()
    assert isinstance(started, Started) and started.nodes == ("here",) and started.procs == 2
    # what it ran on each node: the plan, with the run's id in place of RUN_ID
    assert {n: tuple(a.replace(started.run, launchplan.DRY_RUN) for a in argv)
            for n, argv in started.plan.commands().items()} == planned.commands()
    assert started.plan.run == started.run and planned.run == launchplan.DRY_RUN
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
    lines = fleet.logs()  # every line of the run, as data: the rank that wrote it and its text
    assert lines and all(isinstance(line, LogLine) and line.node == "here" for line in lines)
    assert {line.rank for line in lines} >= {0, 1}, {line.rank for line in lines}
    assert any(line.text.startswith("METRICS {") for line in lines if line.rank == 0)
    assert fleet.logs(tail=1) == lines[-1:]  # the newest line alone
    streamed = []
    assert fleet.logs(ranks=(1,), on_line=streamed.append) == [] and streamed  # as they come, none kept
    assert {line.rank for line in streamed} == {1}
    assert fleet.unlock() == {"here": "no lock"}  # launch released it
    (good,) = fleet.goodput().values()  # the run's share of wall time in training steps that count
    assert 0 < good.share < 1 and good.redone_steps == 0 and good.incidents == (), good
    by_run = fleet.metrics()  # the run's records, as the trainer wrote them into metrics.jsonl
    assert list(by_run) == [started.run] and by_run[started.run][-1]["kind"] == "final"
    assert fleet.metrics(runs=("no-such-run",)) == {}
    drew = fleet.plot(tmp_path / "metrics.png")
    assert drew.startswith(f"wrote {tmp_path / 'metrics.png'}: 1 run ({started.run} from ")
    assert (tmp_path / "metrics.png").read_bytes().startswith(b"\x89PNG")
    assert fleet.stop() == {"here": "cleared (had exited 0)"}  # each node's answer
    assert fleet.stop() == {"here": "absent"}  # idempotent
    assert fleet.states()["here"].state == "absent"
    (kept,) = fleet.runs()  # the run, as `runs` keeps it
    assert kept.id == started.run and kept.outcome() == "exit 0" and kept.nodes["here"].exits[-1][1] == 0
    found = fleet.doctor()  # no rank runs now, and the diagnosis says so
    assert found.ranks == () and "no rank of the job runs on any node" in found.summary, found.summary
    with pytest.raises(InputError, match="job apitest has a fixed size"):
        fleet.join("here")  # only an elastic job takes a node in
    with pytest.raises(InputError, match="follow=True needs on_line"):
        fleet.logs(follow=True)


def test_a_program_runs_the_preflight_checks_and_gets_each_one_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    hosts = local_hosts(tmp_path, job="apicheck", train={"args": TRAIN_ARGS}, procs=2)
    checks = Fleet(hosts).check()
    assert checks and all(c.node == "here" for c in checks)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert {"local", "torch", "program", "shared storage"} <= {c.name for c in checks}, [c.name for c in checks]


def test_each_api_refuses_the_other_engine_s_inventory_and_api_picks_the_right_one(tmp_path):
    slurm_hosts = tmp_path / "slurm.yaml"
    slurm_hosts.write_text("job: {name: demo, runtime: host}\n"
                           "slurm: {login: {name: login, address: 198.18.0.2}, nodes: 2}\n"
                           "storage: {data: {host: /nas/data, container: /data}, "
                           "checkpoints: {host: /nas/ckpt, container: /ckpt}}\n")
    with pytest.raises(InputError, match="a Slurm inventory; this API drives an SSH fleet") as refused:
        Fleet(slurm_hosts)
    assert "SlurmJob" in refused.value.hint
    fleet_hosts = local_hosts(tmp_path, job="apipick", train={"args": TRAIN_ARGS})
    with pytest.raises(InputError, match="an SSH fleet's inventory .nodes:.; this API drives a Slurm job"):
        SlurmJob(fleet_hosts)
    said = []
    picked = api(slurm_hosts, say=said.append)
    assert isinstance(picked, SlurmJob) and picked.inv.slurm.nodes == 2 and picked.say == said.append
    assert isinstance(api(fleet_hosts, without=()), Fleet)
