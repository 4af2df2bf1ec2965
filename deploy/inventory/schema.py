"""hosts.yaml's sections as frozen pydantic models, each field's own rules beside it; the
:class:`Inventory` and what the rest of the tool asks of it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from ..errors import InventoryError, Issue
from .fields import (
    AbsPath, Address, Arg, EnvName, EnvValue, GpuId, ImageRef, JobName, LocalPath, MAX_CONNECT_TIMEOUT,
    MAX_FREE_GB, MAX_KEEP_RUNS, MAX_NODES, MAX_PER_NODE, MAX_RESTARTS, ModuleName, PathStr, Port, SafeName,
    ScriptPath, StallTimeout, WEEK, ENV_NAME, identifier, local_path,
)
from .rules import CrossFieldProblems, cross_field_problems


class Model(BaseModel):
    # defer_build: each model's validator is built when the first inventory is read (_build_models),
    # not when this module is imported: a command that reads none (--help) does not pay for it.
    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True, defer_build=True)


class Job(Model):
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


class Rendezvous(Model):
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


class SshOverrides(Model):
    host: Address | None = None
    """Where SSH connects for this node, if not ``address`` (which stays the node's address for
    the rendezvous and the NIC): a DNS name, an IP, or a Host alias of ``ssh.config``."""
    user: SafeName | None = None
    port: Port | None = None
    key: LocalPath | None = None
    known_hosts: LocalPath | None = None
    host_key_policy: Literal["strict", "accept-new"] | None = None
    connect_timeout: int | None = Field(default=None, ge=1, le=MAX_CONNECT_TIMEOUT)


class Ssh(Model):
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


class Node(Model):
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


class SlurmLogin(Model):
    """Where the tool runs sbatch, squeue, scancel: a login node, reached as nodes are (SSH or local)."""

    name: SafeName = "login"
    address: Address
    connection: Literal["ssh", "local"] = "ssh"
    ssh: SshOverrides | None = None


class SlurmContainer(Model):
    """The container route of Slurm sites, for job.runtime docker (rendered; docs/slurm-kubernetes.md)."""

    kind: Literal["pyxis", "apptainer"]
    """pyxis: ``srun --container-image`` (enroot); apptainer: ``apptainer exec`` on each node."""
    image: Annotated[str, AfterValidator(local_path)]
    """What the site's runtime opens: for pyxis an image reference or a .sqsh file, for apptainer
    a .sif file or a ``docker://`` reference."""


class Slurm(Model):
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


class Image(Model):
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
            if not ENV_NAME.fullmatch(k):
                raise ValueError(f"build arg name {k!r} must look like an identifier")
        return v


class Mount(Model):
    host: AbsPath
    container: AbsPath


class Storage(Model):
    data: Mount
    checkpoints: Mount
    min_free_gb: float = Field(default=1, ge=0, le=MAX_FREE_GB)


# Chosen by the tool: the device and backend from nodes[].gpus, so that a GPU node never trains on
# the CPU; the stages from job.stages, which also lays out each node's GPUs.
_BY_GPUS = "cuda + nccl on GPU nodes (nodes[].gpus > 0), cpu + gloo on CPU nodes"
TOOL_FLAGS = {"--device": _BY_GPUS, "--backend": _BY_GPUS,
              "--stages": "from job.stages, which also gives each process that many of a node's GPUs"}


