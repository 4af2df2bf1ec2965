"""Pure functions: inventory -> what to run on each node, as data.

Nothing here touches a node. Every command is an argv list; ``remote.py`` quotes it once.
Shell is used only where a pipe, redirection or detaching is needed, and then as a
constant script that receives every value as a positional argument (never interpolated).
``--dry-run`` prints exactly these lists and the unit tests assert on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .inventory import Inventory, Node

# Host runtime: per-node run directory (under the checkpoint dir, so logs sit with the run)
# holding `pid` (the process-group id of the detached torchrun), `log` (its stdout+stderr)
# and `exit` (its exit code, written when it ends).
RUN_SUBDIR = ".ddp-deploy"

# $1 = run dir, $2... = the command. Refuses when a previous run is recorded. Starts the
# command in its own session (setsid), so `stop` can kill the whole process group, waits for
# the pid file, then 1 s more so that an immediate failure (bad interpreter) is reported.
HOST_START = r"""run=$1; shift
if [ -e "$run/pid" ]; then echo "a previous run is recorded in $run (run: ddp-deploy stop)" >&2; exit 3; fi
mkdir -p "$run" || exit 1
rm -f "$run/exit" "$run/log"
DDP_DEPLOY_RUN=$run; export DDP_DEPLOY_RUN
setsid sh -c 'echo $$ > "$0/pid.tmp" && mv "$0/pid.tmp" "$0/pid"; "$@" > "$0/log" 2>&1 < /dev/null; echo $? > "$0/exit"' "$run" "$@" < /dev/null > /dev/null 2>&1 &
i=0; while [ ! -s "$run/pid" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
[ -s "$run/pid" ] || { echo "process did not start" >&2; exit 1; }
sleep 1
if [ -e "$run/exit" ] && [ "$(cat "$run/exit")" != 0 ]; then
  echo "exited with $(cat "$run/exit") at once: $(tail -n 3 "$run/log" | tr '\n' ' ')" >&2; exit 1
fi
cat "$run/pid"
"""

# $1 = run dir. Line 1: absent | running | exited CODE; line 2: last METRICS line, if any.
HOST_STATUS = r"""run=$1
if [ ! -e "$run/pid" ]; then echo absent; exit 0
elif [ -e "$run/exit" ]; then echo "exited $(cat "$run/exit")"
elif kill -0 "-$(cat "$run/pid")" 2>/dev/null; then echo running
else echo "exited ?"
fi
[ -e "$run/log" ] && grep '^METRICS ' "$run/log" | tail -n 1
exit 0
"""

# $1 = run dir. Kills the process group if it still runs, then forgets the run (log kept).
# torchrun starts each worker in a session of its own, so the group does not hold them: it
# gets 40 s to shut them down (it gives them 30 s), then every process still carrying this
# run's DDP_DEPLOY_RUN marker in its environment is killed too.
HOST_STOP = r"""run=$1
if [ -e "$run/pid" ] && [ ! -e "$run/exit" ]; then
  pid=$(cat "$run/pid")
  kill -TERM "-$pid" 2>/dev/null
  i=0; while kill -0 "-$pid" 2>/dev/null && [ $i -lt 400 ]; do sleep 0.1; i=$((i+1)); done
  kill -KILL "-$pid" 2>/dev/null
  for p in /proc/[0-9]*; do
    grep -qzx "DDP_DEPLOY_RUN=$run" "$p/environ" 2>/dev/null && kill -KILL "${p#/proc/}" 2>/dev/null
  done
  echo stopped
elif [ -e "$run/pid" ]; then echo "cleared (had exited $(cat "$run/exit"))"
else echo absent
fi
rm -f "$run/pid" "$run/exit"
"""

# $1 = container. Same two-line output as HOST_STATUS.
DOCKER_STATUS = r"""s=$(docker inspect --type container --format '{{.State.Status}} {{.State.ExitCode}}' "$1" 2>/dev/null) || { echo absent; exit 0; }
case "$s" in running*|restarting*) echo running ;; *) echo "exited ${s#* }" ;; esac
docker logs "$1" 2>&1 | grep '^METRICS ' | tail -n 1
exit 0
"""

# $1 = container. Idempotent remove.
DOCKER_STOP = r"""if docker inspect --type container "$1" > /dev/null 2>&1; then docker rm -f "$1" > /dev/null && echo stopped
else echo absent; fi
"""

# $1 = "chown" or "nochown", then the directories. Creates them; for the docker runtime and
# when root, hands them to uid 1000 (the image's `trainer` user); otherwise they must be writable.
MAKE_DIRS = r"""mode=$1; shift
mkdir -p "$@" || exit 1
if [ "$mode" = chown ] && [ "$(id -u)" = 0 ]; then chown 1000:1000 "$@" || exit 1
else for d in "$@"; do [ -w "$d" ] || { echo "$d is not writable by $(id -un)" >&2; exit 1; }; done
fi
"""


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one node, as data."""

    node: str
    node_rank: int
    torchrun: tuple[str, ...]
    """torchrun options (before `--` in the image's entrypoint)."""
    trainer: tuple[str, ...]
    """trainer flags."""
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[tuple[str, str], ...] = ()
    """(host path, container path); empty for the host runtime."""
    argv: tuple[str, ...] = field(default=())
    """The command actually run on the node."""


