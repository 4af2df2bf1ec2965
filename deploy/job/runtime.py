"""How the job runs on a node: one class per runtime, owning every command of its kind.

``docker`` runs the launcher as the image's entrypoint in a container; ``host`` runs the same
launcher (``python -m agent.launch``) with the node's interpreter. Everything here returns
argv lists (plan.py and preflight.py call these; remote.py quotes them once); nothing runs.

What differs between the runtimes: where the job's directories are, how a process gets its
environment and its GPUs, how it is started detached, watched and stopped, and how the probe
and the network check reach the job's own torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

from agent.contract import LAUNCH_MODULE, LOG_DIR_ENV, PROBE_MODULE, WORK_SUBDIR, module_argv, program

from ..inventory import Inventory, Node
from .scripts import (AS_JOB, DOCKER_STATUS, DOCKER_STOP, HOST_PROBE_KEPT, HOST_START, HOST_STATUS, HOST_STOP, IN_DIR,
                      IN_NEW_DIR, IN_WORK_DIR, MERGE_STDERR, PROBE_KEPT, REPLACE_CONTAINER, SECRETS_FROM_STDIN)


# Host runtime: per-node run directory (under the checkpoint dir, so logs sit with the run)
# holding `pid` (the process-group id of the detached torchrun), `log` (its stdout+stderr)
# and `exit` (its exit code, written when it ends).
RUN_SUBDIR = ".ddp-deploy"


def as_job_argv(inv: Inventory, argv: tuple[str, ...]) -> tuple[str, ...]:
    """``argv``, run on a node with the rights of the job's user (AS_JOB)."""
    return ("sh", "-c", AS_JOB, "sh", runtime(inv).job_uid, *argv)


def operator() -> str:
    """Who runs this tool, as ``user@host``, for the stop record (RECORD_STOP): letters, digits and
    ``_.-`` only, so that it stays one word on the node's command line and in the record."""
    import getpass
    import re
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name, no passwd entry (a bare container)
        user = "?"
    clean = lambda word: re.sub(r"[^A-Za-z0-9_.-]", "?", word)[:64] or "?"  # noqa: E731
    return f"{clean(user)}@{clean(socket.gethostname())}"


STOP_GRACE_S = 45
"""How long a stop waits after SIGTERM before SIGKILL (`stop`, and Docker's own stop of the
container when its daemon shuts down: a reboot, a spot reclaim): torchrun gives its workers 30 s
to finish their step and write the checkpoint of a planned stop (trainer/stopping.py)."""

CODE_MOUNT = "/workspace"
"""Where a docker job sees its code snapshot (read-only; the launcher starts there and makes the
node's working directory of links to it, agent/workdir.py)."""

JOB_UID = "1000"
"""The image's user (Dockerfile): the docker runtime's job runs as it."""

# What NCCL needs to use InfiniBand/RoCE from a container: the verbs devices, pinned memory
# without limit (IPC_LOCK, memlock). Shared memory comes with --ipc host, which every job has.
INFINIBAND_DOCKER_ARGS = ("--device", "/dev/infiniband", "--cap-add", "IPC_LOCK", "--ulimit", "memlock=-1:-1")


def job_dir(inv: Inventory, base: str | None = None) -> str:
    """The tool's directory of the job on the shared volume: its launch record, the host runtime's
    per-node state, the kept runs; ``base``: the checkpoint directory as the job sees it (default:
    as the nodes do)."""
    return f"{base or inv.storage.checkpoints.host}/{RUN_SUBDIR}/{inv.job.name}"


def kept_dir(inv: Inventory, run: str, node: str, base: str | None = None) -> str:
    """A node's directory of a run on the shared volume (deploy/job/runs.py)."""
    return f"{job_dir(inv, base)}/runs/{run}/{node}"


def heartbeat_dir(inv: Inventory, node: Node) -> str:
    """Where the job's ranks on ``node`` keep their heartbeats (agent/heartbeat/): in the node's
    memory, shared with a container by ``--ipc host``. It names the job by its name and by where it
    lives (its directory on the shared volume, hashed: two hosts.yaml may both call their job
    ``demo``, and both run on one machine), and the node; ``@`` is in neither a job's nor a node's
    name and the hash has a fixed length, so no two jobs or nodes (network namespaces of one machine
    in the tests) share one: the launcher empties its directory, and its watchdog takes every
    process that names the directory for a worker of its own. The runtime is in the name too: a
    container's user (uid 1000) and the host runtime's (ssh.user) never meet over one directory,
    which the launcher would refuse as another user's."""
    return f"/dev/shm/ddp-heartbeat-{inv.job.runtime}-{inv.job.name}@{node.name}-{job_key(inv)}"


