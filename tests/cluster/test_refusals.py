"""A broken node is named with its cause by `check` within seconds, and `launch` starts nothing anywhere.

Each fault is made for real on one node of the cluster (its network link down, a key the node
does not accept, a host key that changed, a Docker daemon that is gone, GPUs that are not there,
a NAS path that is a different disk on one node) and undone afterwards.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .netcluster import LIGHT_MODEL
from .operator_cli import containers_on, ddp, trainer_processes_on

pytestmark = pytest.mark.cluster

TRAIN = ["--dataset", "synthetic", "--synthetic-size", "1536", "--batch-size", "32", "--epochs", "1", *LIGHT_MODEL]


def _new_key(tmp_path: Path, name: str) -> Path:
    key = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key


@contextlib.contextmanager
def _link_down(cluster, config, tmp_path):
    cluster.take_link_down("node3")
    try:
        yield
    finally:
        cluster.bring_link_up("node3")


@contextlib.contextmanager
def _wrong_key(cluster, config, tmp_path):
    config["nodes"][1]["ssh"] = {"key": str(_new_key(tmp_path, "stranger"))}
    yield


@contextlib.contextmanager
def _changed_host_key(cluster, config, tmp_path):
    other = Path(str(_new_key(tmp_path, "impostor")) + ".pub").read_text().split()[:2]
    address = cluster.host("node2").address
    lines = [f"{address} {other[0]} {other[1]}" if line.startswith(address + " ") else line
             for line in Path(cluster.known_hosts).read_text().splitlines()]
    known = tmp_path / "known_hosts"
    known.write_text("\n".join(lines) + "\n")
    config["ssh"]["known_hosts"] = str(known)
    yield


@contextlib.contextmanager
def _docker_gone(cluster, config, tmp_path):
    sock = cluster.host("node2").docker_sock
    away = sock.with_name("docker.sock.away")
    os.rename(sock, away)
    try:
        yield
    finally:
        os.rename(away, sock)


@contextlib.contextmanager
def _nas_not_shared(cluster, config, tmp_path):
    """Another disk mounted over the NAS path, in node3's sshd (and so its sessions) alone."""
    pid = (cluster.host("node3").run_dir / "sshd.pid").read_text().strip()
    enter = ["nsenter", "-t", pid, "-m"]
    subprocess.run([*enter, "mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", cluster.nas_dir], check=True)
    try:
        yield
    finally:
        subprocess.run([*enter, "umount", "-l", cluster.nas_dir], check=True)


# fault: (how to make it, the node to blame, its failing check, the cause named)
FAULTS = {
    "node unreachable": (_link_down, "node3", "ssh", "unreachable"),
    "wrong ssh key": (_wrong_key, "node2", "ssh", "auth refused"),
    "host key changed": (_changed_host_key, "node2", "ssh", "host key mismatch"),
    "no docker engine": (_docker_gone, "node2", "docker", "docker engine not usable"),
    "nas not the same storage": (_nas_not_shared, "node3", "shared storage", "not the same storage"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_check_names_the_node_and_the_cause_and_launch_starts_nothing(cluster, fresh_nas, tmp_path, fault,
                                                                     record_fault):
    make, node, check, cause = FAULTS[fault]
    config = cluster.hosts_config("docker", 2, TRAIN, "eth0", ssh={"connect_timeout": 3}, storage={"min_free_gb": 0})
    hosts = tmp_path / "hosts.yaml"
    with make(cluster, config, tmp_path):
        hosts.write_text(yaml.safe_dump(config, sort_keys=False))
        started = time.monotonic()
        checked = ddp(cluster, hosts, "check", timeout=120)
        took = time.monotonic() - started
        launched = ddp(cluster, hosts, "launch", timeout=120)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    failure = checked.stderr.strip().splitlines()[0]
    blamed = failure.split(" failed: ", 1)[1].split(" | ")
    assert all(b.startswith(f"{node} ") for b in blamed), failure  # no healthy node is blamed
    assert any(b.startswith(f"{node} {check}: ") and cause in b for b in blamed), failure
    assert took < 30, f"check took {took:.0f} s"
    assert launched.returncode == 1 and "nothing started" in launched.stderr
    assert node in launched.stderr and cause in launched.stderr, launched.stderr
    for h in cluster.hosts:
        assert containers_on(cluster, h.name) == []
    record_fault(fault=f"{fault} ({node})", finished="refused before starting", redone_steps=None,
                 ckpt_every=None, detect_s=round(took, 1), detect_what=f"`check` naming {node} {check}",
                 left_running="nothing", bit_identical=None)


def _blamed(proc) -> list[str]:
    return proc.stderr.strip().splitlines()[0].split(" failed: ", 1)[1].split(" | ")


@pytest.mark.parametrize("runtime, cause", [
    # the nodes' real Docker engines have no NVIDIA runtime: `docker run --gpus` is refused
    ("docker", "torch: no NVIDIA container runtime"),
    # the host interpreter's torch finds no CUDA device (these machines have none)
    ("host", "torch: CUDA not usable in "),
])
def test_gpu_nodes_where_cuda_cannot_work_are_each_named_and_nothing_starts(cluster, fresh_nas, tmp_path,
                                                                            runtime, cause, record_fault):
    config = cluster.hosts_config(runtime, 1, TRAIN, "eth0", ssh={"connect_timeout": 3}, storage={"min_free_gb": 0})
    for node in config["nodes"]:
        node["gpus"] = 1
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump(config, sort_keys=False))
    if runtime == "docker":
        assert ddp(cluster, hosts, "deploy", timeout=600).returncode == 0  # the image is there: only CUDA fails
    started = time.monotonic()
    checked = ddp(cluster, hosts, "check", timeout=120)
    took = time.monotonic() - started
    launched = ddp(cluster, hosts, "launch", timeout=120)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    blamed = _blamed(checked)
    for h in cluster.hosts:
        assert any(b.startswith(f"{h.name} {cause}") for b in blamed), blamed
        assert f"{h.name} gpus: nvidia-smi failed" in " | ".join(blamed)  # and no GPUs listed on the host
    assert launched.returncode == 1 and "nothing started" in launched.stderr and cause in launched.stderr
    for h in cluster.hosts:
        assert containers_on(cluster, h.name) == []
        assert trainer_processes_on(cluster, h.name) == []
    record_fault(fault=f"GPU nodes without usable CUDA ({runtime} runtime)", finished="refused before starting",
                 redone_steps=None, ckpt_every=None, detect_s=round(took, 1),
                 detect_what="`check` naming every node's torch/CUDA probe", left_running="nothing",
                 bit_identical=None)


def test_a_job_mixing_gpu_and_cpu_nodes_is_refused_by_validation_naming_them(cluster, tmp_path):
    config = cluster.hosts_config("docker", 1, TRAIN, "eth0")
    config["nodes"][0]["gpus"] = 1
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump(config, sort_keys=False))
    for verb in ("check", "launch"):
        r = ddp(cluster, hosts, verb, timeout=60)
        assert r.returncode == 2, r.stderr
        assert "mixes GPU nodes (node1) and CPU nodes (node2, node3)" in r.stderr
    for h in cluster.hosts:
        assert containers_on(cluster, h.name) == []
