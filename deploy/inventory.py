"""hosts.yaml -> frozen, validated objects. The only module that knows the YAML layout.

``load(path)`` returns an :class:`Inventory` or raises :class:`InventoryError` whose
issues name the file, the field path (``nodes[2].address``), the YAML line and what is
expected. Nothing here opens a connection.
"""

from __future__ import annotations

import os

import ipaddress
import re
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from trainer.heartbeat import HEARTBEAT_DIR_ENV, ON_STALL_ENV, STALL_RECORD_ENV, STALL_TIMEOUT_ENV
from trainer.masking import SECRET_NAMES_ENV

from .errors import Issue, InventoryError

# Names end up in container names, file names and command lines: keep them boring.
_SAFE = re.compile(r"[A-Za-z0-9_.-]+")
_JOB = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
                       r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Paths reach remote shells (quoted) and `docker -v SRC:DST` (where ':' and ',' break).
_PATH = re.compile(r"[A-Za-z0-9_./+@=-]+")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
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


def _local_path(v: str) -> str:
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
                STALL_TIMEOUT_ENV, STALL_RECORD_ENV, SECRET_NAMES_ENV)


def _identifier(v: str) -> str:
    if not _ENV_NAME.fullmatch(v):
        raise ValueError("an environment variable name: letters, digits and '_', not starting with a digit")
    return v


def _env_name(v: str) -> str:
    _identifier(v)
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
LocalPath = Annotated[str, AfterValidator(_local_path)]
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


class _Model(BaseModel):
    # defer_build: each model's validator is built when the first inventory is read (_build_models),
    # not when this module is imported: a command that reads none (--help) does not pay for it.
    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True, defer_build=True)


class Job(_Model):
    name: JobName
    """Container name prefix and default rendezvous id."""
    runtime: Literal["docker", "host"] = "docker"
    """docker: one container per node; host: torchrun straight on the node."""
    max_restarts: int = Field(default=3, ge=0, le=MAX_RESTARTS)
    """torchrun --max-restarts; with docker, also how often a node's container is started again
    after its torchrun died (``--restart on-failure:N``), so a killed node rejoins the job."""
    min_nodes: int | None = Field(default=None, ge=1, le=MAX_NODES)
    """The fewest nodes the job may train on (torchrun ``--nnodes MIN:MAX``). A node lost for good
    then costs a rendezvous round, not the job: the others go on without it from the newest
    checkpoint, and take it in again when it is back (or ``ddp-deploy join`` starts it). The
    most is every node listed, those left out with --without too. None: every node."""
    stall_timeout: StallTimeout = "auto"
    """Seconds without progress on a node (no rank's step moved; without heartbeats, no output)
    before ``status`` and ``launch --wait`` call it stalled. ``auto``: ten times the longest
    interval the ranks' heartbeats have shown, at least 300 s (a program without heartbeats: 1800 s
    of silence); ``null``: never (docs/failures.md, "When a job hangs")."""
    on_stall: Literal["report", "restart", "stop"] = "report"
    """What a stalled node does: ``report`` (status and launch --wait say so); ``restart``: the
    node's launcher kills its workers and torchrun starts them again from the newest checkpoint,
    counted against max_restarts; ``stop``: it kills its workers and ends the node's part of the
    job, nothing started again. Each stall is kept with the run, with the stacks the ranks were in
    (docs/failures.md, "When a job hangs")."""
    stages: int = Field(default=1, ge=1, le=MAX_PER_NODE)
    """Devices per process (model parallelism): the built-in trainer splits its model into this
    many stages (``--stages``), a program of your own reads ``DDP_STAGES``. On a GPU node each
    process gets this many of the node's GPUs, in order (gpus: 8 and stages: 2 run 4 processes);
    on a CPU node the stages share the CPU."""
    keep_runs: int = Field(default=20, ge=1, le=MAX_KEEP_RUNS)
    """How many runs ``launch`` keeps on the shared volume (their logs, records, exit codes and
    TensorBoard files; ``ddp-deploy runs``): the oldest beyond it are removed, never the new one."""


    @model_validator(mode="after")
    def _restart_needs_room(self) -> "Job":
        if self.on_stall == "restart" and self.max_restarts < 1:
            raise ValueError("job.on_stall: restart starts the workers again, which job.max_restarts 0 forbids; "
                             "set max_restarts to 1 or more, or on_stall: report")
        if self.on_stall != "report" and self.stall_timeout is None:
            raise ValueError(f"job.on_stall: {self.on_stall} needs a stall to act on; job.stall_timeout is null")
        return self