def job_key(inv: Inventory) -> str:
    """The job's directory on the shared volume, hashed: with its name, what tells one job from
    another of the same name (another hosts.yaml, another user's) on one machine."""
    return hashlib.sha256(job_dir(inv).encode()).hexdigest()[:12]


def spy_beside(python: str) -> str:
    """py-spy, installed beside the job's interpreter (else the one on PATH): the diagnose program's second argument."""
    return f"{python.rsplit('/', 1)[0]}/py-spy" if "/" in python else "py-spy"


def tail_argv(path: str, *, tail: int | None, follow: bool) -> tuple[str, ...]:
    """A log file's last ``tail`` lines (None: all), then its new ones with ``follow``."""
    argv = ["tail", "-n", "+1" if tail is None else str(tail)]
    if follow:
        argv.append("-F")
    return ("sh", "-c", MERGE_STDERR, "sh", *argv, path)


class JobDirs(NamedTuple):
    """The data and checkpoint directories as the job sees them."""

    data: str
    ckpt: str


@dataclass(frozen=True)
class NodeFacts:
    """What the preflight session found on a node that shapes its commands."""

    interface: str | None = None
    """The NIC holding the node's inventory address (for GLOO/NCCL_SOCKET_IFNAME)."""
    infiniband: bool = False
    """/dev/infiniband exists on the node (NCCL can use IB/RoCE)."""


@dataclass(frozen=True)
class CodeDir:
    """A code snapshot on the shared volume (deploy/job/codesync.py): where the job's launcher starts."""

    snapshot: str
    host: str
    """Its path on every node."""


