"""The Python API the CLI is built on (deploy/engines/fleet/; Slurm's, slurmjob.py, is tested on the
cluster): a program launches, follows and stops a job without a shell, on the `local` connection with
the real trainer; what it gets back is data."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from deploy.errors import InputError, JobStopped, LostContact, RuntimeFailure, StillRunning
from deploy.engines.choose import api
from deploy.engines.fleet import Fleet, LogLine, Started
from deploy.engines.handle import Outcome, Run
from deploy.engines.slurmjob import SlurmJob
from deploy.job import launchplan
from deploy.nodes.remote import Remote
from fakes import free_port
from local_job import local_hosts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--synthetic-size", "256", "--batch-size", "32", "--epochs", "1"]
TRAIN_ARGS = ["--dataset", "synthetic", "--epochs", "1", "--synthetic-size", "256", "--batch-size", "32",
              "--log-every", "1"]


def test_a_program_launches_follows_and_stops_a_job_and_gets_data_back(ddp, tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    hosts = local_hosts(tmp_path, job="apitest", train={"args": TRAIN_ARGS}, procs=2, interface="lo")
    said, warned = [], []
    fleet = Fleet(hosts, say=said.append, warn=warned.append)
    readied = fleet.deploy()  # the shared directories made, the interpreter checked: each node's line
    assert list(readied) == ["here"] and "has the node agent and torch" in readied["here"], readied
    assert (tmp_path / "nas" / "ckpt").is_dir() and (tmp_path / "nas" / "data").is_dir()
    assert any(line.startswith("directories ready: ") for line in said), said

    planned = fleet.plan()  # what `launch --dry-run` prints, and what the launch below runs
    dry = ddp(hosts, "launch", "--dry-run")
    assert dry.exit_code == 0 and dry.output == f"{planned}\n", dry.output
    assert planned.commands()["here"][:2] == ("sh", "-c") and "[here] sh -c " in dry.output

    run = fleet.launch()
    started = run.started
    assert isinstance(started, Started) and started.nodes == ("here",) and started.procs == 2
    assert run.id == started.run
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
    # a stop that came after the end cleared the run: what it ended with is still the run's kept end
    assert fleet.verdict(fleet.states()) == "all nodes finished with exit code 0"
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


def _docs_example() -> str:
    """The program of docs/fleet.md's "From a program", as it is printed there."""
    text = (REPO / "docs" / "fleet.md").read_text()
    section = text[text.index("**From a program**"):]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_program_runs_the_shipped_inventory_s_job_to_its_end(tmp_path, monkeypatch, capsys):
    """docs/fleet.md's example, run as it is printed, on the shipped hosts.yaml. What this machine
    changes in it: where the shared volume is (the test's own), the interpreter (this one), a free
    rendezvous port, and a smaller dataset than the shipped job's two epochs of 8192 samples."""
    shipped = yaml.safe_load((REPO / "hosts.yaml").read_text())
    shipped["storage"] = {"data": {"host": str(tmp_path / "nas/data"), "container": "/data"},
                          "checkpoints": {"host": str(tmp_path / "nas/ckpt"), "container": "/ckpt"},
                          "min_free_gb": 0.01}
    shipped["rendezvous"]["port"] = free_port()
    shipped["train"].update(python=sys.executable, args=[*shipped["train"]["args"], *SMALL])
    (tmp_path / "hosts.yaml").write_text(yaml.safe_dump(shipped))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    exec(compile(_docs_example(), "docs/fleet.md", "exec"), {})
    out = capsys.readouterr().out
    assert "finished all nodes finished with exit code 0" in out, out
    assert "[local] " in out and "[all] program: the built-in trainer" in out, out  # the plan, printed
    assert re.search(r"^local 0 ", out, re.M), out  # rank 0's last lines
    assert re.search(r"\[\('\S+', 'exit 0'\)\]", out), out
    assert api(tmp_path / "hosts.yaml").states()["local"].state == "absent"  # the example's stop cleared it


def test_a_job_in_with_keeps_one_connection_and_a_run_s_log_iterator_can_be_left(tmp_path, monkeypatch):
    """In ``with``, every call goes through one Remote, opened once; a program that stops reading
    a run's log lines half-way leaves no reader behind."""
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    hosts = local_hosts(tmp_path, job="apikept", train={"args": TRAIN_ARGS}, procs=1)
    opened = []
    real = Remote.__init__
    monkeypatch.setattr(Remote, "__init__", lambda self, *a, **k: (opened.append(threading.current_thread().name),
                                                                    real(self, *a, **k))[1])
    with api(hosts) as job:
        job.deploy()
        run = job.launch()
        assert run.wait(timeout=240).state == "finished"
        assert job.run().id == run.id and job.run(run.id).id == run.id
        with pytest.raises(RuntimeFailure, match="has no kept run nope"):
            job.run("nope")
        first = next(iter(run.logs()))
        assert first.node == "here"
        reading = run.logs()
        next(reading)
        reading.close()  # left after one line: its reader thread ends
        run.stop()
    # the block's alone; a thread opens its own: each log reader, the heartbeat of a held lock
    assert opened.count("MainThread") == 1, opened
    assert sorted(set(opened)) == ["MainThread", "fleet-lock-heartbeat", f"logs-{run.id}"], opened
    deadline = time.monotonic() + 10
    while any(t.name.startswith("logs-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("logs-")]


@pytest.mark.parametrize("raised, state", [
    (StillRunning("still in Slurm after 60 s: job 7 RUNNING"), "running"),  # Slurm's wait past its time
    (StillRunning("still running after 60 s"), "running"),
    (LostContact("lost contact with node2 while the job ran"), "lost"),
    (JobStopped("the job was stopped by alice"), "stopped"),
    (RuntimeFailure("the job failed on node1: rank 0 exited with 1"), "failed")])
def test_a_run_s_end_is_told_by_the_kind_of_end_its_engine_raised(raised, state):
    class Job:
        def wait(self, timeout=None):
            raise raised

    assert Run(Job(), "r1").wait(timeout=60) == Outcome(state, str(raised))
