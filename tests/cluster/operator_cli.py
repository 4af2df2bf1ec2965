"""What the cluster tests do as the operator (the deploy CLI) and look at on the hosts directly.

The tool is always driven through ``python -m deploy`` like a person would; the assertions read
the nodes' own Docker daemons and the NAS files, so the tool never vouches for itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from waiting import wait_until  # noqa: F401 (the cluster tests import it from here)

REPO = Path(__file__).resolve().parents[2]


def _operator_env(cluster, hosts: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    # the cluster's own image cache, unless the test chose one; ``env``: the test's own on top
    return {"DDP_DEPLOY_IMAGE_CACHE": cluster.operator_cache_dir, **os.environ, "DOCKER_HOST": cluster.operator_docker_host,
            "DDP_DEPLOY_LOG": str(hosts.parent / "deploy-debug.log"), "COLUMNS": "200", **(env or {})}


def ddp(cluster, hosts: Path, *args: str, timeout: float = 600,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy", "--hosts", str(hosts), *args], cwd=REPO,
                          env=_operator_env(cluster, hosts, env), capture_output=True, text=True, timeout=timeout)


def start_ddp(cluster, hosts: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``ddp`` in the background, for operators acting at the same moment: ``communicate()`` it."""
    return subprocess.Popen([sys.executable, "-m", "deploy", "--hosts", str(hosts), *args], cwd=REPO,
                            env=_operator_env(cluster, hosts, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def image_id_on(cluster, node: str, image: str) -> str | None:
    r = cluster.run_on(node, ["docker", "image", "inspect", "--format", "{{.Id}}", image])
    return r.stdout.strip() if r.returncode == 0 else None


def container_of(hosts: Path, node: str) -> str:
    """The name of the job's container on ``node``, as the tool names it for that hosts.yaml."""
    from deploy.inventory import load
    from deploy.job.runtime import runtime

    inv = load(hosts)
    return runtime(inv).container(inv.node(node))  # a spare's too


def containers_on(cluster, node: str) -> list[str]:
    r = cluster.run_on(node, ["docker", "ps", "-a", "--format", "{{.Names}}"], check=True)
    return r.stdout.split()


def trainer_processes_on(cluster, node: str) -> list[str]:
    """The trainer's processes (launcher, torchrun's workers) left on ``node``: those in its network
    namespace, read from /proc. The nodes share this machine's pids, so a plain ``pgrep`` would also
    find the trainers other tests run here at the same time (``make test`` runs two lanes)."""
    netns = os.stat(f"/var/run/netns/{cluster.host(node).ns}").st_ino
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.stat(proc / "ns" / "net").st_ino != netns:
                continue
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # ended meanwhile
            continue
        line = " ".join(argv)
        if "agent.launch" in line or "-m trainer" in line:
            found.append(f"{proc.name} {line.strip()}")
    return found


def records(nas: Path) -> list[dict]:
    """The trainer's records in metrics.jsonl, each line that is one whole JSON object: a line is
    torn where rank 0 was killed while it wrote it (a SIGKILL ends a write between pages), or
    still being written as it is read (the rendezvous node's container killed mid-epoch:
    ``Unterminated string``)."""
    path = nas / "ckpt" / "metrics.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def complete_checkpoint_steps(nas: Path) -> list[int]:
    """Steps of the checkpoints whose completion marker exists, oldest first."""
    return sorted(int(p.name[len("ckpt-"):-len(".pt.ok")]) for p in (nas / "ckpt").glob("ckpt-*.pt.ok"))


def node_states(cluster, hosts: Path) -> dict[str, str]:
    """``status --json`` as {node: state}; status exits 0 even while a node is unreachable."""
    return {s["node"]: s["state"] for s in json.loads(ok(ddp(cluster, hosts, "status", "--json")).stdout)}


def empty_nas(nas: Path) -> None:
    """data/ and ckpt/ empty and owned by uid 1000, as the fixture made them."""
    for sub in ("data", "ckpt"):
        subprocess.run(["rm", "-rf", str(nas / sub)], check=True)
        (nas / sub).mkdir()
        os.chown(nas / sub, 1000, 1000)