def probe_args(node: Node, program: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``python -m agent.probe`` and what it checks: the node's GPUs and processes, and that the
    program imports (``program``: the payload's probe options)."""
    return (*module_argv(PROBE_MODULE), "--gpus", str(len(node.devices)), "--procs", str(node.nprocs), *program)


class Runtime:
    """The commands one runtime uses on a node."""

    name = ""
    job_uid = ""
    """The user the job runs as, where it is not the SSH user's (as_job.sh): deploy hands it the
    shared directories (MAKE_DIRS), and what the job wrote is read with its rights, never root's."""

    def __init__(self, inv: Inventory, code: CodeDir | None = None, run: str | None = None) -> None:
        self.inv = inv
        self.code = code
        self.run = run
        """The run's id (runs.py): where the started job's output and exit codes are kept."""

    def kept_dir(self, node: Node, base: str | None = None) -> str:
        """The node's directory of this run on the shared volume (``base``: as the job sees it)."""
        if self.run is None:
            raise ValueError("a started job needs a run id")
        return kept_dir(self.inv, self.run, node.name, base)

    def image_id_argv(self) -> tuple[str, ...] | None:
        """Prints the id of the image the job runs in, on a node; None when it runs in none."""
        return None

    def secrets_prefix(self) -> list[str]:
        """Before a start command: read the secrets' NAME=VALUE lines from stdin (none: nothing)."""
        return ["sh", "-c", SECRETS_FROM_STDIN, "sh"] if self.inv.train.secrets else []

    def job_dirs(self) -> JobDirs:
        """The data and checkpoint directories as the job sees them."""
        raise NotImplementedError

    def where(self) -> str:
        """Where the job's torch lives, for messages."""
        raise NotImplementedError

    def mounts(self) -> tuple[tuple[str, str], ...]:
        """(host path, path in the job) pairs; empty when the job sees the host's paths."""
        return ()

    def torch_hint(self) -> str:
        """What to do about a torch outside the supported range."""
        raise NotImplementedError

    def gpu_hint(self, need: str, base: str | None = None) -> str:
        """What to do about a torch with no code for the node's GPUs: get one ``need`` (``with CUDA
        12.8 or newer``, deploy/checks/gpu_arch.py); ``base``: an image base that has it."""
        raise NotImplementedError

    def dry_run_notes(self, node: Node) -> list[str]:
        """What the launch command gains from facts found on the node at launch time."""
        return []

    def install_hint(self) -> str:
        """How to get this version of the trainer where the job runs."""
        raise NotImplementedError

    def listener_python(self) -> str:
        """The node's interpreter for the preflight's rendezvous listener (outside any container)."""
        raise NotImplementedError

    def engine_argv(self) -> tuple[str, ...] | None:
        """A check that the runtime itself works on the node, or None when the probe is that check."""
        return None

    def start_argv(self, node: Node, launcher: list[str], env: tuple[tuple[str, str], ...],
                   facts: NodeFacts) -> list[str]:
        """The job on ``node``, started detached: the launcher's arguments (torchrun options, --, flags)."""
        raise NotImplementedError

    def run_argv(self, node: Node, launcher: list[str], env: tuple[tuple[str, str], ...],
                 facts: NodeFacts) -> list[str]:
        """The launcher in the foreground (the network check): ends when it ends, leaves nothing."""
        raise NotImplementedError

    def probe_argv(self, node: Node, env: tuple[tuple[str, str], ...], program: tuple[str, ...] = ()) -> list[str]:
        """agent.probe with the job's torch, GPUs, environment and code: one line of versions,
        CUDA state and whether the program imports."""
        raise NotImplementedError

    def kept_probe_argv(self, node: Node, probe: tuple[str, ...], reuse: bool) -> tuple[str, ...]:
        """``probe`` (:meth:`probe_argv`), with its good answer kept on the node where the answer
        can only change with what the command names; ``reuse``: a kept answer serves (launch).
        Here: probed every time."""
        return probe

    def status_argv(self, node: Node) -> tuple[str, ...]:
        raise NotImplementedError

    def stop_argv(self, node: Node, grace: int = 0, by: str | None = None) -> tuple[str, ...]:
        """Ends the job on the node: SIGTERM, ``grace`` seconds for a checkpoint, then SIGKILL
        (0: at once); removes what the run left (container, pid files). A job it finds running
        has the stop kept with its run, ``by`` (default: :func:`operator`) as who stopped it."""
        raise NotImplementedError

    def logs_argv(self, node: Node, *, tail: int | None, follow: bool) -> tuple[str, ...]:
        raise NotImplementedError


class DockerRuntime(Runtime):
    name = "docker"
    job_uid = JOB_UID

    def job_dirs(self) -> JobDirs:
        s = self.inv.storage
        return JobDirs(s.data.container, s.checkpoints.container)

    def where(self) -> str:
        return f"image {self.inv.image.name}"

    def torch_hint(self) -> str:
        return "build the image on a base inside it (image.build_args.BASE_IMAGE), then deploy"

    def gpu_hint(self, need: str, base: str | None = None) -> str:
        return (f"build the image on a base {need} (image.build_args.BASE_IMAGE"
                + (f", e.g. {base}" if base else "") + "), then deploy")

    def install_hint(self) -> str:
        return "rebuild the image from this version and run `ddp-deploy deploy`"

    def listener_python(self) -> str:
        return "python3"

    def dry_run_notes(self, node: Node) -> list[str]:
        if not node.devices:
            return ["the torch probe's answer this node kept for the same image and probe command serves, "
                    "if it has one (`ddp-deploy check` probes afresh and keeps it)"]
        return ["if the node has /dev/infiniband (found at launch): " + " ".join(INFINIBAND_DOCKER_ARGS)]

    def mounts(self) -> tuple[tuple[str, str], ...]:
        s = self.inv.storage
        return (s.data.host, s.data.container), (s.checkpoints.host, s.checkpoints.container)

    def _code_args(self) -> list[str]:
        if self.code is None:
            return []
        return ["-v", f"{self.code.host}:{CODE_MOUNT}:ro", "--workdir", CODE_MOUNT]

    def engine_argv(self) -> tuple[str, ...]:
        return ("docker", "version", "--format", "{{.Server.Version}}")

    def image_id_argv(self) -> tuple[str, ...]:
        return ("docker", "image", "inspect", "--format", "{{.Id}}", self.inv.image.name)

    def container(self, node: Node) -> str:
        """The node's container of this job: named by the job, the node and where the job lives
        (:func:`job_key`), so that two jobs of one name (two users', each with its own storage) on
        one Docker engine never take or remove each other's."""
        return f"{self.inv.job.name}-{node.name}-{job_key(self.inv)}"

    @staticmethod
    def gpu_args(node: Node) -> list[str]:
        """The node's GPUs by index (the container sees them as 0..n-1, local rank i on device i)."""
        if not node.devices:
            return []
        return ["--gpus", '"device=' + ",".join(map(str, node.devices)) + '"']

    def _run(self, node: Node, env, facts: NodeFacts) -> list[str]:
        argv = ["--network", "host", "--ipc", "host", "--pull", "never"]  # only the image deploy verified
        argv += self.gpu_args(node)
        if node.devices and facts.infiniband:
            argv += INFINIBAND_DOCKER_ARGS
        for src, dst in self.mounts():
            argv += ["-v", f"{src}:{dst}"]
        argv += self._code_args()
        for k, v in env:
            argv += ["-e", f"{k}={v}"]
        return argv

    def start_argv(self, node, launcher, env, facts):
        argv = ["docker", "run", "-d", "--name", self.container(node),
                "--label", f"ddp.job={self.inv.job.name}", "--label", f"ddp.node={node.name}"]
        if self.inv.job.max_restarts > 0:
            # A container whose torchrun was killed (OOM killer, kill -9) comes back and joins the
            # next rendezvous round; the survivors' agents restart their workers into that round.
            argv += ["--restart", f"on-failure:{self.inv.job.max_restarts}"]
        argv += ["--stop-timeout", str(STOP_GRACE_S)]  # also when the daemon stops it (reboot, reclaim)
        argv += ["--cap-add", "SYS_PTRACE"]  # `doctor` reads the workers' stacks (py-spy), in this container only
        for name in self.inv.train.secrets:  # the value comes from SECRETS_FROM_STDIN's environment
            argv += ["-e", name]
        # The launcher keeps a copy of its output and its exit codes with the run (agent.launch.run_teed).
        argv += ["-e", f"{LOG_DIR_ENV}={self.kept_dir(node, self.inv.storage.checkpoints.container)}"]
        return [*self.secrets_prefix(), "sh", "-c", IN_NEW_DIR, "sh", self.job_uid, self.inv.storage.checkpoints.host,
                RUN_SUBDIR, self.inv.job.name, self.run, node.name,
                *argv, *self._run(node, env, facts), self.inv.image.name, *launcher]

    def run_argv(self, node, launcher, env, facts):
        name = f"{self.container(node)}-check"
        return ["sh", "-c", REPLACE_CONTAINER, "sh", name, "docker", "run", "--rm", "--name", name,
                *self._run(node, env, facts), self.inv.image.name, *launcher]

    def probe_argv(self, node, env, program=()):
        return ["docker", "run", "--rm", "--pull", "never", "--network", "none", *self.gpu_args(node),
                *self._code_args(), *(f"--env={k}={v}" for k, v in env), "--entrypoint", "python",
                self.inv.image.name, *probe_args(node, program)]

    def kept_probe_argv(self, node, probe, reuse):
        """A CPU node's answer is a function of the image (kept by its id), the code snapshot
        (named by its content), the environment and the flags (all in the command, hashed); a
        GPU node's devices are probed every time."""
        if node.devices:
            return probe
        key = hashlib.sha256("\0".join(probe).encode()).hexdigest()[:32]
        return ("sh", "-c", PROBE_KEPT, "sh", "reuse" if reuse else "keep", key, self.inv.image.name, *probe)

    def status_argv(self, node):
        return ("sh", "-c", DOCKER_STATUS, "sh", self.container(node), heartbeat_dir(self.inv, node),
                job_dir(self.inv), node.name, self.job_uid)

    def stop_argv(self, node, grace=0, by=None):
        return ("sh", "-c", DOCKER_STOP, "sh", self.container(node), str(grace), by or operator(),
                self.inv.storage.checkpoints.host, RUN_SUBDIR, self.inv.job.name, node.name, heartbeat_dir(self.inv, node))

    def diagnose_argv(self, node):
        # as root in the container, which has CAP_SYS_PTRACE for this (start_argv): py-spy reads the workers
        return ("docker", "exec", "-u", "0", self.container(node), "sh", "-c", program("diagnose"), "sh",
                heartbeat_dir(self.inv, node), "py-spy")

    def logs_argv(self, node, *, tail, follow):
        argv = ["docker", "logs", "--tail", "all" if tail is None else str(tail)]
        if follow:
            argv.append("--follow")
        return ("sh", "-c", MERGE_STDERR, "sh", *argv, self.container(node))


class HostRuntime(Runtime):
    name = "host"

    def job_dirs(self) -> JobDirs:
        s = self.inv.storage
        return JobDirs(s.data.host, s.checkpoints.host)

    def where(self) -> str:
        return self.inv.python_path()

    def torch_hint(self) -> str:
        return f"install a torch inside it for {self.inv.python_path()} (train.python)"

    def gpu_hint(self, need: str, base: str | None = None) -> str:
        return f"install a torch {need} for {self.inv.python_path()} (train.python)"

    def install_hint(self) -> str:
        return f"install this version of the package for {self.inv.python_path()} (train.python)"

    def listener_python(self) -> str:
        return self.inv.python_path()

    def run_dir(self, node: Node) -> str:
        return f"{job_dir(self.inv)}/{node.name}"

    @staticmethod
    def gpu_env(node: Node) -> tuple[tuple[str, str], ...]:
        """The node's GPUs by index, numbered as nvidia-smi does (PCI bus order, not CUDA's own)."""
        if not node.devices:
            return ()
        return (("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", ",".join(map(str, node.devices))))

    def _command(self, node: Node, env, args) -> list[str]:
        cmd = [self.inv.python_path(), *args]
        env = (*self.gpu_env(node), *env)
        if env:
            cmd = ["env", *(f"{k}={v}" for k, v in env), *cmd]
        if self.code:
            return ["sh", "-c", IN_DIR, "sh", self.code.host, *cmd]
        # without train.code too, the job and the check's probe run in the node's own directory
        return ["sh", "-c", IN_WORK_DIR, "sh", f"{self.inv.storage.checkpoints.host}/{WORK_SUBDIR}/{node.name}", *cmd]

    def start_argv(self, node, launcher, env, facts):
        return [*self.secrets_prefix(), "sh", "-c", HOST_START, "sh", self.run_dir(node), self.kept_dir(node),
                str(self.inv.job.max_restarts), *self._command(node, env, [*module_argv(LAUNCH_MODULE), *launcher])]

    def run_argv(self, node, launcher, env, facts):
        return self._command(node, env, [*module_argv(LAUNCH_MODULE), *launcher])

    def probe_argv(self, node, env, program=()):
        return self._command(node, env, probe_args(node, program))

    def kept_probe_argv(self, node, probe, reuse):
        """A CPU node's answer is a function of the probe's command (the interpreter, the code
        snapshot, the environment and the flags: hashed here) and of the interpreter's installation,
        which the probe itself names on the node before it imports anything (agent.probe's
        ``installation()``: a package installed, removed or upgraded is another answer); a GPU
        node's devices are probed every time."""
        if node.devices:
            return probe
        key = hashlib.sha256("\0".join(probe).encode()).hexdigest()[:32]
        return ("sh", "-c", HOST_PROBE_KEPT, "sh", "reuse" if reuse else "keep", key, *probe)

    def status_argv(self, node):
        return ("sh", "-c", HOST_STATUS, "sh", self.run_dir(node), heartbeat_dir(self.inv, node))

    def stop_argv(self, node, grace=0, by=None):
        return ("sh", "-c", HOST_STOP, "sh", self.run_dir(node), str(grace), by or operator(),
                heartbeat_dir(self.inv, node))

    def diagnose_argv(self, node):
        return ("sh", "-c", program("diagnose"), "sh", heartbeat_dir(self.inv, node), spy_beside(self.inv.python_path()))

    def logs_argv(self, node, *, tail, follow):
        return tail_argv(f"{self.run_dir(node)}/log", tail=tail, follow=follow)


RUNTIMES = {r.name: r for r in (DockerRuntime, HostRuntime)}


def runtime(inv: Inventory, code: CodeDir | None = None, run: str | None = None) -> Runtime:
    return RUNTIMES[inv.job.runtime](inv, code, run)
