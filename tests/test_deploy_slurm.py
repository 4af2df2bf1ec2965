"""The job on Slurm as data: hosts.yaml's slurm: section, the batch script, the task each node runs,
and what the login node's status script prints. The real cluster runs in tests/cluster/test_slurm.py."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

from deploy.observe import doctor
from deploy.job import plan
from deploy.job.runtime import CodeDir
from deploy.engines import slurm
from deploy.errors import InventoryError
from deploy.inventory import loads

BASE = {
    "job": {"name": "mnist", "runtime": "host"},
    "slurm": {"login": {"address": "10.0.0.5"}, "nodes": 2, "procs_per_node": 2, "partition": "debug",
              "time": "01:00:00"},
    "storage": {"data": {"host": "/nas/data", "container": "/data"},
                "checkpoints": {"host": "/nas/ckpt", "container": "/ckpt"}},
    "train": {"python": "/nas/venv/bin/python", "args": ["--dataset", "synthetic", "--epochs", "1"]},
}


def inventory(**sections):
    data = {**BASE, **sections}
    return loads(yaml.safe_dump(data))


def problems(**sections) -> str:
    with pytest.raises(InventoryError) as e:
        inventory(**sections)
    return str(e.value)


def test_slurm_section_replaces_nodes_and_the_rendezvous_node():
    inv = inventory()
    assert inv.nodes == () and inv.slurm.nodes == 2 and inv.shape == (2, 2, 0)
    assert "not both" in problems(nodes=[{"name": "a", "address": "10.0.0.1"}])
    assert "first node hosts" in problems(rendezvous={"node": "a"})


def test_docker_on_slurm_needs_the_sites_container_runtime():
    assert "slurm.container" in problems(job={"name": "mnist", "runtime": "docker"})
    inv = inventory(job={"name": "mnist", "runtime": "docker"},
                    slurm={**BASE["slurm"], "container": {"kind": "pyxis", "image": "registry.example/ddp:1"}})
    assert inv.slurm.container.kind == "pyxis"


def test_bad_slurm_values_name_their_field():
    assert "slurm.time" in problems(slurm={**BASE["slurm"], "time": "an hour"})
    assert "slurm.sbatch_args[0]" in problems(slurm={**BASE["slurm"], "sbatch_args": ["-w node1"]})
    assert "slurm.procs_per_node" in problems(slurm={**BASE["slurm"], "gpus_per_node": 1, "procs_per_node": 2})
    assert "job.min_nodes" in problems(job={"name": "mnist", "runtime": "host", "min_nodes": 1})


def test_a_fleet_without_nodes_or_rendezvous_node_is_refused_by_name():
    fleet = {k: v for k, v in BASE.items() if k != "slurm"}
    with pytest.raises(InventoryError, match="nodes"):
        loads(yaml.safe_dump(fleet))
    with pytest.raises(InventoryError, match="rendezvous.node"):
        loads(yaml.safe_dump({**fleet, "nodes": [{"name": "a", "address": "10.0.0.1"}]}))


def test_batch_script_asks_slurm_for_the_shape_and_keeps_output_with_the_run():
    inv = inventory(slurm={**BASE["slurm"], "account": "ml", "gpus_per_node": 4, "procs_per_node": 4,
                           "sbatch_args": ["--constraint=a100"]})
    script = slurm.batch_script(inv, "20261123-120000-abcd")
    heads = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert heads == ["--job-name=mnist", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4",
                     "--partition=debug", "--account=ml", "--time=01:00:00", "--signal=TERM@90", "--requeue",
                     "--open-mode=append",
                     "--output=/nas/ckpt/.ddp-deploy/mnist/runs/20261123-120000-abcd/slurm-%j.out",
                     "--constraint=a100"]
    assert "export DDP_DEVICE=cuda" in script and "--backend nccl" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_secret_values_never_reach_the_script(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t_value")
    inv = inventory(train={**BASE["train"], "secrets": {"HF_TOKEN": {"env": "HF_TOKEN"}}})
    script = slurm.batch_script(inv, "R")
    assert "hf_s3cr3t_value" not in script and "HF_TOKEN" in script


def _run_task(tmp_path, inv, node: str, node_id: int, env_extra=None) -> list[str]:
    """The per-node task of the batch script, run here with Slurm's variables set and a fake
    interpreter that prints what it got."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\nenv | grep -E '^(DDP_|GLOO_|NCCL_)' | sort\n"
                    "echo \"cwd $(pwd)\"\n")
    fake.chmod(0o755)
    argv = slurm.srun_argv(inv, "R1")
    task = argv[argv.index("sh"):]
    args = [str(tmp_path / "runs") if a == f"{inv.storage.checkpoints.host}/.ddp-deploy/mnist/runs/R1" else a
            for a in task]
    args = [str(fake) if a == inv.python_path() else str(tmp_path / "work") if a == "/nas/ckpt/work" else a
            for a in args]
    addrs, head = "node1=198.18.0.11 node2=198.18.0.12", "node1"
    args = [addrs if a == "$addrs" else head if a == "$head" else a for a in args]
    env = {"PATH": os.environ["PATH"], "SLURMD_NODENAME": node, "SLURM_NODEID": str(node_id), **(env_extra or {})}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_without_train_code_or_a_container_each_task_works_in_its_node_s_directory(tmp_path):
    """Without train.code or a container each task works in its node's own directory, as on a host fleet."""
    got = _run_task(tmp_path, inventory(), "node2", 1)
    assert got[-1] == f"cwd {tmp_path}/work/node2", got  # not where sbatch ran ($HOME on the login node)
    code = CodeDir("abc", "/nas/ckpt/.ddp-deploy/code/snapshots/abc")
    assert slurm.work_root(inventory(), code) == ""  # the launcher makes the same directory (agent/workdir.py)
    pyxis = inventory(job={"name": "mnist", "runtime": "docker"},
                      slurm={**BASE["slurm"], "container": {"kind": "pyxis", "image": "reg.example/ddp:1"}})
    assert slurm.work_root(pyxis, None) == ""  # the image's working directory


