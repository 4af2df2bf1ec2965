"""hosts.yaml's field types: what a name, an address, a path, an image or a variable may be, and
the bounds of every count and duration (a hostile hosts.yaml cannot ask for a million nodes)."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field

from agent.contract import HEARTBEAT_DIR_ENV, HOLD_ENV, ON_STALL_ENV, SECRET_NAMES_ENV, STALL_RECORD_ENV, STALL_TIMEOUT_ENV

# Names end up in container names, file names and command lines: keep them boring.
_SAFE = re.compile(r"[A-Za-z0-9_.-]+")
_JOB = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
                       r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Paths reach remote shells (quoted) and `docker -v SRC:DST` (where ':' and ',' break).
_PATH = re.compile(r"[A-Za-z0-9_./+@=-]+")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@-]*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


# Upper bounds of the inventory's numbers. A value past one is a typo or a hostile file, never a
# fleet, and would otherwise be planned (argv and device lists that long, that many restarts) or
# waited on.
MAX_PER_NODE = 1024
"""Processes, GPUs, GPU ids and job.stages per node: the largest machines have 8 to 16 GPUs and a
few hundred cores; a process per core of such a machine stays within it."""
MAX_NODES = 16384
"""Nodes of a job (slurm.nodes, job.min_nodes): the largest clusters have about 10,000."""
MAX_RESTARTS = 1000
"""job.max_restarts: a job that has restarted that often is in a crash loop, not recovering."""
MAX_KEEP_RUNS = 10000
"""job.keep_runs: runs kept on the shared volume, each one listed by ``runs``."""
WEEK = 7 * 24 * 3600
"""The longest wait, in seconds (join_timeout, last_call_timeout, stall_timeout): a rendezvous or
a step that has not come in a week will not."""
MAX_CONNECT_TIMEOUT = 3600
"""ssh.connect_timeout: every call to a node that does not answer waits this long; an hour is gone."""
MAX_FREE_GB = 1_000_000
"""storage.min_free_gb: a petabyte; more (``.inf`` too) is a typo that fails every node's check."""
MAX_NUMBER = 4096
"""Characters of a YAML integer read at all: Python refuses to read one of over 4300 digits (an
error without the field's name). Shorter ones reach their field's own bound, which names it."""


def _safe_name(v: str) -> str:
    if not _SAFE.fullmatch(v):
        raise ValueError("only letters, digits, '_', '.' and '-' are allowed")
    return v


RESERVED_JOBS = ("code",)
"""Names of the tool's own directories beside the jobs' in <checkpoints>/.ddp-deploy (the code
store: codesync.STORE_SUBDIR): a job of that name would have its runs inside the store."""


def _job_name(v: str) -> str:
    if not _JOB.fullmatch(v):
        raise ValueError("lower-case letters, digits, '_', '.' and '-', starting with a letter or digit")
    if v in RESERVED_JOBS:
        raise ValueError(f"'{v}' is the name of the tool's own directory beside the jobs' (the code store); "
                         "choose another name")
    return v


def _address(v: str) -> str:
    try:
        ipaddress.ip_address(v)
        return v
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(v):
        raise ValueError("expected an IP address or a DNS name")
    return v


def _abs_path(v: str) -> str:
    if not v.startswith("/"):
        raise ValueError("expected an absolute path (starting with '/')")
    if not _PATH.fullmatch(v):
        raise ValueError("path may contain only letters, digits and '_./+@=-'")
    return v


def _path(v: str) -> str:
    if not _PATH.fullmatch(v):
        raise ValueError("path may contain only letters, digits and '_./+@=-'")
    return v


def local_path(v: str) -> str:
    if not v or any(ord(c) < 32 for c in v):
        raise ValueError("expected a file path without control characters")
    return v


def _image(v: str) -> str:
    if not _IMAGE.fullmatch(v):
        raise ValueError("expected an image reference like name:tag or registry/name:tag")
    return v


def _no_nul(v: str) -> str:
    if "\x00" in v:
        raise ValueError("NUL characters are not allowed")
    return v


# Set by the tool: GPU selection (nodes[].gpu_ids), the job's contract with its program (node name,
# directories, run id, device, code snapshot: docs/own-code.md), the marker `stop`
# finds a host run's processes by, the secrets' names the launcher masks. Overriding them would
# bypass what check verified or what stop and the program rely on.
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "DDP_NODE_NAME",
                "DDP_DEPLOY_RUN", "DDP_DATA_DIR", "DDP_CKPT_DIR", "DDP_RUN_ID", "DDP_DEVICE", "DDP_BACKEND", "DDP_STAGES",
                "DDP_CODE_SNAPSHOT", "DDP_LAUNCH_ID", "DDP_DEPLOY_LOG_DIR", "DDP_PROCS", HEARTBEAT_DIR_ENV, ON_STALL_ENV,
                STALL_TIMEOUT_ENV, STALL_RECORD_ENV, SECRET_NAMES_ENV, HOLD_ENV)


def identifier(v: str) -> str:
    if not ENV_NAME.fullmatch(v):
        raise ValueError("an environment variable name: letters, digits and '_', not starting with a digit")
    return v


def _env_name(v: str) -> str:
    identifier(v)
    if v in RESERVED_ENV:
        raise ValueError(f"{v} is set by the tool (GPUs: nodes[].gpu_ids; the rest: docs/own-code.md)")
    return v


def _module(v: str) -> str:
    if not _MODULE.fullmatch(v):
        raise ValueError("a Python module name, as for `python -m`: dotted identifiers like pkg.train")
    return v


def _script(v: str) -> str:
    _path(v)
    if v.startswith("-"):
        raise ValueError("a script path cannot start with '-'")
    return v


def _env_value(v: str) -> str:
    if any(ord(c) < 32 for c in v):
        raise ValueError("control characters (newlines, NUL, ...) are not allowed in an environment value")
    return v


def _stall_timeout(v):
    if v is None or v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= WEEK:
        raise ValueError("must be a number of seconds (more than 0, at most a week), auto or null")
    return float(v)


SafeName = Annotated[str, AfterValidator(_safe_name)]
JobName = Annotated[str, AfterValidator(_job_name)]
Address = Annotated[str, AfterValidator(_address)]
AbsPath = Annotated[str, AfterValidator(_abs_path)]
PathStr = Annotated[str, AfterValidator(_path)]
LocalPath = Annotated[str, AfterValidator(local_path)]
"""A path only ever opened on the operator's machine (never sent to a shell)."""
ImageRef = Annotated[str, AfterValidator(_image)]
StallTimeout = Annotated[object, BeforeValidator(_stall_timeout)]
Arg = Annotated[str, AfterValidator(_no_nul)]
EnvName = Annotated[str, AfterValidator(_env_name)]
EnvValue = Annotated[str, AfterValidator(_env_value)]
Port = Annotated[int, Field(ge=1, le=65535)]
GpuId = Annotated[int, Field(ge=0, lt=MAX_PER_NODE)]
ModuleName = Annotated[str, AfterValidator(_module)]
ScriptPath = Annotated[str, AfterValidator(_script)]