class Secret(Model):
    """Where the operator's machine reads a secret at launch: never written in hosts.yaml, never
    printed (shown as ``***``), sent to the nodes over SSH's stdin, not on any command line."""

    env: Annotated[str, AfterValidator(identifier)] | None = None
    """A variable of the operator's environment."""
    file: LocalPath | None = None
    """A file on the operator's machine (relative to hosts.yaml's directory); one trailing newline
    is dropped."""

    @model_validator(mode="after")
    def _one_source(self) -> "Secret":
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env: (an operator's environment variable) or file: (a path)")
        return self


class Code(Model):
    """A local directory synced to the shared volume as a snapshot and used as the working directory."""

    path: LocalPath
    """The project directory on the operator's machine, relative to hosts.yaml's directory."""
    ignore: tuple[Arg, ...] = ()
    """gitignore-style patterns left out, on top of the project's .gitignore files and .git/."""


class Train(Model):
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


class Heal(Model):
    """The watcher that heals a running job without an operator (deploy/engines/fleet/heal.py,
    docs/failures.md "A job that heals itself")."""

    watch: bool = False
    """``launch`` starts a watcher beside the job, detached from the operator's terminal: a node
    lost for good is replaced by a spare (or left out, where the job may shrink), the job
    relaunched on the new set from its newest checkpoint, the rendezvous moved off a lost node."""
    lost_after: int = Field(default=60, ge=5, le=WEEK)
    """Seconds a node of the job must stay unreachable (its SSH refused or silent, at every poll)
    before the watcher takes it for lost for good."""


class Inventory(Model):
    job: Job
    rendezvous: Rendezvous = Field(default_factory=Rendezvous)
    ssh: Ssh = Field(default_factory=Ssh)
    nodes: Annotated[tuple[Node, ...], Field(max_length=MAX_NODES)] = ()
    """The SSH fleet; or slurm: instead."""
    spares: Annotated[tuple[Node, ...], Field(max_length=MAX_NODES)] = ()
    """Machines kept ready for the job: checked and deployed like the nodes, never started by
    launch; ``--with NAME`` puts one in the place of a node left out with ``--without``."""
    slurm: Slurm | None = None
    image: Image = Field(default_factory=Image)
    storage: Storage
    train: Train = Field(default_factory=Train)
    heal: Heal = Field(default_factory=Heal)

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _listed: int | None = PrivateAttr(default=None)
    """How many nodes hosts.yaml lists, when some are left out (--without)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> "Inventory":
        for part in (*self.nodes, *self.spares, *([self.slurm] if self.slurm else [])):
            part._stages = self.job.stages
        problems = cross_field_problems(self)
        if problems:
            raise CrossFieldProblems(problems)
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
        """A node (or a spare) by name; on Slurm, the login node is the one the tool talks to."""
        if self.slurm is not None and name == self.slurm.login.name:
            return self.slurm.login  # type: ignore[return-value]  (the fields a transport reads)
        return next(n for n in (*self.nodes, *self.spares) if n.name == name)

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

    def with_spares(self, names: Iterable[str]) -> "Inventory":
        """This inventory with the spares ``names`` among its nodes, each in the place of a node
        left out (--without): no more nodes than hosts.yaml lists."""
        names = list(dict.fromkeys(names))
        unknown = sorted(set(names) - {s.name for s in self.spares})
        if unknown:
            raise InventoryError([Issue("--with", "", None, f"{', '.join(unknown)}: not in spares[].name "
                                                            f"({', '.join(s.name for s in self.spares) or 'none'})")])
        if len(self.nodes) + len(names) > self.listed:
            raise InventoryError([Issue("--with", "", None, f"{len(names)} spare(s) for {self.listed - len(self.nodes)} "
                                                            "node(s) left out: a spare takes the place of a node "
                                                            "left out with --without")])
        joining = tuple(s for s in self.spares if s.name in names)
        return self._copied(nodes=(*self.nodes, *joining), spares=tuple(s for s in self.spares if s.name not in names))

    def and_spares(self) -> "Inventory":
        """Every machine of the job, its spares among the nodes: what ``check`` and ``deploy``
        reach (a spare is checked and made ready as a node is, and never started)."""
        return self._copied(nodes=(*self.nodes, *self.spares), spares=()) if self.spares else self

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
        return self._copied(nodes=nodes, rendezvous=self.rendezvous.model_copy(update={"node": rendezvous_node}))

    def _copied(self, **update) -> "Inventory":
        """A copy with ``update``, still of this hosts.yaml: its directory, and how many nodes it lists."""
        other = self.model_copy(update=update)
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