class Rendezvous(_Model):
    node: SafeName | None = None
    """Name of the node that hosts the c10d store (must be in nodes; required with nodes). On
    Slurm: none, the allocation's first node hosts it."""
    port: Port = 29400
    id: SafeName | None = None
    """Rendezvous id; defaults to job.name."""
    join_timeout: int = Field(default=600, ge=1, le=WEEK)
    """Seconds torchrun waits for all nodes (--rdzv-conf join_timeout=)."""
    last_call_timeout: int | None = Field(default=None, ge=1, le=WEEK)
    """Elastic jobs (job.min_nodes): once min_nodes are in a round, how long it still waits for
    more (--rdzv-conf last_call_timeout=). It must end before join_timeout does, or a round
    without a lost node times out; default: a third of join_timeout, at most 30 s."""

    def last_call(self) -> int:
        return self.last_call_timeout or max(1, min(30, self.join_timeout // 3))


class SshOverrides(_Model):
    host: Address | None = None
    """Where SSH connects for this node, if not ``address`` (which stays the node's address for
    the rendezvous and the NIC): a DNS name, an IP, or a Host alias of ``ssh.config``."""
    user: SafeName | None = None
    port: Port | None = None
    key: LocalPath | None = None
    known_hosts: LocalPath | None = None
    host_key_policy: Literal["strict", "accept-new"] | None = None
    connect_timeout: int | None = Field(default=None, ge=1, le=MAX_CONNECT_TIMEOUT)


class Ssh(_Model):
    """SSH defaults for every node. Keys or the agent only: there is no password field."""

    user: SafeName = "root"
    port: Port = 22
    key: LocalPath | None = "~/.ssh/id_ed25519"
    """Private key file on the operator's machine; null = ssh-agent only."""
    known_hosts: LocalPath = "~/.ssh/known_hosts"
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    """strict: unknown or changed host keys are refused; accept-new: record unknown ones."""
    connect_timeout: int = Field(default=10, ge=1, le=MAX_CONNECT_TIMEOUT)
    """Seconds a node may stay silent: to connect, and once connected, to answer a keepalive."""
    config: LocalPath | None = "~/.ssh/config"
    """OpenSSH client config read for each node's ssh host (Host aliases: HostName, User, Port,
    IdentityFile, ProxyJump, ProxyCommand, ConnectTimeout, ServerAlive*); user, port, key and
    connect_timeout written in hosts.yaml win over it; a missing file is none; null: not read."""

    def merged(self, over: SshOverrides | None) -> "Ssh":
        if over is None:
            return self
        return self.model_copy(update=over.model_dump(exclude_none=True, exclude={"host"}))


Env = dict[EnvName, EnvValue]


class Node(_Model):
    name: SafeName
    address: Address
    connection: Literal["ssh", "local"] = "ssh"
    """ssh, or local: run on this machine without SSH (like ansible_connection=local)."""
    gpus: int = Field(default=0, ge=0, le=MAX_PER_NODE)
    """0 = CPU node (gloo); >0: a GPU node (CUDA + NCCL), nvidia-smi must list at least that many."""
    procs: int | None = Field(default=None, ge=1, le=MAX_PER_NODE)
    """Processes on this node; defaults to len(gpu_ids), else gpus, or 1 on a CPU node (divided by
    job.stages: each process then has that many GPUs)."""
    gpu_ids: Annotated[tuple[GpuId, ...], Field(max_length=MAX_PER_NODE)] | None = None
    """GPU indices (as nvidia-smi numbers them) this job uses, one per process (job.stages per
    process, in order); default: the first ``procs`` (x stages) GPUs."""
    interface: SafeName | None = None
    """NIC for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME."""
    env: Env = Field(default_factory=dict)
    """Extra environment for this node's processes (NCCL settings, ...); overrides train.env."""
    ssh: SshOverrides | None = None

    _stages: int = PrivateAttr(default=1)
    """job.stages, given by the inventory that holds the node: GPUs per process."""

    @property
    def nprocs(self) -> int:
        if self.procs is not None:
            return self.procs
        if self.gpu_ids:
            return max(1, len(self.gpu_ids) // self._stages)
        return max(1, self.gpus // self._stages)

    @property
    def devices(self) -> tuple[int, ...]:
        """The GPU indices this node's processes use (local rank i -> devices[i*stages:(i+1)*stages]);
        empty on a CPU node."""
        if self.gpus == 0:
            return ()
        return self.gpu_ids if self.gpu_ids else tuple(range(self.nprocs * self._stages))


_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")


def _slurm_time(v: str) -> str:
    if not _SLURM_TIME.fullmatch(v):
        raise ValueError("a Slurm time limit: MINUTES, HH:MM:SS or DAYS-HH:MM:SS")
    return v


def _sbatch_option(v: str) -> str:
    if not v.startswith("--") or any(ord(c) < 32 for c in v):
        raise ValueError("an sbatch long option on one line, like --constraint=a100")
    return v


class SlurmLogin(_Model):
    """Where the tool runs sbatch, squeue, scancel: a login node, reached as nodes are (SSH or local)."""

    name: SafeName = "login"
    address: Address
    connection: Literal["ssh", "local"] = "ssh"
    ssh: SshOverrides | None = None


class SlurmContainer(_Model):
    """The container route of Slurm sites, for job.runtime docker (rendered; docs/slurm-kubernetes.md)."""

    kind: Literal["pyxis", "apptainer"]
    """pyxis: ``srun --container-image`` (enroot); apptainer: ``apptainer exec`` on each node."""
    image: Annotated[str, AfterValidator(_local_path)]
    """What the site's runtime opens: for pyxis an image reference or a .sqsh file, for apptainer
    a .sif file or a ``docker://`` reference."""


class Slurm(_Model):
    """Run the job on a Slurm cluster (instead of nodes): sbatch on the login node, one torchrun per
    allocated node started by srun, the rendezvous on the allocation's first node."""

    login: SlurmLogin
    nodes: int = Field(ge=1, le=MAX_NODES)
    """How many nodes to allocate (sbatch --nodes)."""
    procs_per_node: int | None = Field(default=None, ge=1, le=MAX_PER_NODE)
    """Processes per node; default: gpus_per_node, or 1 without GPUs."""
    gpus_per_node: int = Field(default=0, ge=0, le=MAX_PER_NODE)
    """GPUs per node (sbatch --gpus-per-node); 0: a CPU job (gloo)."""
    partition: SafeName | None = None
    account: SafeName | None = None
    qos: SafeName | None = None
    time: Annotated[str, AfterValidator(_slurm_time)] | None = None
    """The job's time limit (sbatch --time)."""
    requeue: bool = True
    """Slurm may requeue the job when it is preempted or its node fails; it resumes from the newest
    checkpoint like any restart."""
    sbatch_args: tuple[Annotated[str, AfterValidator(_sbatch_option)], ...] = ()
    """More sbatch options, each one ``--name=value`` (``--constraint=a100``, ``--exclusive``)."""
    container: SlurmContainer | None = None
    """job.runtime docker: the site's container runtime and the image it opens."""

    _stages: int = PrivateAttr(default=1)
    """job.stages, given by the inventory: GPUs per process."""

    @property
    def nprocs(self) -> int:
        return self.procs_per_node or max(1, self.gpus_per_node // self._stages)


class Image(_Model):
    name: ImageRef = "ddp-trainer:latest"
    dockerfile: LocalPath = "Dockerfile"
    context: LocalPath = "."
    """Build context, relative to the directory of hosts.yaml."""
    build_args: dict[SafeName, Arg] = Field(default_factory=dict)
    compress: bool = False
    """gzip -1 in the save|load pipe (slower on a fast link, see FIELD_NOTES)."""
    transfer: Literal["auto", "star", "chain", "registry"] = "auto"
    """How the image reaches the nodes (deploy/images/delivery.py): ``star`` (one copy from here per
    node), ``chain`` (one copy from here; each node forwards it to the next), ``registry``
    (push once, every node pulls). ``auto``: registry when ``name`` names one, star when
    ``compress`` is set, else chain."""
    stall_seconds: float = Field(default=10, gt=0, le=600)
    """Chain: a node that takes no data for this long is passed over (its upstream forwards to
    the next node instead) and reported."""

    @property
    def registry(self) -> str | None:
        """The registry host ``name`` names (Docker's rule: a first path part with a dot or a
        colon, or ``localhost``), else None."""
        first, sep, _ = self.name.partition("/")
        return first if sep and ("." in first or ":" in first or first == "localhost") else None

    @property
    def delivery(self) -> str:
        if self.transfer != "auto":
            return self.transfer
        return "registry" if self.registry else "star" if self.compress else "chain"

    @model_validator(mode="after")
    def _registry_named(self) -> "Image":
        if self.transfer == "registry" and not self.registry:
            raise ValueError("image.transfer: registry needs image.name to name the registry "
                             "(registry.example.com:5000/ddp-trainer:latest)")
        if self.compress and self.transfer in ("chain", "registry"):
            raise ValueError(f"image.compress applies to transfer: star only (the {self.transfer} sends "
                             "the image as it is); drop compress or use transfer: star")
        return self

    @field_validator("build_args")
    @classmethod
    def _env_like_keys(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not _ENV_NAME.fullmatch(k):
                raise ValueError(f"build arg name {k!r} must look like an identifier")
        return v


class Mount(_Model):
    host: AbsPath
    container: AbsPath


class Storage(_Model):
    data: Mount
    checkpoints: Mount
    min_free_gb: float = Field(default=1, ge=0, le=MAX_FREE_GB)


# Chosen by the tool: the device and backend from nodes[].gpus, so that a GPU node never trains on
# the CPU; the stages from job.stages, which also lays out each node's GPUs.
_BY_GPUS = "cuda + nccl on GPU nodes (nodes[].gpus > 0), cpu + gloo on CPU nodes"
TOOL_FLAGS = {"--device": _BY_GPUS, "--backend": _BY_GPUS,
              "--stages": "from job.stages, which also gives each process that many of a node's GPUs"}


class Secret(_Model):
    """Where the operator's machine reads a secret at launch: never written in hosts.yaml, never
    printed (shown as ``***``), sent to the nodes over SSH's stdin, not on any command line."""

    env: Annotated[str, AfterValidator(_identifier)] | None = None
    """A variable of the operator's environment."""
    file: LocalPath | None = None
    """A file on the operator's machine (relative to hosts.yaml's directory); one trailing newline
    is dropped."""

    @model_validator(mode="after")
    def _one_source(self) -> "Secret":
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env: (an operator's environment variable) or file: (a path)")
        return self


class Code(_Model):
    """A local directory synced to the shared volume as a snapshot and used as the working directory."""

    path: LocalPath
    """The project directory on the operator's machine, relative to hosts.yaml's directory."""
    ignore: tuple[Arg, ...] = ()
    """gitignore-style patterns left out, on top of the project's .gitignore files and .git/."""


class Train(_Model):
    python: PathStr = "python3"
    """Host runtime: interpreter on the nodes that has this package installed. A
    relative path containing '/' is resolved against the directory of hosts.yaml."""
    module: ModuleName | None = None
    """The program, run as ``python -m MODULE`` by torchrun; default: the built-in trainer."""
    script: ScriptPath | None = None
    """Or a script path (relative to the working directory: the code snapshot, or the image's WORKDIR)."""
    args: tuple[Arg, ...] = ()
    """The program's arguments. The built-in trainer gets --data-dir/--ckpt-dir, --device and
    --backend from the tool first, then these, checked with its own parser before any connection;
    a module or script gets these alone, as they are, and reads DDP_DATA_DIR, DDP_CKPT_DIR,
    DDP_DEVICE, DDP_BACKEND and DDP_STAGES from its environment."""
    env: Env = Field(default_factory=dict)
    """Extra environment for every node's processes; nodes[].env overrides it per node. Shown by
    --dry-run: not for secrets (see secrets)."""
    secrets: dict[EnvName, Secret] = Field(default_factory=dict)
    """Environment variables whose values come from the operator's environment or a file."""
    code: Code | None = None
    """Sync this local directory as the job's working directory; none: the code is in the image
    (docker) or installed for train.python (host)."""
    spawn: bool = False
    """The program starts its own workers (``mp.spawn``, ``start_processes``): torchrun runs one
    process per node, which starts ``DDP_PROCS`` workers (the node's procs) with every GPU of the
    node visible; its node's rank is torchrun's ``GROUP_RANK``, the node count ``GROUP_WORLD_SIZE``
    (docs/own-code.md, "A program that starts its own workers")."""

    @field_validator("python")
    @classmethod
    def _interpreter(cls, v: str) -> str:
        # It heads a command line that `env NAME=VALUE ...` may precede: env reads a word with '='
        # as one more assignment and a leading '-' as its own option, and runs something else.
        if "=" in v or v.startswith("-"):
            raise ValueError("an interpreter path can neither contain '=' nor start with '-' "
                             "(env would read it as a variable or an option); give the path of the python to run")
        return v

    @field_validator("code", mode="before")
    @classmethod
    def _code_shorthand(cls, v):
        return {"path": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one_program(self) -> "Train":
        if self.module is not None and self.script is not None:
            raise ValueError("give train.module or train.script, not both")
        if self.spawn and self.builtin:
            raise ValueError("train.spawn: the built-in trainer does not start its own workers; "
                             "set train.module or train.script, or leave spawn out")
        return self

    @property
    def builtin(self) -> bool:
        """The built-in trainer is the program (no module or script given)."""
        return self.module is None and self.script is None

    @field_validator("args")
    @classmethod
    def _no_tool_flags(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for arg in v:
            flag = arg.split("=", 1)[0]
            if flag in TOOL_FLAGS:
                raise ValueError(f"{flag} is set by the tool: {TOOL_FLAGS[flag]}")
        return v


class Inventory(_Model):
    job: Job
    rendezvous: Rendezvous = Field(default_factory=Rendezvous)
    ssh: Ssh = Field(default_factory=Ssh)
    nodes: Annotated[tuple[Node, ...], Field(max_length=MAX_NODES)] = ()
    """The SSH fleet; or slurm: instead."""
    slurm: Slurm | None = None
    image: Image = Field(default_factory=Image)
    storage: Storage
    train: Train = Field(default_factory=Train)

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _listed: int | None = PrivateAttr(default=None)
    """How many nodes hosts.yaml lists, when some are left out (--without)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> "Inventory":
        for part in (*self.nodes, *([self.slurm] if self.slurm else [])):
            part._stages = self.job.stages
        problems = cross_field_problems(self)
        if problems:
            raise _CrossFieldProblems(problems)
        return self

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @property
    def rdzv_id(self) -> str:
        return self.rendezvous.id or self.job.name

    @property
    def rdzv_node(self) -> Node:
        return next(n for n in self.nodes if n.name == self.rendezvous.node)

    def node(self, name: str) -> Node:
        """A node by name; on Slurm, the login node is the one the tool talks to."""
        if self.slurm is not None and name == self.slurm.login.name:
            return self.slurm.login  # type: ignore[return-value]  (the fields a transport reads)
        return next(n for n in self.nodes if n.name == name)

    @property
    def gpu_job(self) -> bool:
        """The job trains on GPUs (CUDA + NCCL); validation refuses a fleet that mixes GPU and CPU nodes."""
        if self.slurm is not None:
            return self.slurm.gpus_per_node > 0
        return any(n.gpus > 0 for n in self.nodes)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(nodes, processes per node, GPUs per node) of the job; on a fleet, its first node's."""
        if self.slurm is not None:
            return self.slurm.nodes, self.slurm.nprocs, self.slurm.gpus_per_node
        first = self.nodes[0]
        return len(self.nodes), first.nprocs, len(first.devices)

    @property
    def listed(self) -> int:
        """How many nodes hosts.yaml lists, those left out with --without included: an elastic
        job's most nodes, so that a node left out can join it later (``ddp-deploy join``)."""
        return self._listed or len(self.nodes)

    @property
    def elastic(self) -> bool:
        """The job may run on fewer nodes than listed (job.min_nodes)."""
        return self.job.min_nodes is not None and self.job.min_nodes < self.listed

    def without(self, names: Iterable[str]) -> "Inventory":
        """This inventory minus ``names`` (nodes lost for good): the job runs on the others; if
        the rendezvous node is among them, the first remaining node hosts the rendezvous."""
        names = set(names)
        self.check_names("--without", names)
        kept = tuple(n for n in self.nodes if n.name not in names)
        floor = self.job.min_nodes or 1
        if len(kept) < floor:
            raise InventoryError([Issue("--without", "", None, f"leaves {len(kept)} node(s), fewer than "
                                                               f"job.min_nodes ({floor})")])
        node = self.rendezvous.node if self.rendezvous.node not in names else kept[0].name
        return self._reshaped(kept, node)

    def hosting_rendezvous_on(self, name: str) -> "Inventory":
        """This inventory with the rendezvous on ``name`` (where a running job has it)."""
        self.check_names("rendezvous", {name})
        return self._reshaped(self.nodes, name)

    def check_names(self, field: str, names: set[str]) -> None:
        """Raises InventoryError (exit 2) naming any of ``names`` that is not a node here."""
        unknown = sorted(names - {n.name for n in self.nodes})
        if unknown:
            raise InventoryError([Issue(field, "", None, f"{', '.join(unknown)}: not in nodes[].name "
                                                         f"({', '.join(n.name for n in self.nodes)})")])

    def _reshaped(self, nodes: tuple[Node, ...], rendezvous_node: str) -> "Inventory":
        rendezvous = self.rendezvous.model_copy(update={"node": rendezvous_node})
        other = self.model_copy(update={"nodes": nodes, "rendezvous": rendezvous})
        other._base_dir, other._listed = self._base_dir, self.listed
        return other

    def ssh_for(self, node: Node) -> Ssh:
        return self.ssh.merged(node.ssh)

    def python_path(self) -> str:
        p = self.train.python
        if "/" in p and not p.startswith("/"):
            return os.path.normpath(self._base_dir / p)  # no resolve(): a venv's python is a symlink
        return p

    def context_path(self) -> Path:
        return (self._base_dir / self.image.context).resolve()

    def dockerfile_path(self) -> Path:
        """Relative to the build context, as in docker compose."""
        return (self.context_path() / self.image.dockerfile).resolve()


class _CrossFieldProblems(Exception):
    """Not a ValueError on purpose: pydantic lets it through with its field paths intact."""

    def __init__(self, problems: list[tuple[tuple, str]]):
        super().__init__(problems)
        self.problems = problems


def cross_field_problems(inv: Inventory) -> list[tuple[tuple, str]]:
    """Rules that span several fields, as (field path, message) pairs."""
    out: list[tuple[tuple, str]] = []
    names = Counter(n.name for n in inv.nodes)
    pairs = Counter((n.address, n.connection) for n in inv.nodes)
    seen_names: set[str] = set()
    seen_pairs: set[tuple[str, str]] = set()
    for i, n in enumerate(inv.nodes):
        if names[n.name] > 1 and n.name in seen_names:
            out.append((("nodes", i, "name"), f"duplicate node name {n.name!r}"))
        seen_names.add(n.name)
        pair = (n.address, n.connection)
        if pairs[pair] > 1 and pair in seen_pairs:
            out.append((("nodes", i, "address"),
                        f"duplicate address {n.address!r} (connection {n.connection}); each node needs its own host"))
        seen_pairs.add(pair)
        out += _layout_problems(n, i, inv.job.stages)
    gpu = [n.name for n in inv.nodes if n.gpus > 0]
    cpu = [n.name for n in inv.nodes if n.gpus == 0]
    if gpu and cpu:
        out.append((("nodes",), f"mixes GPU nodes ({', '.join(gpu)}) and CPU nodes ({', '.join(cpu)}): their "
                                "ranks would pick different backends (nccl, gloo) and hang; give every node "
                                "gpus > 0, or every node gpus: 0"))
    out += _train_problems(inv.train, [n.env for n in inv.nodes], inv.job.stages)
    if inv.slurm is not None:
        return out + _slurm_problems(inv)
    if not inv.nodes:
        out.append((("nodes",), "required: the nodes to run on (or slurm: to run on a Slurm cluster)"))
        return out
    if inv.rendezvous.node is None:
        out.append((("rendezvous", "node"), "required: the name of the node that hosts the rendezvous"))
    elif inv.rendezvous.node not in names:
        out.append((("rendezvous", "node"),
                    f"{inv.rendezvous.node!r} is not one of nodes[].name ({', '.join(names)})"))
    if inv.job.min_nodes is not None and inv.job.min_nodes > len(inv.nodes):
        out.append((("job", "min_nodes"), f"{inv.job.min_nodes} is more than the {len(inv.nodes)} nodes listed"))
    procs = {n.nprocs for n in inv.nodes}
    if inv.train.spawn and len(procs) > 1:
        out.append((("train", "spawn"), f"the nodes run {', '.join(map(str, sorted(procs)))} processes: a program "
                    "that starts its own workers counts its ranks as GROUP_RANK x DDP_PROCS + i, one DDP_PROCS "
                    "on every node; give every node the same procs"))
    if inv.rendezvous.last_call() >= inv.rendezvous.join_timeout:
        out.append((("rendezvous", "last_call_timeout"), f"{inv.rendezvous.last_call()} must be less than "
                    f"join_timeout ({inv.rendezvous.join_timeout}): a round of fewer nodes would time out first"))
    return out


def _slurm_problems(inv: Inventory) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    s = inv.slurm
    if inv.nodes:
        out.append((("nodes",), "give nodes (an SSH fleet) or slurm (a Slurm cluster), not both"))
    if inv.rendezvous.node is not None:
        out.append((("rendezvous", "node"), "not on Slurm: the allocation's first node hosts the rendezvous"))
    k = inv.job.stages
    if s.gpus_per_node and s.procs_per_node and s.procs_per_node * k > s.gpus_per_node:
        out.append((("slurm", "procs_per_node"), f"{s.procs_per_node}{_times(k)} must be <= gpus_per_node "
                                                 f"({s.gpus_per_node})"))
    if s.gpus_per_node and s.procs_per_node is None:
        out += [(("slurm", "gpus_per_node"), msg) for msg in _divisible(s.gpus_per_node, k)]
    if inv.job.min_nodes is not None:
        out.append((("job", "min_nodes"), "not on Slurm: the allocation is the job's nodes (Slurm requeues "
                                          "a job whose node fails)"))
    if inv.job.runtime == "docker" and s.container is None:
        out.append((("job", "runtime"), "docker on Slurm needs slurm.container (pyxis or apptainer: what the site "
                                        "runs images with); or runtime: host with a shared venv as train.python"))
    if inv.job.runtime == "host" and s.container is not None:
        out.append((("slurm", "container"), "only with job.runtime: docker (the job runs in that image)"))
    return out


def _train_problems(train: Train, node_envs: list[dict[str, str]], stages: int) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    if train.builtin:
        # The trainer's own parser, here: a bad flag is exit 2 now, not exited(1) after restarts.
        # With the stages the tool gives it (job.stages), which --micro-batches needs.
        from trainer.config import flag_problem

        problem = flag_problem(["--stages", str(stages), *train.args])
        if problem:
            out.append((("train", "args"), f"the built-in trainer refuses these flags: {problem} "
                                           "(see python -m trainer --help)"))
    plain = set(train.env).union(*node_envs)
    for name in train.secrets:
        if name in plain:
            out.append((("train", "secrets", name), f"{name} is also set in train.env or nodes[].env; "
                                                    "keep it in one place (secrets for values never shown)"))
    return out


def _times(stages: int) -> str:
    return f" x job.stages ({stages})" if stages > 1 else ""


def _per_process(stages: int) -> str:
    return f"job.stages ({stages}) GPUs per process" if stages > 1 else "one GPU per process"


def _divisible(gpus: int, stages: int) -> list[str]:
    """A GPU count that job.stages must divide, with no procs given to use fewer."""
    if gpus < stages:
        return [f"{gpus} GPU(s), fewer than one process needs: job.stages ({stages}) GPUs per process"]
    if gpus % stages:
        return [f"{gpus} GPUs do not divide into processes of job.stages ({stages}) GPUs each; "
                f"set procs to use {gpus - gpus % stages} of them, or change job.stages"]
    return []


def _layout_problems(n: Node, i: int, stages: int) -> list[tuple[tuple, str]]:
    """A GPU node's processes, each with ``stages`` of its GPUs: a layout that fits the node,
    or what does not fit, each message naming the node."""
    return [(where, f"node {n.name}: {message}") for where, message in _layout(n, i, stages)]


def _layout(n: Node, i: int, stages: int) -> list[tuple[tuple, str]]:
    if n.gpus == 0:
        if n.gpu_ids is not None:
            return [(("nodes", i, "gpu_ids"), "gpu_ids on a CPU node (gpus: 0); set gpus to the node's GPU count")]
        return []
    out: list[tuple[tuple, str]] = []
    if n.procs is not None and n.procs * stages > n.gpus:
        out.append((("nodes", i, "procs"), f"procs ({n.procs}){_times(stages)} must be <= gpus ({n.gpus}) "
                                           "on a GPU node"))
    ids = n.gpu_ids
    if ids is None:
        if n.procs is None:
            out += [(("nodes", i, "gpus"), msg) for msg in _divisible(n.gpus, stages)]
        return out
    where = ("nodes", i, "gpu_ids")
    if len(set(ids)) != len(ids):
        out.append((where, f"{list(ids)} lists a GPU twice; {_per_process(stages)}"))
    if len(ids) != n.nprocs * stages:
        out.append((where, f"{len(ids)} GPU ids for {n.nprocs} processes; {_per_process(stages)}"))
    if any(g >= n.gpus for g in ids):
        out.append((where, f"{list(ids)}: ids are 0 .. {n.gpus - 1} on a node with gpus: {n.gpus}"))
    return out


# ---------------------------------------------------------------- loading + error mapping


MAX_BYTES = 1 << 20
"""An inventory is a few kB; a larger file is the wrong file, refused before it is parsed."""
MAX_VALUES = 100_000
"""Values after YAML aliases are expanded ("billion laughs" files expand to billions)."""
MAX_DEPTH = 50


def load(path: str | Path) -> Inventory:
    path = Path(path)
    label = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise InventoryError([Issue(label, "", None, f"cannot read the file: {e.strerror or e}")]) from e
    if len(data) > MAX_BYTES:
        raise _too_large(label)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise InventoryError([Issue(label, "", line, f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
                                                     "is this the right file?")]) from None
    return loads(text, label=label, base_dir=path.resolve().parent)


def loads(text: str, *, label: str = "hosts.yaml", base_dir: Path | None = None) -> Inventory:
    if len(text) > MAX_BYTES:
        raise _too_large(label)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            _bounded(root, label)
        data = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as e:
        mark = e.problem_mark
        raise InventoryError([Issue(label, "", mark.line + 1 if mark else None,
                                    f"{e.problem}: hosts.yaml holds plain data (no language-specific tags)")]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(e, "problem", None) or str(e)
        raise InventoryError([Issue(label, "", line, f"YAML syntax error: {problem}")]) from e
    except RecursionError:
        raise InventoryError([Issue(label, "", None, f"nested more than {MAX_DEPTH} levels deep")]) from None
    lines: dict[tuple, int] = {}
    dupes: list[Issue] = []
    if root is not None:
        _index_lines(root, (), lines, dupes, label)
    if dupes:
        raise InventoryError(dupes)
    if not isinstance(data, dict):
        raise InventoryError([Issue(label, "", 1, "expected a mapping with job, rendezvous, nodes, storage, ...")])
    _build_models()
    try:
        inv = Inventory.model_validate(data)
    except ValidationError as e:
        raise InventoryError([_issue(label, tuple(err["loc"]), _message(err), lines) for err in e.errors()]) from e
    except _CrossFieldProblems as e:
        raise InventoryError([_issue(label, loc, msg, lines) for loc, msg in e.problems]) from e
    inv._base_dir = base_dir or Path.cwd()
    return inv


_BUILDING = threading.Lock()


def _build_models() -> None:
    """Builds every model's validator and serializer that is not built yet, in the order they are
    defined (a model's parts before it), as importing this module did before defer_build: all at
    once, here, rather than each at its first use, which may come in several threads at once
    (``ssh_for`` in the fan-out's): pydantic releases before 2.14 build a model unsafely there
    (two threads building one model can each see it half-built)."""
    with _BUILDING:
        for model in _Model.__subclasses__():
            if not model.__pydantic_complete__:
                model.model_rebuild()


def _too_large(label: str) -> InventoryError:
    return InventoryError([Issue(label, "", None, f"larger than {MAX_BYTES // 1024} KiB: an inventory is a few kB "
                                                  "(is this the right file?)")])


_INT_TAG = "tag:yaml.org,2002:int"


def _bounded(root: yaml.Node, label: str) -> None:
    """Refuses a document nested too deeply, whose aliases expand to too many values or that holds
    an integer too long to read, before anything walks it expanded (counted once per distinct node:
    cheap whatever the expansion)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int, loc: tuple = ()) -> int:
        if depth > MAX_DEPTH:
            raise InventoryError([Issue(label, "", node.start_mark.line + 1, f"nested more than {MAX_DEPTH} levels deep")])
        if id(node) in sizes:
            return sizes[id(node)]
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k, depth + 1, loc) + size(v, depth + 1, loc + (k.value,)) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(v, depth + 1, loc + (i,)) for i, v in enumerate(node.value))
        else:
            n = 1
            if node.tag == _INT_TAG and len(node.value) > MAX_NUMBER:
                raise InventoryError([Issue(label, field_path(loc), node.start_mark.line + 1,
                                            f"a number of {len(node.value)} characters, more than the {MAX_NUMBER} "
                                            "any number may have (quote it if it is text)")])
        sizes[id(node)] = n
        if n > MAX_VALUES:
            raise InventoryError([Issue(label, "", node.start_mark.line + 1,
                                        f"YAML aliases expand to more than {MAX_VALUES} values (a \"billion laughs\" "
                                        "file?); an inventory has a few hundred")])
        return n

    size(root, 0)


def field_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _issue(label: str, loc: tuple, message: str, lines: dict[tuple, int]) -> Issue:
    # Pydantic adds validator tags (e.g. 'function-after[...]') to some locs; drop them.
    loc = tuple(p for p in loc if isinstance(p, int) or "[" not in str(p))
    line = None
    for k in range(len(loc), -1, -1):
        if loc[:k] in lines:
            line = lines[loc[:k]]
            break
    return Issue(label, field_path(loc), line, message)


def _message(err: dict) -> str:
    kind = err["type"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown key (check the spelling; see the comments in hosts.yaml)"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if "input" in err and kind not in ("missing",) and not isinstance(err["input"], (dict, list)):
        msg += f", got {_shown(err['input'])}"
    return msg


SHOWN = 40
"""Characters of a refused value shown in its error: the line names the field and the limit."""


def _shown(value) -> str:
    """``value`` as the file had it, cut to SHOWN characters with its length where longer."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN - 1]}… ({len(text)} characters)"


def _index_lines(node: yaml.Node, loc: tuple, lines: dict, dupes: list, label: str) -> None:
    lines[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key, value in node.value:
            k = key.value
            if k in seen:
                dupes.append(Issue(label, field_path(loc + (k,)), key.start_mark.line + 1,
                                   "key appears twice in the same mapping"))
            seen.add(k)
            lines[loc + (k,)] = key.start_mark.line + 1
            _index_lines(value, loc + (k,), lines, dupes, label)
            lines[loc + (k,)] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_lines(item, loc + (i,), lines, dupes, label)
