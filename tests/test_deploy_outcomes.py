"""How a run ended, told truly, through the real CLI on a local host-runtime node (torchrun on the
CPU, gloo): a graceful `stop` ends `launch --wait` as a stop (exit 3), `status` shows the stopped
node as `runs` does; a program that exits 0 without forming a process group or printing a METRICS
line is not called a success; one that forms the group and beats is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.job import outcome, plan
from deploy.job.scripts import HOST_STATUS
from local_job import local_hosts
from waiting import wait_until


REPO = Path(__file__).resolve().parents[1]

LOOPS = """\
import time
print("looping", flush=True)
while True:
    time.sleep(0.2)
"""

IDLE = """\
print("no worker started: nothing to do on a CPU", flush=True)
"""

FORMS = """\
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
open(f"{os.environ['DDP_HEARTBEAT_DIR']}/{os.environ['LOCAL_RANK']}", "w").write(f"1 {os.environ['RANK']}\\n")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def _host_status(run: Path, beats: Path) -> plan.NodeState:
    return plan.parse_status(subprocess.run(["sh", "-c", HOST_STATUS, "sh", str(run), str(beats)], capture_output=True,
                                            text=True, check=True, timeout=60).stdout)


def test_a_host_node_reads_stopping_then_stopped_as_its_record_says(tmp_path):
    kept, run = tmp_path / "runs/20260101-000000-abcd/here", tmp_path / "here"
    kept.mkdir(parents=True)
    run.mkdir()
    (kept / "log").write_text('METRICS {"kind": "train", "step": 40}\n')
    (run / "log").symlink_to(kept / "log")
    job = subprocess.Popen(["sleep", "60"], start_new_session=True)  # the run's process group
    try:
        (run / "pid").write_text(f"{job.pid}\n")
        assert _host_status(run, tmp_path / "beats").state == "running"
        (kept.parent / "here.stopped").write_text("1764072063 node graceful - root@op\n")  # the stop has begun
        assert _host_status(run, tmp_path / "beats").state == outcome.STOPPING
    finally:
        job.kill()
        job.wait()
    (kept.parent / "here.stopped").write_text("1764072063 node graceful 40 root@op\n")  # and ended
    (run / "pid").unlink()
    done = _host_status(run, tmp_path / "beats")
    assert done.state == "stopped (graceful, checkpoint at step 40)" and done.ended and not done.running
    assert done.stop == outcome.Stop(1764072063, "root@op", True, 40) and done.metrics.startswith("METRICS ")
    (kept.parent / "here.stopped").unlink()  # no stop of this run: nothing runs, nothing says why
    assert _host_status(run, tmp_path / "beats").state == "absent"


def _hosts(tmp_path: Path, program: str, procs: int = 1) -> Path:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "main.py").write_text(program)
    return local_hosts(tmp_path, job="outcomes", train={"script": "main.py", "code": str(project)}, procs=procs)


def _status(ddp, hosts) -> dict:
    r = ddp(hosts, "status", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)[0]


def _runs(ddp, hosts) -> list[dict]:
    r = ddp(hosts, "runs", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.e2e
def test_launch_wait_of_a_stopped_job_ends_as_a_stop_and_status_agrees(ddp, tmp_path):
    hosts = _hosts(tmp_path, LOOPS)
    env = {**os.environ, "DDP_DEPLOY_LOG": str(tmp_path / "debug.log")}
    launch = subprocess.Popen([sys.executable, "-m", "deploy", "--hosts", str(hosts), "launch", "--wait",
                               "--timeout", "240"], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        wait_until(lambda: (tmp_path / "nas/ckpt/.ddp-deploy/outcomes/here/pid").exists()
                   and _status(ddp, hosts)["state"] == "running", 240, "the job running")
        stopped = ddp(hosts, "stop")
        assert stopped.exit_code == 0, stopped.output
        out, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 3, out + err
    said = [line for line in err.splitlines() if line.startswith(("stopped: ", "error: "))]
    assert len(said) == 1 and said[0].startswith("stopped: the job was stopped by "), err
    assert "(graceful, no checkpoint reported) with `ddp-deploy stop`, on here" in said[0], said

    now = _status(ddp, hosts)  # not absent: the node's run was stopped, as runs says
    assert now["state"] == "stopped (graceful, no checkpoint reported)", now
    assert now["stopped"]["graceful"] is True and now["stopped"]["by"] == said[0].split()[6]
    (run,) = _runs(ddp, hosts)
    assert run["outcome"].startswith("stopped by ") and "(graceful, no checkpoint reported)" in run["outcome"]
    kept = ddp(hosts, "status", "--run", run["id"], "--json")
    assert json.loads(kept.stdout)["nodes"][0]["state"] == now["state"]
    table = ddp(hosts, "status")
    assert table.exit_code == 0 and "stopped (graceful, no checkpoint reported)" in table.stdout, table.output


@pytest.mark.e2e
def test_a_program_that_exits_0_having_trained_nothing_is_not_a_success(ddp, tmp_path):
    hosts = _hosts(tmp_path, IDLE)
    r = ddp(hosts, "launch", "--wait", "--timeout", "240")
    assert r.exit_code == 1, r.output
    assert f"error: every node {outcome.NOTHING_TRAINED} (" in r.stderr and "exit code 0" not in r.stdout, r.output
    shown = ddp(hosts, "status")
    assert shown.exit_code == 0 and outcome.NOTHING_TRAINED in shown.stdout, shown.output
    assert _status(ddp, hosts)["formed"] is False
    (run,) = _runs(ddp, hosts)
    assert run["outcome"] == outcome.NOTHING_TRAINED and run["nodes"]["here"]["formed"] is False


@pytest.mark.e2e
def test_a_program_that_forms_the_group_is_a_success_without_a_metrics_line(ddp, tmp_path):
    hosts = _hosts(tmp_path, FORMS, procs=2)
    r = ddp(hosts, "launch", "--wait", "--timeout", "240")
    assert r.exit_code == 0 and "all nodes finished with exit code 0" in r.stdout, r.output
    now = _status(ddp, hosts)
    assert now["state"] == "exited(0)" and now["formed"] is True and now["metrics"] == "", now
    assert outcome.NOTHING_TRAINED not in ddp(hosts, "status").stdout
    (run,) = _runs(ddp, hosts)
    assert run["outcome"] == "exit 0" and run["nodes"]["here"]["formed"] is True
