"""A program that starts its own workers (train.spawn): torchrun runs one process per node, which
starts ``DDP_PROCS`` workers with ``mp.spawn`` or ``start_processes`` (fork), each forming the
group as ``GROUP_RANK x DDP_PROCS + i``. Through ``train.code`` on a local host-runtime node with
real torchrun: it trains and resumes from its own checkpoint, each worker is a rank of its own in
``status``, ``logs --rank`` and ``doctor`` (its parent and multiprocessing's helpers are not),
a hung worker is named by ``status``, and ``stop`` ends them all. Then what hosts.yaml may say."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from deploy.inventory import InventoryError, load
from deploy.job.plan import contract_env, torchrun_options
from deploy.job.runtime import runtime
from local_job import beats_dir, local_hosts
from torch_ends import NEWEST_ONLY
from agent.launch import Relay
from waiting import wait_until

TUTORIAL = """\
import os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def train(local, machine, procs, nodes):
    rank = machine * procs + local  # the machine id, as the tutorial computes it
    dist.init_process_group("gloo", rank=rank, world_size=nodes * procs)
    model = DDP(torch.nn.Linear(4, 1))
    start = 0
    if os.path.exists("checkpoint.pth"):  # resume from its own checkpoint, where it stands
        state = torch.load("checkpoint.pth")
        model.module.load_state_dict(state["model"])
        start = state["step"]
        print(f"resumed from step {start}", flush=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start, start + int(os.environ["STEPS"])):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        print(f"worker {rank} step {step}", flush=True)
        if os.environ.get("HANG_RANK") == str(rank) and step == start + 2:
            time.sleep(3600)  # this worker stops taking part: the others wait in a collective
        time.sleep(0.1)
    dist.barrier()
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step + 1}, "checkpoint.pth")
    dist.destroy_process_group()


if __name__ == "__main__":
    procs, machine = int(os.environ["DDP_PROCS"]), int(os.environ["GROUP_RANK"])
    nodes = int(os.environ["GROUP_WORLD_SIZE"])
    if os.environ.get("START") == "fork":
        mp.start_processes(train, args=(machine, procs, nodes), nprocs=procs, start_method="fork")
    else:
        mp.spawn(train, args=(machine, procs, nodes), nprocs=procs)
"""


def _hosts(tmp_path: Path, python: str = sys.executable, **env: str) -> Path:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "train.py").write_text(TUTORIAL)
    return local_hosts(tmp_path, job="spawner", procs=2, train={
        "python": python, "script": "train.py", "code": "project", "spawn": True, "env": {"STEPS": "12", **env}})


def _rank_lines(ddp, hosts: Path, rank: int) -> list[str]:
    r = ddp(hosts, "logs", "--rank", str(rank))
    assert r.exit_code == 0, r.output
    return [line.split("| ", 1)[1] for line in r.stdout.splitlines() if "| " in line]


@pytest.mark.e2e
def test_a_spawning_tutorial_trains_resumes_and_each_worker_is_a_rank_of_its_own(torch_python, tmp_path, ddp):
    """A tutorial that spawns its workers trains and resumes, and each worker is a rank of its own."""
    hosts = _hosts(tmp_path, torch_python.python)
    first = ddp(hosts, "launch", "--wait", "--timeout", "240")
    assert first.exit_code == 0, first.output
    assert "all nodes finished with exit code 0" in first.output
    assert re.search(r"first step after \d", first.output), first.output
    again = ddp(hosts, "launch", "--wait", "--timeout", "240")
    assert again.exit_code == 0, again.output

    # each worker's lines under its own rank: the worker torchrun started is rank 0 of one process
    for rank in (0, 1):
        said = _rank_lines(ddp, hosts, rank)
        steps = [line for line in said if line.startswith("worker ")]
        assert steps and all(line.startswith(f"worker {rank} step ") for line in steps), said
        assert "resumed from step 12" in said, said  # the second launch, from the first's checkpoint
        assert f"worker {rank} step 23" in said, said
    assert (tmp_path / "nas/ckpt/work/here/checkpoint.pth").is_file()  # its own, where it stood
    status = json.loads(ddp(hosts, "status", "--json").stdout)[0]
    assert status["state"] == "exited(0)" and status["ranks"] == 2, status


@pytest.mark.e2e
@NEWEST_ONLY
def test_a_hung_forked_worker_is_named_by_status_and_doctor_and_stop_ends_everything(torch_python, tmp_path, ddp):
    """A forked worker that hangs is named by status and doctor, and stop ends every process."""
    hosts = _hosts(tmp_path, START="fork", HANG_RANK="1", STEPS="1000")
    data = json.loads(hosts.read_text())
    data["job"]["stall_timeout"] = 10
    hosts.write_text(json.dumps(data))
    beats = beats_dir(hosts)
    try:
        assert ddp(hosts, "launch").exit_code == 0
        status = wait_until(lambda: (lambda s: s if s["stalled"] else None)(
            json.loads(ddp(hosts, "status", "--json").stdout)[0]), 90, "the stall", interval=1)
        assert status["ranks"] == 2, status
        assert re.fullmatch(r"here rank 1 is in train \(train\.py:\d+\); the 1 other rank waits in "
                            r"\S+( #\d+)? \(train\.py:\d+\)( in \w+ #\d+)?", status["stall_diagnosis"]), status
        doctor = ddp(hosts, "doctor")
        headers = re.findall(r"^here rank (\d+) \(pid (\d+),", doctor.stdout, re.M)
        assert sorted(rank for rank, _ in headers) == ["0", "1"], doctor.stdout  # the workers, not their parent
        workers = {int(pid) for _, pid in headers}
        parents = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in workers}
        assert len(parents) == 1 and not parents & workers  # both forked by the one process torchrun started
        assert _rank_lines(ddp, hosts, 1)[-1] == "worker 1 step 2"
        stopped = ddp(hosts, "stop")  # graceful: torchrun's SIGTERM to the process it started
        assert stopped.exit_code == 0, stopped.output
        wait_until(lambda: not _processes(beats), 30, "every process of the job gone after the stop")
    finally:
        ddp(hosts, "stop", "--now")
    assert json.loads(ddp(hosts, "status", "--json").stdout)[0]["state"].startswith("stopped")


def _processes(beats: str) -> list[str]:
    """The processes whose environment names the job's heartbeat directory (its workers and theirs)."""
    marker, found = f"DDP_HEARTBEAT_DIR={beats}".encode(), []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker in (p / "environ").read_bytes().split(b"\0"):
                found.append(p.name)
        except OSError:
            continue
    return found