def container_name(inv: Inventory, node: Node) -> str:
    return f"{inv.job.name}-{node.name}"


def run_dir(inv: Inventory, node: Node) -> str:
    return f"{inv.storage.checkpoints.host}/{RUN_SUBDIR}/{inv.job.name}/{node.name}"


def torchrun_options(inv: Inventory, index: int) -> tuple[str, ...]:
    """torchrun flags for nodes[index].

    --node-rank is the inventory order; with the c10d backend torchrun ignores it (ranks
    follow arrival order) and it only matters for the static backend. --local-addr and
    is_host=1 on the endpoint node are required where hostnames do not resolve to the node's
    address (FIELD_NOTES: torchrun across those hosts).
    """
    node = inv.nodes[index]
    rdzv = inv.rdzv_node
    procs = {n.nprocs for n in inv.nodes}
    nnodes = str(len(inv.nodes))
    if len(procs) > 1:
        # Heterogeneous nodes still all have to join: an elastic range with min = max.
        nnodes = f"{len(inv.nodes)}:{len(inv.nodes)}"
    conf = f"join_timeout={inv.rendezvous.join_timeout}"
    if node.name == rdzv.name:
        conf = f"is_host=1,{conf}"
    return (
        "--nnodes", nnodes,
        "--nproc-per-node", str(node.nprocs),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", _endpoint(rdzv.address, inv.rendezvous.port),
        "--rdzv-id", inv.rdzv_id,
        "--rdzv-conf", conf,
        "--max-restarts", str(inv.job.max_restarts),
        "--local-addr", node.address,
        "--node-rank", str(index),
    )


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


def node_env(node: Node, detected: str | None = None) -> tuple[tuple[str, str], ...]:
    """The NIC for gloo and NCCL: the inventory's, else the one detected on the node."""
    interface = node.interface or detected
    if interface is None:
        return ()
    return (("GLOO_SOCKET_IFNAME", interface), ("NCCL_SOCKET_IFNAME", interface))


def trainer_flags(inv: Inventory) -> tuple[str, ...]:
    s = inv.storage
    if inv.job.runtime == "docker":
        dirs = ("--data-dir", s.data.container, "--ckpt-dir", s.checkpoints.container)
    else:
        dirs = ("--data-dir", s.data.host, "--ckpt-dir", s.checkpoints.host)
    return dirs + tuple(inv.train.args)


