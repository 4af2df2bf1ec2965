"""Pure functions: inventory -> what to run on each node, as data.

Nothing here touches a node. Every command is an argv list; ``remote.py`` quotes it once.
Shell is used only where a pipe, redirection or detaching is needed, and then as a
constant script that receives every value as a positional argument (never interpolated).
``--dry-run`` prints exactly these lists and the unit tests assert on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from agent.contract import (
    HEARTBEAT_DIR_ENV, HOLD_ENV, LAUNCH_MODULE, NETCHECK_MODULE, ON_STALL_ENV, PREFORK_ENV, RANK_PREFIXES, RUN_ID_ENV,
    SECRET_NAMES_ENV, STALL_TIMEOUT_ENV, parse_beat,
)

from ..inventory import Inventory, Node
from ..programs import node_program
from ..text import lines as text_lines
from .outcome import STOPPED_UNREAD, STOPPING, Stop
from .payload import payload
from .runtime import CodeDir, NodeFacts, heartbeat_dir, runtime
from .scripts import TOOL_DIR
from .stall import STOPPED as STALL_STOPPED
from .stall import Beat, Stall, StallRecord, ended_state, judge

# $1 = the job's uid ("": the job runs as the SSH user), $2 = the data directory, $3 = the checkpoint
# directory. Creates them; where the job has a uid of its own (the docker runtime's: the image's
# `trainer` user) and the SSH user is root, the data directory is handed to it and the checkpoint
# directory made its to write into but not to rename what the tool keeps there (job_root);
# otherwise they must be writable.
MAKE_DIRS = TOOL_DIR + node_program("make_dirs.sh")


DRY_RUN = "RUN_ID"
"""The run's id in what is shown before there is a run (``--dry-run``, ``export slurm``)."""


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one node, as data."""

    node: str
    node_rank: int
    torchrun: tuple[str, ...]
    """torchrun options (before `--` in the image's entrypoint)."""
    trainer: tuple[str, ...]
    """The program's arguments (the built-in trainer's flags, or train.args)."""
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[tuple[str, str], ...] = ()
    """(host path, container path); empty for the host runtime."""
    argv: tuple[str, ...] = field(default=())
    """The command actually run on the node."""


def torchrun_options(inv: Inventory, index: int, *, rdzv_id: str | None = None,
                     max_restarts: int | None = None) -> tuple[str, ...]:
    """torchrun flags for nodes[index]; ``rdzv_id`` and ``max_restarts`` default to the job's.

    --node-rank is the inventory order; with the c10d backend torchrun ignores it (ranks
    follow arrival order) and it only matters for the static backend. --local-addr and
    is_host=1 on the endpoint node are required where hostnames do not resolve to the node's
    address (FIELD_NOTES: torchrun across those hosts).
    """
    node = inv.nodes[index]
    rdzv = inv.rdzv_node
    conf = rdzv_conf(inv)
    if node.name == rdzv.name:
        conf = f"is_host=1,{conf}"
    return (
        "--nnodes", nnodes(inv),
        "--nproc-per-node", torchrun_procs(inv, node.nprocs),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint(inv),
        "--rdzv-id", inv.rdzv_id if rdzv_id is None else rdzv_id,
        "--rdzv-conf", conf,
        "--max-restarts", str(inv.job.max_restarts if max_restarts is None else max_restarts),
        "--local-addr", node.address,
        "--node-rank", str(index),
    )


def run_rdzv_id(inv: Inventory, run: str) -> str:
    """The rendezvous id of one run: the job's, with the run's id. A node left over from an
    earlier run (a lost node whose link came back, its torchrun still trying) reaches the same
    endpoint, but never this run's round: it would make the running nodes start a round again."""
    return f"{inv.rdzv_id}-{run}"


def torchrun_procs(inv: Inventory, procs: int) -> str:
    """torchrun's --nproc-per-node for a node of ``procs`` processes: one where the program starts
    them itself (train.spawn: DDP_PROCS tells it how many)."""
    return "1" if inv.train.spawn else str(procs)


def rdzv_conf(inv: Inventory) -> str:
    """torchrun's --rdzv-conf on every node, without is_host (the rendezvous node's own, added by
    each engine: the fleet's plan, Slurm's task, Kubernetes' pod 0)."""
    # read_timeout bounds each store operation of an agent (torch's default: 60 s): past it, an
    # agent whose rendezvous node is lost gives up. No longer than join_timeout, so that a lost
    # rendezvous node ends the job within the same bound as any lost node (docs/failures.md).
    conf = f"join_timeout={inv.rendezvous.join_timeout},read_timeout={min(inv.rendezvous.join_timeout, 60)}"
    if inv.elastic:  # torchrun's 30 s last call would outlast a short join_timeout: no round of fewer nodes
        conf += f",last_call_timeout={inv.rendezvous.last_call()}"
    return conf


def nnodes(inv: Inventory) -> str:
    """torchrun's --nnodes: every node, or for an elastic job MIN:MAX with MAX every node listed,
    those left out included, so that one of them can join later (``ddp-deploy join``)."""
    if inv.elastic:
        return f"{inv.job.min_nodes}:{inv.listed}"
    if len({n.nprocs for n in inv.nodes}) > 1:
        # Heterogeneous nodes still all have to join: an elastic range with min = max.
        return f"{len(inv.nodes)}:{len(inv.nodes)}"
    return str(len(inv.nodes))


def endpoint(inv: Inventory) -> str:
    """The rendezvous endpoint, ADDRESS:PORT."""
    return _endpoint(inv.rdzv_node.address, inv.rendezvous.port)


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


# Lists every address of a node, one per line: "<index>: <ifname> inet <addr>/<len> ...".
INTERFACES_ARGV = ("ip", "-o", "addr", "show")


def interface_holding(address: str, ip_output: str) -> str | None:
    """The interface that holds ``address``, from the output of INTERFACES_ARGV, or None.

    gloo and NCCL pick their interface from the hostname, which on many fleets (and Debian's
    default 127.0.1.1 entry) resolves to loopback: the workers then hang or are refused. The
    interface holding the node's inventory address is the one the other nodes can reach.
    """
    for line in ip_output.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("inet", "inet6") and fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    return None


def node_env(inv: Inventory, node: Node, facts: NodeFacts = NodeFacts(),
             code: CodeDir | None = None, run: str | None = None) -> tuple[tuple[str, str], ...]:
    """The environment of the node's processes: the contract with the program (docs/own-code.md:
    node name, directories, rendezvous id, launch id, device and backend, code snapshot), the NIC
    for gloo and NCCL (the inventory's, else the one detected on the node), then train.env and
    nodes[].env, which win (they cannot name the contract's variables: inventory.RESERVED_ENV)."""
    env = {"DDP_NODE_NAME": node.name, **contract_env(inv, *runtime(inv).job_dirs(), code, run)}
    if run is not None:  # the launcher says it runs the job, and holds the node's GPUs (agent/holds.py)
        env[HOLD_ENV] = json.dumps({"job": inv.job.name, "run": run, "gpus": list(node.devices)})
    interface = node.interface or facts.interface
    if interface is not None:
        env.update(GLOO_SOCKET_IFNAME=interface, NCCL_SOCKET_IFNAME=interface)
    env.update(inv.train.env)
    env.update(node.env)
    return tuple(env.items())


def contract_env(inv: Inventory, data: str, ckpt: str, code: CodeDir | None = None,
                 run: str | None = None) -> dict[str, str]:
    """The contract's variables that are the same on every node (all but DDP_NODE_NAME), with the
    job's directories as it sees them (``data``, ``ckpt``): a fleet's, Slurm's and Kubernetes' alike."""
    device, backend = device_flags(inv)[1::2]
    env = {"DDP_DATA_DIR": data, "DDP_CKPT_DIR": ckpt, "DDP_RUN_ID": inv.rdzv_id, "DDP_DEVICE": device,
           "DDP_BACKEND": backend, "DDP_STAGES": str(inv.job.stages)}
    if inv.train.spawn:  # the workers the one process torchrun starts on a node starts (homogeneous nodes)
        env["DDP_PROCS"] = str(inv.shape[1])
    if run is not None:
        env[RUN_ID_ENV] = run
    if code is not None:
        env["DDP_CODE_SNAPSHOT"] = code.snapshot
    if inv.train.secrets:  # names only: the launcher masks their values in the job's output
        env[SECRET_NAMES_ENV] = ",".join(inv.train.secrets)
    if not inv.gpu_job:  # forked workers, torch imported once (agent/zygote.py); not yet where CUDA is
        env[PREFORK_ENV] = "1"
    return env


def device_flags(inv: Inventory) -> tuple[str, ...]:
    """A GPU job trains on CUDA with NCCL and refuses to start without them (never on the CPU);
    a CPU job uses gloo. (Validation refuses a job that mixes the two.)"""
    if inv.gpu_job:
        return ("--device", "cuda", "--backend", "nccl")
    return ("--device", "cpu", "--backend", "gloo")


def tool_flags(inv: Inventory) -> tuple[str, ...]:
    """The built-in trainer's flags that the tool sets (inventory.TOOL_FLAGS)."""
    stages = ("--stages", str(inv.job.stages)) if inv.job.stages > 1 else ()
    return (*device_flags(inv), *stages)


def program_args(inv: Inventory) -> tuple[str, ...]:
    """The program's arguments: for the built-in trainer, the tool's flags and train.args."""
    data, ckpt = runtime(inv).job_dirs()
    return payload(inv).program_args(data, ckpt, tool_flags(inv))


def stall_env(inv: Inventory) -> tuple[tuple[str, str], ...]:
    """job.on_stall and job.stall_timeout for each node's launcher, which keeps a stall with the run
    and acts on it itself (agent/heartbeat/, Watchdog): on the SSH fleet and under Slurm alike."""
    return ((ON_STALL_ENV, inv.job.on_stall), (STALL_TIMEOUT_ENV, str(inv.job.stall_timeout)))


def launch_spec(inv: Inventory, index: int, facts: NodeFacts = NodeFacts(), code: CodeDir | None = None,
                run: str = DRY_RUN) -> LaunchSpec:
    """nodes[index]'s start command; ``run``: the run's id (runs.py), new at each launch."""
    node = inv.nodes[index]
    torchrun = torchrun_options(inv, index, rdzv_id=run_rdzv_id(inv, run))
    program = program_args(inv)
    # The started job's alone: a probe or a network check beside it never touches its heartbeats.
    env = (*node_env(inv, node, facts, code, run), (HEARTBEAT_DIR_ENV, heartbeat_dir(inv, node)))
    env += stall_env(inv)
    rt = runtime(inv, code, run)
    argv = rt.start_argv(node, [*torchrun, *payload(inv).launcher_options(), "--", *program], env, facts)
    return LaunchSpec(node=node.name, node_rank=index, torchrun=torchrun, trainer=program,
                      env=env, mounts=rt.mounts(), argv=tuple(argv))


def launch_plan(inv: Inventory, facts: dict[str, NodeFacts] | None = None,
                code: CodeDir | None = None, run: str = DRY_RUN) -> list[LaunchSpec]:
    """Every node's launch; ``facts`` holds what the preflight found on each node (NIC, InfiniBand),
    ``code`` the code snapshot the job runs in (train.code), ``run`` the run's id."""
    facts = facts or {}
    return [launch_spec(inv, i, facts.get(n.name, NodeFacts()), code, run) for i, n in enumerate(inv.nodes)]




def netcheck_plan(inv: Inventory, facts: dict[str, NodeFacts], flags: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The network check on every node, in the foreground: the job's launcher, image or
    interpreter, interfaces and environment, with ``trainer.netcheck`` as the entry and a
    rendezvous id of its own (no restarts)."""
    rt = runtime(inv)
    device = device_flags(inv)
    out = {}
    for i, node in enumerate(inv.nodes):
        opts = torchrun_options(inv, i, rdzv_id=f"{inv.rdzv_id}-netcheck", max_restarts=0)
        f = facts.get(node.name, NodeFacts())
        launcher = [*opts, "--entry", NETCHECK_MODULE, "--", *device, *flags]
        out[node.name] = tuple(rt.run_argv(node, launcher, node_env(inv, node, f), f))
    return out


def probe_argv(inv: Inventory, node: Node, code: CodeDir | None = None, *, reuse: bool | None = None
               ) -> tuple[str, ...]:
    """agent.probe where the job runs, with its code: torch, CUDA, and the program importing.
    ``reuse``: None runs the probe alone; False keeps its good answer on the node where the
    runtime can (:meth:`Runtime.kept_probe_argv`); True also takes an answer kept before."""
    rt = runtime(inv, code)
    probe = tuple(rt.probe_argv(node, node_env(inv, node, code=code), payload(inv).probe_options()))
    return probe if reuse is None else tuple(rt.kept_probe_argv(node, probe, reuse))


def status_argv(inv: Inventory, node: Node) -> tuple[str, ...]:
    return runtime(inv).status_argv(node)


def diagnose_argv(inv: Inventory, node: Node) -> tuple[str, ...]:
    """The job's workers on ``node`` and their stacks (deploy/observe/doctor.py)."""
    return runtime(inv).diagnose_argv(node)


def stop_argv(inv: Inventory, node: Node, grace: int = 0) -> tuple[str, ...]:
    """Ends the job on ``node``: with ``grace`` (s), a planned stop with a checkpoint; 0 kills at once."""
    return runtime(inv).stop_argv(node, grace)


def logs_argv(inv: Inventory, node: Node, *, tail: int | None, follow: bool) -> tuple[str, ...]:
    """The node's output (stdout and stderr merged), last ``tail`` lines or all."""
    return runtime(inv).logs_argv(node, tail=tail, follow=follow)


def make_dirs_argv(inv: Inventory) -> tuple[str, ...]:
    s = inv.storage
    return ("sh", "-c", MAKE_DIRS, "sh", runtime(inv).job_uid, s.data.host, s.checkpoints.host)


def python_check_argv(inv: Inventory) -> tuple[str, ...]:
    """Host runtime, deploy: the interpreter imports the node agent (this package's) and torch."""
    return (inv.python_path(), "-c", f"import {LAUNCH_MODULE}, torch; print(torch.__version__)")


@dataclass(frozen=True)
class NodeState:
    state: str
    """running | restarting | stopping | stopped (HOW) (deploy/job/outcome.py) | exited(CODE) | exited(?) |
    stopped (stalled) (job.on_stall: stop, deploy/job/stall.py) | absent | unreachable | unknown (the node
    answered, its engine did not); each explained in docs/failures.md, "What status shows".
    """
    metrics: str = ""
    """The last METRICS line (an unreachable node's: why)."""
    restarts: int = 0
    """How often the node's torchrun was started again (Docker's policy, the host supervisor)."""
    beats: tuple[Beat, ...] = ()
    """A running job's heartbeats on the node, one per rank that writes them (deploy/job/stall.py)."""
    quiet_s: float | None = None
    """A running job's seconds since its log was last written."""
    stall: Stall | None = None
    """Judged by the operator's tool against job.stall_timeout (:func:`with_stall`)."""
    stop: Stop | None = None
    """The operator's stop of the node's run, as ``stop`` kept it (deploy/job/outcome.py)."""
    formed: bool = False
    """The node's launcher saw a rank's heartbeat in this run: a process group formed (agent/formed.py)."""

    @property
    def exists(self) -> bool:
        return self.state not in ("absent", "unreachable", "unknown")

    @property
    def running(self) -> bool:
        return self.state in ("running", "restarting", STOPPING)

    @property
    def failed(self) -> bool:
        return self.state.startswith("exited(") and self.state != "exited(0)"

    @property
    def ended(self) -> bool:
        """Its part of the job is over: it exited, the operator's stop ended it, or its launcher
        ended it on a stall."""
        return self.state.startswith(("exited(", "stopped (")) or self.state == STALL_STOPPED


def json_line(stdout: str, prefix: str) -> dict | None:
    """The JSON object on the first line starting with ``prefix`` (``PROBE ``, ``NETCHECK ``), or None.
    A line a worker printed under torchrun (``NETCHECK``) has its rank in front: ``[rank0]: ``."""
    for line in stdout.splitlines():
        line = RANK_PREFIXES.sub("", line, count=1)
        if line.startswith(prefix):
            try:
                value = json.loads(line[len(prefix):])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def count(text: str) -> int:
    """A small count a node printed (restarts): its decimal digits, else 0. A file on the shared
    volume may hold anything: thousands of digits, or digits of other scripts that int() reads."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else 0


def parse_status(stdout: str) -> NodeState:
    """Parse the output of HOST_STATUS / DOCKER_STATUS: the state (``exited CODE`` for an end;
    ``stopped``, with the record of the stop on a ``stop`` line), then ``restarts N``, ``formed``
    and the last METRICS line, each if any."""
    lines = text_lines(stdout)  # the METRICS line is the job's: a \r in it is data
    head = lines[0].strip() if lines else "absent"
    if head.startswith("exited"):
        code = head.split(" ", 1)[1] if " " in head else "?"
        head = f"exited({code})"
    restarts, metrics, beats, quiet, kept, stop, formed = 0, "", [], None, None, None, False
    for line in lines[1:]:
        word, _, value = line.strip().partition(" ")
        if word == "restarts":
            restarts = count(value)
        elif word == "stall":  # the last stall the node's launcher kept (scripts.LAST_STALL)
            kept = StallRecord.parse(value)
        elif word == "beat":  # "beat LOCAL_RANK AGE LINE" (scripts.PROGRESS)
            name, _, rest = value.partition(" ")
            age, _, text = rest.partition(" ")
            found = parse_beat(name, age, text)
            if found is not None:
                beats.append(Beat(*found))
        elif word == "quiet":
            quiet = float(count(value)) if value.isdigit() else None
        elif word == "stop":  # the operator's stop of this run on the node (scripts.RECORD_STOP)
            stop = Stop.parse(value)
        elif line.strip() == "formed":  # the node's launcher saw a heartbeat (agent/formed.py)
            formed = True
        elif line.strip():
            metrics = line.strip()
    if head == "exited(0)":
        head = ended_state(0, kept) or head
    if head == "stopped":
        head = stop.state() if stop is not None else STOPPED_UNREAD
    return NodeState(head, metrics, restarts, tuple(beats), quiet, stop=stop, formed=formed)


def with_stall(s: NodeState, setting, now: float | None = None) -> NodeState:
    """``s`` judged against ``job.stall_timeout`` (``setting``)."""
    return replace(s, stall=judge(s.state, s.beats, s.quiet_s, setting, now, started=bool(s.metrics)))