# --- what hosts.yaml may say -------------------------------------------------------------------------

def _inventory(tmp_path: Path, train: dict, procs=(2,)) -> Path:
    tmp_path.mkdir(exist_ok=True)
    nodes = [{"name": "here", "address": "127.0.0.1", "procs": procs[0]},
             *({"name": f"n{i}", "address": f"10.0.0.{i}", "procs": p, "connection": "ssh"}
               for i, p in enumerate(procs[1:], 2))]
    return local_hosts(tmp_path, job="spawner", nodes=nodes, train=train)


def test_torchrun_starts_one_process_per_node_which_is_told_how_many_to_start(tmp_path):
    inv = load(_inventory(tmp_path, {"script": "train.py", "spawn": True}, procs=(3, 3)))
    options = torchrun_options(inv, 0)
    assert options[options.index("--nproc-per-node") + 1] == "1"
    assert contract_env(inv, "/data", "/ckpt")["DDP_PROCS"] == "3"
    gpus = json.loads((tmp_path / "hosts.yaml").read_text())
    for node in gpus["nodes"]:
        node["gpus"] = 3
    (tmp_path / "hosts.yaml").write_text(json.dumps(gpus))
    inv = load(tmp_path / "hosts.yaml")
    assert dict(runtime(inv).gpu_env(inv.nodes[0]))["CUDA_VISIBLE_DEVICES"] == "0,1,2"  # all of the node's, for one process
    plain = load(_inventory(tmp_path / "plain", {"script": "train.py"}, procs=(3, 3)))
    options = torchrun_options(plain, 0)
    assert options[options.index("--nproc-per-node") + 1] == "3" and "DDP_PROCS" not in contract_env(plain, "/d", "/c")


@pytest.mark.parametrize("train, procs, said", [
    ({"spawn": True}, (2,), "train.spawn: the built-in trainer does not start its own workers"),
    ({"script": "train.py", "spawn": True}, (2, 4), "the nodes run 2, 4 processes"),
    ({"script": "train.py", "env": {"DDP_PROCS": "8"}}, (2,), "DDP_PROCS"),
])
def test_spawn_needs_a_program_of_its_own_and_one_process_count_on_every_node(tmp_path, train, procs, said):
    with pytest.raises(InventoryError) as e:
        load(_inventory(tmp_path / "sub", train, procs))
    assert said in str(e.value)


def test_a_label_that_is_not_exactly_a_ranks_is_text_of_the_workers_line():
    relay = Relay("[rank${rank}]: ")
    assert relay.relabel(b"\x1eddp-rank 3 1\x1ehello\n", b"[rank0]: ") == (b"[rank3]: ", b"hello\n")
    for line in (b"\x1eddp-rank 3\x1ehello\n", b"\x1eddp-rank x 1\x1ehello\n", b"\x1eddp-rank 3 1 hello\n",
                 b"\x1eddp-rank 1234567890 1\x1ehello\n"):
        assert relay.relabel(line, b"[rank0]: ") == (b"[rank0]: ", line)


def test_slurm_and_kubernetes_start_one_process_per_node_too():
    from deploy.engines import k8s, slurm
    from deploy.inventory import loads

    storage = "storage:\n  data: {host: /d, container: /data}\n  checkpoints: {host: /c, container: /ckpt}\n"
    spawn = "train: {script: train.py, spawn: true}\n"
    batch = loads("job: {name: big, runtime: host}\nslurm: {login: {address: 10.0.0.5}, nodes: 2, gpus_per_node: 8}\n"
                  + storage + spawn)
    args = slurm.launcher_args(batch)
    assert args[args.index("--nproc-per-node") + 1] == "1"
    assert ("DDP_PROCS", "8") in slurm.job_env(batch, "20261123-101341-6d79")
    pods = loads("job: {name: small}\nrendezvous: {node: a}\nnodes:\n  - {name: a, address: 10.0.0.1, procs: 2}\n"
                 "  - {name: b, address: 10.0.0.2, procs: 2}\n" + storage + spawn)
    (job,) = k8s.manifests(pods, kind="pytorchjob", pvc="shared-nfs")
    assert job["spec"]["nprocPerNode"] == "1"
    for kind in k8s.KINDS.values():
        launch = k8s.launch_args(pods, kind)
        assert launch[launch.index("--nproc-per-node") + 1] == "1"
