"""How `check` judges what agent.probe found where the job runs. The probe itself runs for real
in tests/test_deploy_preflight.py and on the cluster; GPUs, drivers and the NVIDIA container
runtime cannot exist here, so their answers are written out below as the probe prints them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.checks.node_checks import _torch
from deploy.nodes.remote import Result
from deploy.checks.versions import torch_supported
from agent.contract import TORCH_SUPPORTED
from local_job import on_paper


H100 = {"python": "3.11.7", "torch": "2.5.1+cu124", "cuda_build": "12.4", "cuda_available": True, "devices": 8,
        "device_names": ["NVIDIA H100 80GB HBM3"] * 8, "nccl": "2.21.5", "cuda_error": None, "infiniband": [],
        "error": None}


def _inv(runtime="docker", gpus=8):
    return on_paper([{"name": "a", "address": "198.18.0.11", "gpus": gpus}], job="demo", job_fields={"runtime": runtime},
                    train={"python": "/opt/venv/bin/python"})


def _judge(report=None, *, runtime="docker", gpus=8, exit_code=0, stderr="", for_launch=False):
    stdout = "PROBE " + json.dumps(report) if report is not None else ""
    return _torch(_inv(runtime, gpus), Result("a", exit_code, stdout, stderr), for_launch)


def test_a_gpu_node_with_working_cuda_reports_versions_devices_and_nccl():
    c = _judge(H100)
    assert c.ok and c.name == "torch"
    assert c.detail == ("torch 2.5.1+cu124, CUDA 12.4, 8 GPU(s) (NVIDIA H100 80GB HBM3), NCCL 2.21.5 "
                        "in image ddp-trainer:latest")


@pytest.mark.parametrize("version", ["2.4.1+cu121", "2.15.0", "1.13.1"])
def test_a_torch_outside_the_supported_range_is_refused_naming_version_range_and_fix(version):
    c = _judge({**H100, "torch": version})
    assert not c.ok
    assert c.detail.startswith(f"torch {version} in image ddp-trainer:latest is outside the supported range "
                               f"{TORCH_SUPPORTED}: build the image on a base inside it")
    host = _judge({**H100, "torch": version}, runtime="host")
    assert "in /opt/venv/bin/python is outside" in host.detail and "install a torch inside it" in host.detail


def test_a_driver_too_old_for_the_image_s_cuda_is_named():
    old = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040). Please "
           "update your GPU driver")
    c = _judge({**H100, "cuda_available": False, "devices": 0, "device_names": [], "nccl": None, "cuda_error": old})
    assert not c.ok
    assert c.detail == f"CUDA not usable in image ddp-trainer:latest (torch 2.5.1+cu124, CUDA 12.4): {old}"


def test_fewer_visible_devices_than_processes_is_refused():
    c = _judge({**H100, "devices": 4, "device_names": ["NVIDIA H100 80GB HBM3"] * 4})
    assert not c.ok and c.detail.startswith("4 CUDA device(s) visible in image ddp-trainer:latest for 8 processes")


def test_fewer_visible_devices_than_the_processes_stages_need_is_refused():
    inv = on_paper([{"name": "a", "address": "198.18.0.11", "gpus": 8}], job="demo", job_fields={"stages": 2},
                   train={"python": "/opt/venv/bin/python"})
    c = _torch(inv, Result("a", 0, "PROBE " + json.dumps({**H100, "devices": 6}), ""), False)
    assert not c.ok and c.detail == ("6 CUDA device(s) visible in image ddp-trainer:latest for 4 processes "
                                     "(GPUs 0,1,2,3,4,5,6,7); job.stages (2) GPUs per process")


def test_a_torch_without_nccl_cannot_run_a_gpu_job():
    c = _judge({**H100, "nccl": None})
    assert not c.ok and "has no NCCL" in c.detail


def test_docker_without_the_nvidia_runtime_is_named_with_the_fix():
    said = ('docker: Error response from daemon: could not select device driver "" with capabilities: '
            '[[gpu]].')
    c = _judge(None, exit_code=125, stderr=said)
    assert not c.ok and c.detail.startswith("no NVIDIA container runtime") and "nvidia-container-toolkit" in c.detail


def test_an_image_not_yet_deployed_passes_check_but_fails_launch():
    said = "Unable to find image 'ddp-trainer:latest' locally\ndocker: Error response from daemon: No such image"
    assert _judge(None, exit_code=125, stderr=said).ok
    at_launch = _judge(None, exit_code=125, stderr=said, for_launch=True)
    assert not at_launch.ok and "run `ddp-deploy deploy`" in at_launch.detail


def test_a_cpu_node_reports_torch_without_probing_cuda():
    cpu = {**H100, "torch": "2.13.0+cpu", "cuda_build": None, "cuda_available": None, "devices": 0,
           "device_names": [], "nccl": None}
    c = _judge(cpu, gpus=0)
    assert c.ok and c.detail == "torch 2.13.0+cpu, CPU build in image ddp-trainer:latest"


def test_a_broken_torch_install_is_reported_not_crashed_on():
    c = _judge({**H100, "torch": None, "error": "cannot import torch: ImportError: libcudnn.so.9: cannot open"})
    assert not c.ok and "libcudnn.so.9" in c.detail


@pytest.mark.parametrize("version, inside", [("2.5.1", True), ("2.5.1+cu124", True), ("2.5.0", False),
                                             ("2.14.1+cu130", True), ("2.15.0", False), ("2.15.0.dev20261101", False),
                                             ("2.6.0a0+ecf3bae40a.nv25.01", True), ("2.5.0a0+git1234", False),
                                             ("not-a-version", False)])
def test_the_supported_range_compares_releases_ignoring_local_build_tags(version, inside):
    assert torch_supported(version) is inside


def test_the_probe_runs_here_and_names_this_torch_without_cuda():
    out = subprocess.run([sys.executable, "-m", "agent.probe", "--gpus", "1", "--procs", "1"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}).stdout  # as on a node without GPUs
    report = json.loads(out.removeprefix("PROBE "))
    import torch
    assert report["torch"] == torch.__version__
    assert report["cuda_available"] is False and report["cuda_error"]
    c = _torch(_inv(gpus=1), Result("a", 0, out, ""), True)
    assert not c.ok and c.detail.startswith("CUDA not usable in image ddp-trainer:latest")


def test_a_node_without_this_version_s_agent_is_told_what_to_install():
    old = _judge(None, exit_code=1, stderr="/usr/bin/python: Error while finding module specification for "
                                          "'agent.probe' (ModuleNotFoundError: No module named 'agent')")
    assert not old.ok and "cannot import agent.probe, this version's node agent: rebuild the image" in old.detail
    none = _judge(None, runtime="host", exit_code=1, stderr="/opt/venv/bin/python: No module named agent.probe")
    assert not none.ok and none.detail.startswith("/opt/venv/bin/python cannot import agent.probe, this version's "
                                                  "node agent: install this version")


def test_a_probe_past_its_time_limit_or_of_another_version_is_named_not_crashed_on():
    slow = _judge(None, exit_code=124)
    assert not slow.ok and "took longer than" in slow.detail
    other = _judge({"torch": "2.5.1"})
    assert not other.ok and "answered without cuda_build" in other.detail


# --- a torch with no code for the node's GPUs ---------------------------------------------------
# The architectures each tested point of the supported range was built for, as its wheel says
# (torch._C._cuda_getArchFlags(), what torch.cuda.get_arch_list() returns on a GPU machine): read
# from the installed wheels where they are here, else these, as those wheels print them.
WHEEL_ARCH = {"2.5.1+cu124": "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90",
              "2.9.0+cu128": "sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120",
              "2.14.1+cu130": "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"}
# The GPUs: name and compute capability, as torch.cuda.get_device_name and get_device_capability
# give them.
GPUS = {"H100": ("NVIDIA H100 80GB HBM3", "9.0"), "B200": ("NVIDIA B200", "10.0"),
        "RTX 5090": ("NVIDIA GeForce RTX 5090", "12.0"), "V100": ("Tesla V100-SXM2-32GB", "7.0"),
        "L40S": ("NVIDIA L40S", "8.9")}


def _wheel_arch(version: str) -> list[str]:
    python = {"2.14.1+cu130": sys.executable,
              "2.9.0+cu128": os.environ.get("DDP_TORCH_BASE_PYTHON"),
              "2.5.1+cu124": os.environ.get("DDP_TORCH_OLDEST_PYTHON")}.get(version)
    if python:
        got = subprocess.run([python, "-c", "import torch; print(torch.__version__, torch._C._cuda_getArchFlags())"],
                             capture_output=True, text=True, timeout=120)
        if got.returncode == 0 and got.stdout.split()[0] == version:
            return got.stdout.split()[1:]
    return WHEEL_ARCH[version].split()


def _on(gpu: str, torch_version: str, *, works: bool, count: int = 8) -> dict:
    """The probe's answer on a node of ``count`` such GPUs with that torch: where the build has no
    code for them, CUDA is available (torch warns) and the first kernel fails."""
    name, cap = GPUS[gpu]
    cu = torch_version.split("+cu")[1]  # 124: CUDA 12.4
    return {**H100, "torch": torch_version, "cuda_build": f"{cu[:-1]}.{cu[-1]}", "devices": count,
            "device_names": [name] * count,
            "arch_list": _wheel_arch(torch_version), "capabilities": [cap] * count,
            **({} if works else {"cuda_available": False, "nccl": None,
                                 "cuda_error": "CUDA error: no kernel image is available for execution on the device"})}


def test_a_gpu_the_torch_has_no_code_for_is_refused_naming_it_and_the_cuda_it_needs():
    c = _judge(_on("B200", "2.5.1+cu124", works=False))
    assert not c.ok
    assert c.detail == ("GPUs 0,1,2,3,4,5,6,7 (NVIDIA B200, compute capability 10.0) have no code in this torch in "
                        "image ddp-trainer:latest (torch 2.5.1+cu124, CUDA 12.4, built for sm_50 ... sm_90, no PTX): "
                        "build the image on a base with CUDA 12.8 or newer (image.build_args.BASE_IMAGE, e.g. "
                        "pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime), then deploy")
    host = _judge(_on("RTX 5090", "2.5.1+cu124", works=False, count=8), runtime="host")
    assert "(NVIDIA GeForce RTX 5090, compute capability 12.0) have no code in this torch in /opt/venv/bin/python" \
        in host.detail and host.detail.endswith("install a torch with CUDA 12.8 or newer for "
                                                "/opt/venv/bin/python (train.python)"), host.detail


@pytest.mark.parametrize("gpu, torch_version, works", [
    ("H100", "2.5.1+cu124", True), ("L40S", "2.5.1+cu124", True), ("V100", "2.5.1+cu124", True),
    ("V100", "2.9.0+cu128", True), ("H100", "2.9.0+cu128", True), ("B200", "2.9.0+cu128", True),
    ("RTX 5090", "2.9.0+cu128", True), ("H100", "2.14.1+cu130", True), ("B200", "2.14.1+cu130", True), ("RTX 5090", "2.14.1+cu130", True),
    ("B200", "2.5.1+cu124", False), ("RTX 5090", "2.5.1+cu124", False), ("V100", "2.14.1+cu130", False)])
def test_each_tested_torch_is_judged_against_each_gpu_generation_by_its_own_list(gpu, torch_version, works):
    c = _judge(_on(gpu, torch_version, works=works))
    assert c.ok == works, c.detail
    if not works:
        assert f"({GPUS[gpu][0]}, compute capability {GPUS[gpu][1]}) have no code in this torch" in c.detail


RECORDED = sorted((Path(__file__).parents[1] / "bench" / "results").glob("gpu-check-*.json"))


def _recorded_probes() -> list[tuple[str, dict]]:
    """The probe answers ``make gpu-check`` recorded on real GPUs (its environment step), by file."""
    out = []
    for path in RECORDED:
        steps = {s["name"]: s for s in json.loads(path.read_text())["steps"]}
        report = steps.get("environment", {}).get("detail", {}).get("probe")
        if isinstance(report, dict):
            out.append((path.name, report))
    return out


def test_each_gpu_a_recorded_gpu_check_trained_on_passes_the_architecture_check():
    """A recorded ``make gpu-check`` trained on its GPUs with its torch: the check must agree that
    the build has code for them (and name each one where it would not)."""
    recorded = [(name, report) for name, report in _recorded_probes() if report.get("devices")]
    if not recorded:
        pytest.skip("no recorded gpu-check in bench/results holds agent.probe's answer: "
                    "`make gpu-check` on a machine with an NVIDIA GPU records it")
    for name, report in recorded:
        c = _judge(report, gpus=report["devices"])
        assert c.ok, (name, c.detail)
        assert report["arch_list"] and len(report["capabilities"]) == report["devices"], name


# What real machines printed: a torch build's architectures and a GPU's compute capability, and
# whether a kernel then ran (tests/gpu_logs/: a header of the facts, then the output verbatim).
GPU_LOGS = sorted((Path(__file__).parent / "gpu_logs").glob("*.txt"))


def _gpu_log(path: Path) -> tuple[dict, str]:
    head, _, body = path.read_text().partition("\n---\n")
    return dict(line.split(": ", 1) for line in head.splitlines()), body


@pytest.mark.parametrize("path", GPU_LOGS, ids=[p.stem for p in GPU_LOGS])
def test_a_real_machine_s_recorded_build_and_gpu_are_judged_as_its_kernel_fared(path):
    """Each recording's facts are in its verbatim output, and check passes exactly those that ran,
    naming the GPU and its capability where one did not."""
    facts, printed = _gpu_log(path)
    arch, (major, minor) = facts["arch_list"].split(), facts["capability"].split(".")
    assert all(f"'{a}'" in printed or f" {a}" in printed for a in arch), path.name
    assert any(form in printed for form in (f"sm_{major}{minor}", f"capability {major}.{minor}",
                                            f"({major}, {minor})")), path.name
    kind, _, said = facts["outcome"].partition(": ")  # ran: what ran / failed: the error as printed
    ran = kind == "ran"
    assert ran or said in printed, path.name
    torch_version = facts["torch"] if facts["torch"][:1].isdigit() else "2.5.1+cu124"  # not printed: not judged here
    cu = torch_version.split("+cu")[1]
    c = _judge({**H100, "torch": torch_version, "cuda_build": f"{cu[:-1]}.{cu[-1]}", "devices": 1,
                "device_names": [facts["gpu"]], "arch_list": arch, "capabilities": [facts["capability"]],
                **({} if ran else {"cuda_available": False, "nccl": None, "cuda_error": said})},
               gpus=1)
    assert c.ok == ran, c.detail
    if not ran:
        assert f"GPU 0 ({facts['gpu']}, compute capability {facts['capability']}) has no code in this torch" \
            in c.detail, c.detail


def test_the_recordings_of_real_machines_hold_gpus_that_ran_and_gpus_that_did_not():
    outcomes = {_gpu_log(p)[0]["outcome"].split(":")[0] for p in GPU_LOGS}
    assert outcomes == {"ran", "failed"}, outcomes


def test_a_gpu_older_than_the_build_is_told_to_find_a_build_that_keeps_it():
    c = _judge(_on("V100", "2.14.1+cu130", works=False))
    assert not c.ok and c.detail.endswith("build the image on a base with code for compute capability 7.0 "
                                          "(image.build_args.BASE_IMAGE), then deploy"), c.detail


def test_a_gpu_newer_than_the_table_knows_gets_no_cuda_or_base_named():
    c = _judge({**_on("B200", "2.14.1+cu130", works=False), "capabilities": ["13.0"] * 8})
    assert not c.ok and c.detail.endswith("build the image on a base with code for these GPUs "
                                          "(image.build_args.BASE_IMAGE), then deploy"), c.detail


def test_an_answer_without_the_build_s_architectures_is_judged_as_before():
    c = _judge(H100)  # a trainer whose probe predates them: nothing refused on their account
    assert c.ok


def test_machine_code_ptx_and_architecture_specific_builds_run_where_cuda_runs_them():
    from deploy.checks.gpu_arch import runs

    assert runs(["sm_80"], (8, 6)) and not runs(["sm_86"], (8, 0)) and not runs(["sm_80"], (9, 0))
    assert runs(["compute_90"], (10, 0)) and not runs(["compute_90"], (8, 9))  # PTX: compiled for a newer one
    assert runs(["sm_90a"], (9, 0)) and not runs(["sm_90a"], (10, 0)) and not runs(["sm_100a"], (10, 3))
    assert runs(["sm_100f"], (10, 3))  # a family build: its major's later minors
    assert not runs(["sm_1x", "compute_"], (9, 0))  # what is not an architecture runs nothing


def test_the_probe_reports_architectures_and_devices_before_a_kernel_fails():
    from agent.probe import _cuda

    class Cuda:
        is_available = staticmethod(lambda: True)
        device_count = staticmethod(lambda: 2)
        get_device_name = staticmethod(lambda i: "NVIDIA B200")
        get_arch_list = staticmethod(lambda: ["sm_50", "sm_90"])
        get_device_capability = staticmethod(lambda i: (10, 0))

    class Torch:  # CUDA as an old build meets a new GPU: available, and its first kernel fails
        cuda = Cuda

        @staticmethod
        def ones(*a, **k):
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")

    got = _cuda(Torch, 2)
    assert got == {"cuda_available": False, "devices": 2, "device_names": ["NVIDIA B200"] * 2,
                   "arch_list": ["sm_50", "sm_90"], "capabilities": ["10.0", "10.0"],
                   "cuda_error": "CUDA error: no kernel image is available for execution on the device"}
