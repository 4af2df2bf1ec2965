"""job.stages (model parallelism): each process gets that many of a node's GPUs, in order; the
built-in trainer is told --stages, a program of your own DDP_STAGES; a layout that cannot fit a
node is refused at validation, naming the node."""

from __future__ import annotations

import pytest

from deploy.job import plan
from deploy.errors import InventoryError
from deploy.inventory import loads
from deploy.engines.k8s import KINDS, container
from deploy.engines.slurm import launcher_args

FLEET = """
job: {name: demo, runtime: docker, stages: 2}
rendezvous: {node: a, port: 29500}
nodes:
  - {name: a, address: 198.18.0.11, gpus: 8, interface: eth0}
  - {name: b, address: 198.18.0.12, gpus: 8, gpu_ids: [4, 5, 6, 7], interface: eth0}
storage:
  data: {host: /nas/data, container: /data}
  checkpoints: {host: /nas/ckpt, container: /ckpt}
train:
  args: [--model, resnet50, --micro-batches, "4"]
"""


def _opt(argv, flag):
    return argv[list(argv).index(flag) + 1]


def test_a_node_of_8_gpus_and_2_stages_runs_4_processes_of_2_gpus_each_in_order():
    inv = loads(FLEET)
    a, b = inv.nodes
    assert (a.nprocs, a.devices) == (4, tuple(range(8)))
    assert (b.nprocs, b.devices) == (2, (4, 5, 6, 7))  # gpu_ids grouped in order: (4, 5) and (6, 7)
    specs = plan.launch_plan(inv)
    for spec, procs, visible in zip(specs, ("4", "2"), ("0,1,2,3,4,5,6,7", "4,5,6,7"), strict=True):
        assert _opt(spec.torchrun, "--nproc-per-node") == procs
        env = dict(spec.env)
        assert env["DDP_STAGES"] == "2"
        assert f'"device={visible}"' in spec.argv  # docker --gpus: every GPU its processes own
        assert spec.trainer[spec.trainer.index("--stages") + 1] == "2"
        assert spec.trainer[-4:] == ("--model", "resnet50", "--micro-batches", "4")


def test_a_program_of_its_own_gets_the_stages_in_its_environment_and_no_flag():
    inv = loads(FLEET.replace("args: [--model, resnet50, --micro-batches, \"4\"]", "module: pkg.train"))
    spec = plan.launch_plan(inv)[0]
    assert "--stages" not in spec.trainer and dict(spec.env)["DDP_STAGES"] == "2"


def test_on_a_cpu_node_the_stages_share_the_cpu():
    inv = loads(FLEET.replace("gpus: 8, gpu_ids: [4, 5, 6, 7], ", "").replace("gpus: 8, ", ""))
    assert [(n.nprocs, n.devices) for n in inv.nodes] == [(1, ()), (1, ())]
    assert _opt(plan.launch_plan(inv)[0].trainer, "--stages") == "2"


@pytest.mark.parametrize("node, message", [
    ("{name: b, address: 198.18.0.12, gpus: 7}",
     r"nodes\[1\]\.gpus: node b: 7 GPUs do not divide into processes of job\.stages \(2\) GPUs each; set procs to use 6"),
    ("{name: b, address: 198.18.0.12, gpus: 1}",
     r"nodes\[1\]\.gpus: node b: 1 GPU\(s\), fewer than one process needs: job\.stages \(2\) GPUs per process"),
    ("{name: b, address: 198.18.0.12, gpus: 4, procs: 3}",
     r"nodes\[1\]\.procs: node b: procs \(3\) x job\.stages \(2\) must be <= gpus \(4\) on a GPU node"),
    ("{name: b, address: 198.18.0.12, gpus: 8, gpu_ids: [0, 1, 2]}",
     r"nodes\[1\]\.gpu_ids: node b: 3 GPU ids for 1 processes; job\.stages \(2\) GPUs per process"),
])
def test_a_layout_that_cannot_fit_a_node_is_refused_naming_the_node(node, message):
    text = FLEET.replace("{name: b, address: 198.18.0.12, gpus: 8, gpu_ids: [4, 5, 6, 7], interface: eth0}", node)
    with pytest.raises(InventoryError, match=message):
        loads(text)


def test_micro_batches_are_checked_with_the_stages_the_tool_gives_the_trainer():
    with pytest.raises(InventoryError, match=r"micro_batches: pipelines the stages of a split model, but stages is 1"):
        loads(FLEET.replace("stages: 2}", "stages: 1}"))


SLURM = """
job: {name: demo, runtime: host, stages: 2}
slurm:
  login: {name: login, address: 198.18.0.2}
  nodes: 2
  gpus_per_node: GPUS
storage:
  data: {host: /nas/data, container: /data}
  checkpoints: {host: /nas/ckpt, container: /ckpt}
"""


def test_slurm_and_kubernetes_lay_out_the_stages_as_the_fleet_does():
    inv = loads(SLURM.replace("GPUS", "8"))
    args = launcher_args(inv)
    assert _opt(args, "--nproc-per-node") == "4" and _opt(args, "--stages") == "2"
    with pytest.raises(InventoryError, match=r"slurm\.gpus_per_node: 3 GPUs do not divide into processes"):
        loads(SLURM.replace("GPUS", "3"))
    # Kubernetes takes a fleet's shape: processes per pod and the GPUs each pod asks for
    fleet = loads(FLEET.replace("gpu_ids: [4, 5, 6, 7], ", ""))
    assert fleet.shape == (2, 4, 8)
    pod = container(fleet, KINDS["job"], "img", [])
    assert pod["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
