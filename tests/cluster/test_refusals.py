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

from .operator_cli import containers_on, ddp

pytestmark = pytest.mark.cluster

TRAIN = ["--dataset", "synthetic", "--synthetic-size", "1536", "--batch-size", "32", "--epochs", "1"]


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
def _gpus_declared(cluster, config, tmp_path):
    config["nodes"][1]["gpus"] = 2
    yield


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
    "no gpu where declared": (_gpus_declared, "node2", "gpus", "nvidia-smi failed"),
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
