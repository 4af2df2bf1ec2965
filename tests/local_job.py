"""A job on this machine (`connection: local`, the host runtime, the real trainer's or a program's
torchrun), its shared volume under the test's directory: the inventory the tests that run a job
write (:func:`local_hosts`), and where such a job keeps its parts."""

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


def inventory(nodes: list[dict], *, job: str, nas: Path | str = "/nas", job_fields: dict | None = None,
              **sections: dict) -> dict:
    """The one inventory the tests build, as data (JSON is YAML): ``nodes`` (the first hosts the
    rendezvous; none on Slurm, ``slurm={...}``), job ``job`` on the docker runtime unless ``job_fields`` says, data and checkpoints
    under ``nas``; ``sections``: fields merged into their section (``image={"name": "t:1"}``,
    ``ssh={"config": None}``, ``rendezvous={"port": 29400}``, ``train={...}``), or a list that is
    the section (``spares=[...]``)."""
    data = {
        "job": {"name": job, "runtime": "docker", **(job_fields or {})},
        **({"rendezvous": {"node": nodes[0]["name"]}, "nodes": nodes} if nodes else {}),
        "storage": {"data": {"host": f"{nas}/data", "container": "/data"},
                    "checkpoints": {"host": f"{nas}/ckpt", "container": "/ckpt"}},
    }
    for section, fields in sections.items():
        data[section] = {**data.get(section, {}), **fields} if isinstance(fields, dict) else fields
    return data


def on_paper(nodes: list[dict], *, job: str = "t", base_dir: Path | None = None, **fields):
    """:func:`inventory`, loaded: a fleet the unit tests plan for and never reach."""
    from deploy.inventory import loads

    return loads(json.dumps(inventory(nodes, job=job, **fields)), base_dir=base_dir)


def local_nodes(*names: str, **fields) -> list[dict]:
    """Nodes of this machine (``connection: local``), at 127.0.0.1, .2, ... in order."""
    return [{"name": n, "address": f"127.0.0.{i}", "connection": "local", **fields} for i, n in enumerate(names, 1)]


def local_hosts(tmp_path: Path, *, job: str, train: dict | None = None, procs: int = 1, name: str = "hosts.yaml",
                max_restarts: int = 0, interface: str | None = None, nodes: list[dict] | None = None,
                job_fields: dict | None = None, **sections: dict) -> Path:
    """:func:`inventory` of a job that runs here, written to ``tmp_path/name``: node ``here``
    (127.0.0.1, ``connection: local``, the host runtime), data and checkpoints under
    ``tmp_path/nas``; ``train``: the train section but for its python (this interpreter, unless it
    says); ``interface``: the node's NIC (None: found at launch); ``nodes``: the nodes instead of
    ``here`` (each local, ``procs`` processes, unless it says)."""
    listed = nodes or [{"name": "here", "address": "127.0.0.1", **({"interface": interface} if interface else {})}]
    runs_here = {"rendezvous": {"port": free_port(), "join_timeout": 60}, "storage": {"min_free_gb": 0.01},
                 "train": {"python": sys.executable, **(train or {})}}
    for section, fields in sections.items():
        runs_here[section] = {**runs_here.get(section, {}), **fields} if isinstance(fields, dict) else fields
    data = inventory([{"connection": "local", "procs": procs, **node} for node in listed], job=job,
                     nas=tmp_path / "nas", job_fields={"runtime": "host", "max_restarts": max_restarts,
                                                       **(job_fields or {})}, **runs_here)
    hosts = tmp_path / name
    hosts.write_text(json.dumps(data))
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