def test_each_task_gets_its_own_address_and_only_the_first_node_hosts_the_rendezvous(tmp_path):
    inv = inventory()
    first = _run_task(tmp_path, inv, "node1", 0)
    second = _run_task(tmp_path, inv, "node2", 1)
    for got, addr, rank in ((first, "198.18.0.11", "0"), (second, "198.18.0.12", "1")):
        assert got[got.index("--local-addr") + 1] == addr
        assert got[got.index("--rdzv-endpoint") + 1] == "198.18.0.11:29400"
        assert got[got.index("--node-rank") + 1] == rank
    assert first[first.index("--rdzv-conf") + 1] == "is_host=1,join_timeout=600,read_timeout=60"
    assert second[second.index("--rdzv-conf") + 1] == "join_timeout=600,read_timeout=60"
    assert "DDP_NODE_NAME=node2" in second and f"DDP_DEPLOY_LOG_DIR={tmp_path}/runs/node2" in second
    assert (tmp_path / "runs" / "node2").is_dir()
    cut = second.index("--")
    assert second[cut + 1:cut + 5] == ["--data-dir", "/nas/data", "--ckpt-dir", "/nas/ckpt"]


def test_each_task_watches_its_own_ranks_with_the_jobs_stall_policy(tmp_path):
    inv = inventory(job={"name": "mnist", "runtime": "host", "on_stall": "restart", "stall_timeout": 90})
    got = _run_task(tmp_path, inv, "node2", 1, env_extra={"SLURM_JOB_ID": "41"})
    assert "DDP_HEARTBEAT_DIR=/dev/shm/ddp-heartbeat-slurm-41@node2" in got  # the Slurm job's, this node's
    script = slurm.batch_script(inv, "R1")
    assert "export DDP_ON_STALL=restart" in script and "export DDP_STALL_TIMEOUT=90" in script
    default = slurm.batch_script(inventory(), "R1")
    assert "export DDP_ON_STALL=report" in default and "export DDP_STALL_TIMEOUT=auto" in default