def launch_spec(inv: Inventory, index: int, detected_interface: str | None = None) -> LaunchSpec:
    node = inv.nodes[index]
    torchrun = torchrun_options(inv, index)
    trainer = trainer_flags(inv)
    env = node_env(node, detected_interface)
    s = inv.storage
    if inv.job.runtime == "docker":
        mounts = ((s.data.host, s.data.container), (s.checkpoints.host, s.checkpoints.container))
        argv = ["docker", "run", "-d", "--name", container_name(inv, node),
                "--label", f"ddp.job={inv.job.name}", "--label", f"ddp.node={node.name}",
                "--network", "host", "--ipc", "host", "--pull", "never"]  # only the image deploy verified
        if inv.job.max_restarts > 0:
            # A container whose torchrun was killed (OOM killer, kill -9) comes back and joins the
            # next rendezvous round; the survivors' agents restart their workers into that round.
            argv += ["--restart", f"on-failure:{inv.job.max_restarts}"]
        if node.gpus > 0:
            argv += ["--gpus", "all"]
        for src, dst in mounts:
            argv += ["-v", f"{src}:{dst}"]
        for k, v in env:
            argv += ["-e", f"{k}={v}"]
        argv += [inv.image.name, *torchrun, "--", *trainer]
    else:
        mounts = ()
        cmd = [inv.python_path(), "-m", "trainer.launch", *torchrun, "--", *trainer]
        if env:
            cmd = ["env", *(f"{k}={v}" for k, v in env), *cmd]
        argv = ["sh", "-c", HOST_START, "sh", run_dir(inv, node), *cmd]
    return LaunchSpec(node=node.name, node_rank=index, torchrun=torchrun, trainer=trainer,
                      env=env, mounts=mounts, argv=tuple(argv))


def launch_plan(inv: Inventory, interfaces: dict[str, str] | None = None) -> list[LaunchSpec]:
    """Every node's launch; ``interfaces`` holds NICs detected on nodes whose inventory has none."""
    interfaces = interfaces or {}
    return [launch_spec(inv, i, interfaces.get(n.name)) for i, n in enumerate(inv.nodes)]


def status_argv(inv: Inventory, node: Node) -> tuple[str, ...]:
    if inv.job.runtime == "docker":
        return ("sh", "-c", DOCKER_STATUS, "sh", container_name(inv, node))
    return ("sh", "-c", HOST_STATUS, "sh", run_dir(inv, node))


def stop_argv(inv: Inventory, node: Node) -> tuple[str, ...]:
    if inv.job.runtime == "docker":
        return ("sh", "-c", DOCKER_STOP, "sh", container_name(inv, node))
    return ("sh", "-c", HOST_STOP, "sh", run_dir(inv, node))


MERGE_STDERR = 'exec "$@" 2>&1'


def logs_argv(inv: Inventory, node: Node, *, tail: int | None, follow: bool) -> tuple[str, ...]:
    """The node's output (stdout and stderr merged), last ``tail`` lines or all."""
    if inv.job.runtime == "docker":
        argv = ["docker", "logs", "--tail", "all" if tail is None else str(tail)]
        if follow:
            argv.append("--follow")
        argv.append(container_name(inv, node))
    else:
        argv = ["tail", "-n", "+1" if tail is None else str(tail)]
        if follow:
            argv.append("-F")
        argv.append(f"{run_dir(inv, node)}/log")
    return ("sh", "-c", MERGE_STDERR, "sh", *argv)


def make_dirs_argv(inv: Inventory) -> tuple[str, ...]:
    mode = "chown" if inv.job.runtime == "docker" else "nochown"
    s = inv.storage
    return ("sh", "-c", MAKE_DIRS, "sh", mode, s.data.host, s.checkpoints.host)


def python_check_argv(inv: Inventory) -> tuple[str, ...]:
    return (inv.python_path(), "-c", "import trainer, torch; print(torch.__version__)")


@dataclass(frozen=True)
class NodeState:
    state: str
    """running | exited(CODE) | absent | unreachable"""
    metrics: str = ""

    @property
    def exists(self) -> bool:
        return self.state not in ("absent", "unreachable")

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def failed(self) -> bool:
        return self.state.startswith("exited(") and self.state != "exited(0)"


def parse_status(stdout: str) -> NodeState:
    """Parse the two-line output of HOST_STATUS / DOCKER_STATUS."""
    lines = stdout.splitlines()
    head = lines[0].strip() if lines else "absent"
    metrics = lines[1].strip() if len(lines) > 1 else ""
    if head.startswith("exited"):
        code = head.split(" ", 1)[1] if " " in head else "?"
        head = f"exited({code})"
    return NodeState(head, metrics)
