"""The record of a launch, kept on the shared volume beside the job's run directories:
``<checkpoints.host>/.ddp-deploy/<job>/launch.json``. What ran (program, arguments, code snapshot,
image), where, when; secrets by name and source only, never their values."""

from __future__ import annotations

import json
import time

from . import secretenv
from .inventory import Inventory
from .payload import payload
from .plan import endpoint, nnodes
from .runtime import RUN_SUBDIR, CodeDir, runtime

# $1 = file. Writes stdin to it atomically (the directory is created).
WRITE_FILE = 'mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv "$1.tmp" "$1"'


def path(inv: Inventory) -> str:
    return f"{inv.storage.checkpoints.host}/{RUN_SUBDIR}/{inv.job.name}/launch.json"


def launch_record(inv: Inventory, code: CodeDir | None) -> dict:
    return {
        "time": round(time.time(), 3),
        "job": inv.job.name,
        "runtime": inv.job.runtime,
        "program": payload(inv).describe(),
        "args": list(inv.train.args),
        "code_snapshot": code.snapshot if code else None,
        "where": runtime(inv, code).where(),
        "rendezvous": {"node": inv.rdzv_node.name, "endpoint": endpoint(inv), "id": inv.rdzv_id},
        "nnodes": nnodes(inv),
        "nodes": [{"name": n.name, "address": n.address, "procs": n.nprocs, "gpus": list(n.devices)} for n in inv.nodes],
        "env": sorted({*inv.train.env, *(k for n in inv.nodes for k in n.env)}),
        "secrets": {name: secretenv.source(inv, name) for name in inv.train.secrets},
    }


def write_argv(inv: Inventory) -> tuple[str, ...]:
    return ("sh", "-c", WRITE_FILE, "sh", path(inv))


def encode(record: dict) -> bytes:
    return (json.dumps(record, indent=1) + "\n").encode()


def decode(text: str) -> dict | None:
    """A launch record read back, or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