def _on_node(argv, node: str, job_id: str, label: int) -> str:
    """One task of a step on the allocation's nodes, run here with Slurm's variables, its lines
    labelled as ``srun --label`` does."""
    script = argv[argv.index("-c") + 1:]
    done = subprocess.run(["sh", "-c", *script], env={"PATH": os.environ["PATH"], "SLURMD_NODENAME": node,
                                                      "SLURM_JOB_ID": job_id},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return "".join(f"{label}: {line}\n" for line in done.stdout.splitlines())


def test_status_reads_each_nodes_heartbeats_through_a_step_beside_the_job(tmp_path):
    inv = inventory(storage={"data": {"host": str(tmp_path / "data"), "container": "/data"},
                             "checkpoints": {"host": str(tmp_path / "ckpt"), "container": "/ckpt"}})
    job_id = f"9{os.getpid()}"
    argv = slurm.progress_argv(inv, job_id, "R1")
    assert argv[:4] == ("timeout", str(slurm.ON_NODES_S), "srun", f"--jobid={job_id}")
    assert {"--overlap", "--label", "--nodes=2", "--ntasks-per-node=1"} <= set(argv)
    log = tmp_path / "ckpt" / ".ddp-deploy" / "mnist" / "runs" / "R1" / "node2" / "log"
    log.parent.mkdir(parents=True)
    log.write_text("started\n")
    beats = {n: f"/dev/shm/ddp-heartbeat-slurm-{job_id}@{n}" for n in ("node1", "node2")}
    try:
        for n, d in beats.items():
            os.makedirs(d)
        open(f"{beats['node2']}/1", "w").write(f"{12:20d} {3:10d} {250:13d}\n")
        printed = _on_node(argv, "node2", job_id, 1) + _on_node(argv, "node1", job_id, 0) + "srun: a line of srun's own\n"
    finally:
        for d in beats.values():
            shutil.rmtree(d, ignore_errors=True)
    seen = slurm.by_node(printed)
    assert set(seen) == {"node1", "node2"}
    state = plan.parse_status("running\n" + seen["node2"])
    assert [(b.local_rank, b.step, b.rank) for b in state.beats] == [(1, 12, 3)] and state.quiet_s is not None
    assert plan.parse_status("running\n" + seen["node1"]).beats == ()
    assert slurm.by_node("0: beat 0 1 5 0 10\n1: node \n") == {}  # a task that named no node is nobody's


def test_following_a_job_reads_the_nodes_progress_only_every_few_seconds(monkeypatch):
    """Each read is a Slurm job step: polled every 2 s it would spend a job's MaxStepCount in a day."""
    from deploy.engines import slurmjob

    clock, steps = [0.0], []
    running = slurm.SlurmState("7", "R1", "RUNNING")
    monkeypatch.setattr(slurmjob, "job_state", lambda *a: running if clock[0] < 60 else slurm.SlurmState("7", "R1", "COMPLETED"))
    monkeypatch.setattr(slurmjob, "node_states", lambda *a: steps.append(clock[0]) or {})
    monkeypatch.setattr(slurmjob.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(slurmjob.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    assert slurmjob.follow(inventory(), None, None, str).state == "COMPLETED"
    assert len(steps) == 6 and all(b - a >= slurm.PROGRESS_EVERY_S for a, b in zip(steps, steps[1:])), steps


def test_doctor_reads_the_stacks_on_each_node_of_the_allocation():
    inv = inventory()
    argv = slurm.diagnose_argv(inv, "41")
    assert argv[argv.index("-c") + 1] == slurm.NODE_DIAGNOSE and argv[-1] == "/nas/venv/bin/py-spy"
    pyxis = inventory(job={"name": "mnist", "runtime": "docker"},
                      slurm={**BASE["slurm"], "container": {"kind": "pyxis", "image": "reg.example/ddp:1"}})
    assert slurm.diagnose_argv(pyxis, "41")[-1] == "py-spy"  # the step runs on the node, outside the container
    # a stack's JSON is longer than srun keeps in one labelled line: the task cuts it, by_node joins it
    dump = json.dumps([{"pid": 7, "frames": [{"name": "all_reduce", "filename": "/x" * 900, "line": 8}]}])
    fake = f'echo "rank 7 3 1 S"; echo "stack 7 {dump.replace(chr(34), chr(92) + chr(34))}"; echo "workers 1"'
    script = slurm.NODE_DIAGNOSE[:slurm.NODE_DIAGNOSE.index("{\n") + 2] + fake + "\n" + \
        slurm.NODE_DIAGNOSE[slurm.NODE_DIAGNOSE.index("} | awk"):]
    printed = _on_node(("-c", script, "sh", "py-spy"), "node2", "41", 1)
    assert max(len(line) for line in printed.splitlines()) <= 410
    ranks = doctor.parse("node2", slurm.by_node(printed)["node2"])
    assert [(r.rank, r.frames[0].name if r.frames else r.problem) for r in ranks] == [(3, "all_reduce")]


def test_a_task_whose_node_slurm_did_not_list_fails_naming_it(tmp_path):
    inv = inventory()
    argv = slurm.srun_argv(inv, "R1")
    task = argv[argv.index("sh"):]
    args = ["node1=198.18.0.11" if a == "$addrs" else "node1" if a == "$head" else a for a in task]
    done = subprocess.run(args, env={"PATH": os.environ["PATH"], "SLURMD_NODENAME": "node7", "SLURM_NODEID": "1"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "no address for node7" in done.stderr


def test_container_routes_render_the_sites_runtime_with_the_shared_directories():
    pyxis = inventory(job={"name": "mnist", "runtime": "docker"},
                      slurm={**BASE["slurm"], "container": {"kind": "pyxis", "image": "reg.example/ddp:1"}})
    argv = slurm.srun_argv(pyxis, "R")
    assert "--container-image=reg.example/ddp:1" in argv
    assert "--container-mounts=/nas/data:/data,/nas/ckpt:/ckpt" in argv
    assert argv[argv.index("sh") + 9] == "python" and "/ckpt/.ddp-deploy/mnist/runs/R" in argv
    app = inventory(job={"name": "mnist", "runtime": "docker"},
                    slurm={**BASE["slurm"], "gpus_per_node": 2,
                           "container": {"kind": "apptainer", "image": "/nas/ddp.sif"}})
    argv = slurm.srun_argv(app, "R")
    assert argv[argv.index("apptainer"):argv.index("/nas/ddp.sif") + 1] == [
        "apptainer", "exec", "--nv", "--bind", "/nas/data:/data,/nas/ckpt:/ckpt", "/nas/ddp.sif"]


SCONTROL = ("JobId=12 JobName=mnist UserId=root(0) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 "
            "Restarts=1 BatchFlag=1 ExitCode=0:0 RunTime=00:01:02 TimeLimit=01:00:00 NodeList=node[1-2]")


def test_status_reads_slurms_state_and_each_nodes_exits_and_metrics():
    out = "\n".join(["job 12 R1", f"scontrol {SCONTROL}", "@@run R1", "@@node node1", "1700000000.0 0",
                     'METRICS {"kind": "train", "step": 5}', "@@node node2"])
    s = slurm.parse_status(out)
    assert (s.job_id, s.run, s.state, s.restarts, s.nodelist, s.elapsed) == ("12", "R1", "RUNNING", 1, "node[1-2]",
                                                                             "00:01:02")
    assert s.active and not s.ok and s.reason == ""
    assert s.nodes["node1"].exits == ((1700000000.0, 0),) and '"step": 5' in s.nodes["node1"].metrics
    assert s.nodes["node2"].exits == ()
    gone = slurm.parse_status("job 13 R2\nsacct FAILED|1:0|00:00:09|node1\n")
    assert (gone.state, gone.exit_code, gone.active) == ("FAILED", "1:0", False)
    assert slurm.parse_status("none\n").job_id is None
    assert slurm.parse_status("job 14 R3\ngone\n").state == "gone"


def write(tmp_path, **sections):
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({**BASE, **sections}))
    return str(path)


def test_export_slurm_prints_the_script_launch_submits(ddp, tmp_path):
    hosts = write(tmp_path)
    got = ddp(hosts, "export", "slurm")
    assert got.exit_code == 0, got.output
    assert got.output == slurm.batch_script(loads(open(hosts).read()), "RUN_ID")
    dry = ddp(hosts, "launch", "--dry-run")
    assert dry.exit_code == 0 and got.output.strip() in dry.output


def test_export_slurm_of_a_fleet_and_fleet_only_verbs_on_slurm_are_refused(ddp, tmp_path):
    hosts = write(tmp_path)
    for argv in (["join", "node1"], ["unlock"], ["check", "--network"]):  # doctor runs there: through srun
        got = ddp(hosts, *argv)
        assert got.exit_code == 2 and "not on Slurm" in got.output, got.output
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({**{k: v for k, v in BASE.items() if k != "slurm"},
                                     "rendezvous": {"node": "a"}, "nodes": [{"name": "a", "address": "10.0.0.1"}]}))
    got = ddp(fleet, "export", "slurm")
    assert got.exit_code == 2 and "no slurm: section" in got.output


def test_the_deploy_cli_on_slurm_imports_no_torch(tmp_path):
    hosts = write(tmp_path)
    code = textwrap.dedent(f"""
        import sys
        from deploy.cli import main
        try:
            main(["--hosts", {hosts!r}, "export", "slurm"])
        except SystemExit:
            pass
        assert "torch" not in sys.modules, "torch imported"
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=2" in done.stdout and shlex.quote("/nas/venv/bin/python") in done.stdout
