"""A one-node job on this machine (`connection: local`, the host runtime, the real trainer's or a
program's torchrun), its shared volume under the test's directory: the inventory the real CLI
tests write."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fakes import free_port


def beats_dir(hosts: Path, node: str = "here") -> str:
    """Where the job of ``hosts`` keeps node ``node``'s heartbeats (deploy/job/runtime.py)."""
    from deploy.inventory import load
    from deploy.job.runtime import heartbeat_dir

    inv = load(hosts)
    return heartbeat_dir(inv, inv.node(node))


def local_hosts(tmp_path: Path, *, job: str, train: dict, procs: int = 1, name: str = "hosts.yaml",
                max_restarts: int = 0, interface: str | None = None) -> Path:
    """hosts.yaml in ``tmp_path`` for node ``here`` (127.0.0.1), data and checkpoints under
    ``tmp_path/nas``; ``train``: the train section but for its python (this interpreter);
    ``interface``: the node's NIC (None: found at launch)."""
    hosts = tmp_path / name
    hosts.write_text(json.dumps({  # JSON is YAML
        "job": {"name": job, "runtime": "host", "max_restarts": max_restarts},
        "rendezvous": {"node": "here", "port": free_port(), "join_timeout": 60},
        "nodes": [{"name": "here", "address": "127.0.0.1", "connection": "local", "procs": procs,
                   **({"interface": interface} if interface else {})}],
        "storage": {"data": {"host": str(tmp_path / "nas/data"), "container": "/data"},
                    "checkpoints": {"host": str(tmp_path / "nas/ckpt"), "container": "/ckpt"},
                    "min_free_gb": 0.01},
        "train": {"python": sys.executable, **train},
    }))
    return hosts


def kept_run(tmp_path: Path, *, job: str, run: str, program: str) -> tuple[Path, Path]:
    """hosts.yaml for node ``here`` whose shared volume (``tmp_path/nas``) keeps run ``run`` of
    ``program``, nothing in it yet but its record: the inventory and the node's directory of the run
    (where its ``log`` and ``exits`` go)."""
    hosts = local_hosts(tmp_path, job=job, train={"script": "train.py"})
    kept = tmp_path / "nas/ckpt/.ddp-deploy" / job / "runs" / run / "here"
    kept.mkdir(parents=True)
    (kept.parent / "run.json").write_text(json.dumps({"program": program}))
    return hosts, kept
