"""The record of a launch, kept on the shared volume with the run (deploy/job/runs.py: ``run.json``)
and as the job's current one (``<checkpoints.host>/.ddp-deploy/<job>/launch.json``): what ran
(program, arguments, code snapshot, image id), where, when, and the resolved hosts.yaml; secrets
by name and source only, never their values."""

from __future__ import annotations

import json
import time

from ..inventory import Inventory
from ..programs import node_program
from . import secretenv
from .payload import payload
from .plan import endpoint, nnodes, run_rdzv_id
from .runtime import RUN_SUBDIR, CodeDir, job_dir, runtime
from .scripts import TOOL_DIR

# stdin: the run's first step (first_step_line); first_step.sh has the arguments. Adds it to the
# run's record, once.
FIRST_STEP = TOOL_DIR + node_program("first_step.sh")

def path(inv: Inventory) -> str:
    return f"{job_dir(inv)}/launch.json"


def _fleet(inv: Inventory, run: str | None) -> dict:
    return {"rendezvous": {"node": inv.rdzv_node.name, "endpoint": endpoint(inv),
                           "id": inv.rdzv_id if run is None else run_rdzv_id(inv, run)},
            "nnodes": nnodes(inv),
            "nodes": [{"name": n.name, "address": n.address, "procs": n.nprocs, "gpus": list(n.devices)}
                      for n in inv.nodes]}


def _slurm(inv: Inventory) -> dict:
    """On Slurm the nodes are the allocation's: known once it runs (``runs`` reads them from the run)."""
    nodes, procs, gpus = inv.shape
    return {"rendezvous": {"node": None, "endpoint": f"the allocation's first node:{inv.rendezvous.port}",
                           "id": inv.rdzv_id},
            "nnodes": str(nodes), "nodes": [], "slurm": {"procs_per_node": procs, "gpus_per_node": gpus,
                                                         "login": inv.slurm.login.address}}


def launch_record(inv: Inventory, code: CodeDir | None, run: str | None = None, image_id: str | None = None,
                  redact=str, launch_phases: dict[str, float] | None = None) -> dict:
    """``redact`` hides every secret value this shell can read in the resolved hosts.yaml (an
    environment value that happens to hold one); ``launch_phases``: the seconds of each part of
    ``launch`` before the record is written (deploy/job/phases.py)."""
    return {
        "run": run,
        "time": round(time.time(), 3),
        "job": inv.job.name,
        "runtime": inv.job.runtime,
        "program": payload(inv).describe(),
        "args": list(inv.train.args),
        "code_snapshot": code.snapshot if code else None,
        "where": runtime(inv, code).where(),
        **(_fleet(inv, run) if inv.slurm is None else _slurm(inv)),
        "env": sorted({*inv.train.env, *(k for n in inv.nodes for k in n.env)}),
        "secrets": {name: secretenv.source(inv, name) for name in inv.train.secrets},
        "image": {"name": inv.image.name, "id": image_id} if image_id else None,  # None: no image (host)
        "hosts_yaml": redacted(inv.model_dump(mode="json"), redact),
        "launch_phases": launch_phases or {},
    }


def first_step_argv(inv: Inventory, run: str) -> tuple[str, ...]:
    """Adds ``first_step`` (deploy/job/phases.py FirstStep) to run ``run``'s record, where the
    record was written (as ``launch`` writes it: the tool's own user)."""
    return ("sh", "-c", FIRST_STEP, "sh", inv.storage.checkpoints.host, RUN_SUBDIR, inv.job.name, run)


def first_step_line(found: dict) -> bytes:
    """What :data:`FIRST_STEP` reads: the first step as one line of JSON."""
    return (json.dumps(found) + "\n").encode()


def keep_first_step(inv: Inventory, remote, reader: str, run: str, found: dict, warn) -> None:
    """Keeps the first step in run ``run``'s record, written on node ``reader``; not fatal: the job
    runs on without it, and ``warn`` says so."""
    done = remote.run({reader: first_step_argv(inv, run)}, stdin={reader: first_step_line(found)}, check=False,
                      timeout=60)[reader]
    if not done.ok:
        warn(f"{reader}: the first step was not kept in the record of run {run}: {done.summary()}")


def redacted(value, redact):
    """``value`` (JSON data) with every string passed through ``redact``."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redacted(v, redact) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(v, redact) for v in value]
    return value


def encode(record: dict) -> bytes:
    return (json.dumps(record, indent=1) + "\n").encode()


def decode(text: str) -> dict | None:
    """A launch record read back, or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
