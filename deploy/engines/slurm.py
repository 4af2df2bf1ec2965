"""The job on a Slurm cluster, as data: the batch script and the login node's commands.

hosts.yaml's ``slurm:`` replaces ``nodes:``. ``launch`` writes the batch script into the run's
directory on the shared volume and submits it with ``sbatch`` on the login node; Slurm
allocates the nodes, and the script starts one launcher (``python -m agent.launch``, i.e.
torchrun) per node with ``srun``, the c10d rendezvous on the allocation's first node. Each
task finds its own address and its peers' from Slurm (``NodeAddr``, never name resolution,
as on the SSH fleet: ``--local-addr``, ``is_host=1`` on the first node, the NIC holding the
address for gloo and NCCL) and keeps its output in the run's directory, as a fleet node does
(``runs/<id>/<node>/log`` and ``exits``), so ``runs``, ``logs`` and ``status --run`` read both
alike. ``status``, ``stop`` and ``logs`` go through the login node: ``scontrol``/``squeue``/
``sacct``, ``scancel``, the output files. A requeued job (preempted, a node failed) runs the
same script again: same run, its logs appended, resumed from the newest checkpoint.

Nothing here connects anywhere; ``cli.py`` runs these argv lists on the login node.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from agent.contract import HEARTBEAT_DIR_ENV, LAUNCH_MODULE, LOG_DIR_ENV, RUN_MODULE, program

from ..inventory import Inventory
from ..job.payload import payload
from ..job.plan import DRY_RUN, contract_env, count, rdzv_conf, stall_env, tool_flags, torchrun_procs
from ..job.runs import NODES_OF, parse as parse_runs
from ..job.runtime import STOP_GRACE_S, WORK_SUBDIR, CodeDir, job_dir, operator, runtime, spy_beside
from ..job.scripts import BEGIN_STOP, PROGRESS, RECORD_STOP
from ..programs import node_program
from ..text import lines as text_lines

# Where each node's ranks keep their heartbeats (agent/heartbeat/), in the node's memory: the
# Slurm job's and the node's own (the tasks and the steps ``status`` and ``doctor`` start in the
# allocation both have these variables; a requeued job's tasks find it again, emptied).
HEARTBEATS = "/dev/shm/ddp-heartbeat-slurm-$SLURM_JOB_ID@$SLURMD_NODENAME"

# $1 = "NAME=ADDR ..." of every allocated node, $2 = the first node's name, $3 = the rendezvous
# port, $4 = --rdzv-conf (without is_host), $5 = the run's directory, $6 = the interpreter, $7 = where
# the nodes' working directories are ("": the task's own), then the launcher's other options, --,
# the program's flags. Runs on each node (srun, one task per node): its address from the map
# (Slurm's NodeAddr), the NIC holding it for gloo and NCCL unless train.env names one, its output
# kept in the run's directory (agent.launch tees it there).
TASK = r"""addrs=$1; head=$2; port=$3; conf=$4; kept=$5; py=$6; work=$7; shift 7
self=""; head_addr=""
for kv in $addrs; do
  [ "${kv%%=*}" = "$SLURMD_NODENAME" ] && self=${kv#*=}
  [ "${kv%%=*}" = "$head" ] && head_addr=${kv#*=}
done
# shellcheck disable=SC2015  # either address missing: the message and out
[ -n "$self" ] && [ -n "$head_addr" ] || { echo "ddp-deploy: no address for $SLURMD_NODENAME or $head in: $addrs" >&2; exit 1; }
[ "$SLURMD_NODENAME" = "$head" ] && conf="is_host=1,$conf"
if [ -z "${GLOO_SOCKET_IFNAME:-}" ] && command -v ip > /dev/null; then
  nic=$(ip -o addr show | while read -r _ name _ addr _; do [ "${addr%/*}" = "$self" ] && { echo "${name%@*}"; break; }; done)
  if [ -n "$nic" ]; then GLOO_SOCKET_IFNAME=$nic; NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$nic}; export GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME; fi
fi
case "$head_addr" in *:*) endpoint="[$head_addr]:$port" ;; *) endpoint="$head_addr:$port" ;; esac
DDP_NODE_NAME=$SLURMD_NODENAME; """ + LOG_DIR_ENV + r"""=$kept/$SLURMD_NODENAME; """ + HEARTBEAT_DIR_ENV + "=" + HEARTBEATS + r"""
export DDP_NODE_NAME """ + LOG_DIR_ENV + " " + HEARTBEAT_DIR_ENV + r"""
mkdir -p "$kept/$SLURMD_NODENAME" || exit 1
if [ -n "$work" ]; then mkdir -p "$work/$SLURMD_NODENAME" && cd "$work/$SLURMD_NODENAME" || exit 1; fi
exec "$py" -c """ + shlex.quote(RUN_MODULE) + " " + LAUNCH_MODULE + r""" --rdzv-endpoint "$endpoint" --rdzv-conf "$conf" --local-addr "$self" --node-rank "$SLURM_NODEID" "$@"
"""

# The batch script's body, after its #SBATCH lines and exports: the nodes' addresses from
# Slurm, then one task per node. Its exit code is the tasks' (srun's).
BODY = node_program("body.sh")

# $1 = the file to write from stdin (atomically).
WRITE_FILE = 'mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv "$1.tmp" "$1"'

# $1 = job dir, $2 = the batch script, $3 = the run id; stdin: the secrets' NAME=VALUE lines (none:
# empty). Submits with them in sbatch's environment (Slurm hands it to the job; never in the
# script), then records "JOBID RUN" as the job's current Slurm job.
SUBMIT = node_program("submit.sh")

# $1 = job dir. "none" when no job was submitted; else "job ID RUN", then Slurm's line for it
# (scontrol: key=value; sacct once Slurm has forgotten it: "sacct STATE|EXITCODE|ELAPSED|NODES";
# "gone" when neither knows it), then "@@run RUN" and its nodes as runs.LIST_RUNS prints them.
STATUS = NODES_OF + r"""job=$1
[ -s "$job/slurm-job" ] || { echo none; exit 0; }
read -r id run < "$job/slurm-job"
echo "job $id $run"
if s=$(scontrol show job -o "$id" 2>/dev/null) && [ -n "$s" ]; then echo "scontrol $s"
elif s=$(sacct -n -P -X -j "$id" -o State,ExitCode,Elapsed,NodeList 2>/dev/null) && [ -n "$s" ]; then echo "sacct $s"
else echo gone; fi
echo "@@run $run"
nodes_of "$job/runs/$run"
exit 0
"""

# $1 = job dir, $2 = grace (s; 0: at once), $3 = who stops it (user@host). A job still queued or
# running: SIGTERM to its tasks (each launcher's workers finish their step and write a checkpoint:
# trainer/stopping.py), the job ends by itself; past the grace, scancel. The stop is kept in each
# node's directory of the run (RECORD_STOP, scope "job": a node's part may have ended before),
# with what that node printed since the stop began. Prints what the program said on stopping, if anything.
STOP = RECORD_STOP + BEGIN_STOP + r"""job=$1; grace=$2; by=$3
[ -s "$job/slurm-job" ] || { echo absent; exit 0; }
read -r id run < "$job/slurm-job"
active() {
  case "$(squeue -h -j "$1" -o %T 2>/dev/null)" in
    PENDING|CONFIGURING|RUNNING|COMPLETING|REQUEUE*|RESIZING|SUSPENDED|SIGNALING|STAGE_OUT|STOPPED) return 0 ;;
  esac
  return 1
}
if ! active "$id"; then echo "absent (Slurm job $id has ended)"; exit 0; fi
t0=$(date +%s); mode=now; [ "$grace" -gt 0 ] && mode=graceful
sizes=$(for n in "$job/runs/$run"/*/; do [ -d "$n" ] && echo "$( { wc -c < "$n/log"; } 2>/dev/null || echo 0) ${n%/}"; done)
# the stop is kept as begun before any task hears of it (BEGIN_STOP): `launch --wait` ends as a stop
for n in "$job/runs/$run"/*/; do [ -d "$n" ] && begin_stop "${n%/}" job "$mode" "$by" "$t0"; done
if [ "$grace" -gt 0 ] && [ "$(squeue -h -j "$id" -o %T)" = RUNNING ]; then
  scancel --signal=TERM "$id" || exit 1
  i=0; while active "$id" && [ $i -lt $((grace * 10)) ]; do sleep 0.1; i=$((i+1)); done
fi
if active "$id"; then scancel "$id" || exit 1; fi
i=0; while active "$id" && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
said=$(printf '%s\n' "$sizes" | while read -r from n; do
  [ -n "$n" ] || continue
  tail -c +$((from + 1)) "$n/log" 2>/dev/null | record_stop "$n" job "$mode" "$by" "$t0"; echo
done | grep -v '^$' | tail -n 1)
echo "stopped Slurm job $id$said"
"""

# What the login node offers: the Slurm commands, the partition, the shared volume, the interpreter.
# $1 = partition ("" for the default), $2 = checkpoint dir, $3 = data dir. One tagged line each.
CHECK = node_program("check.sh")


def script_path(inv: Inventory, run: str) -> str:
    """The batch script of a run, kept in its directory."""
    return f"{job_dir(inv)}/runs/{run}/job.sbatch"


def output_path(inv: Inventory, run: str) -> str:
    """The batch script's own output (%j: Slurm's job id; a requeue appends)."""
    return f"{job_dir(inv)}/runs/{run}/slurm-%j.out"


def sbatch_options(inv: Inventory, run: str, code: CodeDir | None = None) -> list[str]:
    s = inv.slurm
    opts = [f"--job-name={inv.job.name}", f"--nodes={s.nodes}", "--ntasks-per-node=1"]
    if s.gpus_per_node:
        opts.append(f"--gpus-per-node={s.gpus_per_node}")
    opts += [f"--{k}={v}" for k, v in (("partition", s.partition), ("account", s.account), ("qos", s.qos),
                                        ("time", s.time)) if v]
    if s.time:  # the program checkpoints before the time limit ends it (trainer/stopping.py)
        opts.append(f"--signal=TERM@{STOP_GRACE_S * 2}")
    opts.append("--requeue" if s.requeue else "--no-requeue")
    opts += ["--open-mode=append", f"--output={output_path(inv, run)}"]
    if code is not None and s.container is None:
        opts.append(f"--chdir={code.host}")
    return opts + list(s.sbatch_args)


def job_env(inv: Inventory, run: str, code: CodeDir | None = None) -> list[tuple[str, str]]:
    """The job's environment (plan.node_env's contract, but DDP_NODE_NAME and the NIC: each task's)."""
    env = contract_env(inv, *runtime(inv).job_dirs(), code, run)
    env.update(stall_env(inv))
    env.update(inv.train.env)
    return list(env.items())


def launcher_args(inv: Inventory) -> list[str]:
    """agent.launch's options that are the same on every node (TASK adds the rest), --, the program."""
    s = inv.slurm
    data, ckpt = runtime(inv).job_dirs()
    opts = ["--nnodes", str(s.nodes), "--nproc-per-node", torchrun_procs(inv, s.nprocs), "--rdzv-backend", "c10d",
            "--rdzv-id", inv.rdzv_id, "--max-restarts", str(inv.job.max_restarts)]
    return [*opts, *payload(inv).launcher_options(), "--",
            *payload(inv).program_args(data, ckpt, tool_flags(inv))]


def srun_argv(inv: Inventory, run: str, code: CodeDir | None = None) -> list[str]:
    """srun, one task per node, then (in the site's container, if any) TASK and its arguments;
    "$addrs" and "$head" are the batch script's variables (left unquoted by ``render``)."""
    s = inv.slurm
    argv = ["srun", f"--nodes={s.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
    python = inv.python_path()
    kept = f"{job_dir(inv, runtime(inv).job_dirs().ckpt)}/runs/{run}"
    mounts = ",".join(f"{h}:{c}" for h, c in runtime(inv).mounts())
    if s.container is not None:
        python = "python"
        workdir = "/workspace" if code else None
        if code is not None:
            mounts += f",{code.host}:/workspace:ro"
        if s.container.kind == "pyxis":
            argv += [f"--container-image={s.container.image}", f"--container-mounts={mounts}"]
            if workdir:
                argv.append(f"--container-workdir={workdir}")
        else:
            argv += ["apptainer", "exec", *(["--nv"] if s.gpus_per_node else []), "--bind", mounts]
            if workdir:
                argv += ["--pwd", workdir]
            argv.append(s.container.image)
    return [*argv, "sh", "-c", TASK, "sh", "$addrs", "$head", str(inv.rendezvous.port), rdzv_conf(inv), kept,
            python, work_root(inv, code), *launcher_args(inv)]


def work_root(inv: Inventory, code: CodeDir | None) -> str:
    """Where each node's working directory is made and entered by the task: without a container and
    without train.code, ``$DDP_CKPT_DIR/work`` (the host runtime's, as on an SSH fleet), so that
    the job does not run where ``sbatch`` happened to; "" otherwise (train.code's launcher makes
    the same directory itself, agent/workdir.py; a container keeps the image's)."""
    if code is not None or inv.slurm.container is not None:
        return ""
    return f"{runtime(inv).job_dirs().ckpt}/{WORK_SUBDIR}"


_SCRIPT_VARS = ("$addrs", "$head")


def _word(arg: str) -> str:
    return f'"{arg}"' if arg in _SCRIPT_VARS else shlex.quote(arg)


def batch_script(inv: Inventory, run: str = DRY_RUN, code: CodeDir | None = None) -> str:
    """The exact script ``launch`` submits (``export slurm`` and ``launch --dry-run`` print it). Secret
    values are never in it: sbatch's environment carries them (their names are listed)."""
    lines = ["#!/bin/bash", f"# ddp-deploy: job {inv.job.name}, run {run}: {payload(inv).describe()}"]
    lines += [f"#SBATCH {o}" for o in sbatch_options(inv, run, code)]
    if inv.train.secrets:
        lines.append(f"# secrets from sbatch's environment (ddp-deploy sets them): {' '.join(inv.train.secrets)}")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in job_env(inv, run, code)]
    lines += [BODY.rstrip("\n"), " ".join(_word(a) for a in srun_argv(inv, run, code)), ""]
    return "\n".join(lines)


# What the tool reads on the allocation's nodes while the job runs: one step beside the job's
# (srun --overlap), one task per node, each line labelled with its task (srun --label) and each
# task's first line "node NAME". $1 = the run's directory: each node's PROGRESS (its heartbeats,
# its log's age), as a fleet node's status script prints it.
NODE_PROGRESS = PROGRESS + 'run=$1; echo "node $SLURMD_NODENAME"; progress "' + HEARTBEATS + '" "$run/$SLURMD_NODENAME/log"\nexit 0\n'
# $1 = py-spy: each node's diagnose program (the job's workers and their stacks, deploy/observe/doctor.py). srun
# cuts a long line (a stack's JSON) into pieces that it labels each: the task cuts them itself,
# every piece after a line's first starting with "~ ", and :func:`by_node` joins them again.
NODE_DIAGNOSE = ('echo "node $SLURMD_NODENAME"; set -- "' + HEARTBEATS + '" "$1"\n{\n' + program("diagnose") + '} | awk '
                 + "'{ print substr($0, 1, 400); for (i = 401; i <= length($0); i += 400) print \"~ \" substr($0, i, 400) }'\n")

PROGRESS_EVERY_S = 10.0
"""How often ``launch --wait`` and ``status -f`` read the nodes' progress. Each read is a job step,
which Slurm logs and counts against the job (MaxStepCount, 40000 by default): a day's follow makes
under 9000 of them."""

ON_NODES_S = 45
"""How long a step on the allocation's nodes may take before the tool gives up on it (a node
that does not answer, or a step Slurm does not start beside the job)."""


def on_nodes_argv(inv: Inventory, job_id: str, script: str, *args: str) -> tuple[str, ...]:
    """``script`` on every node of the running Slurm job ``job_id``, from the login node."""
    return ("timeout", str(ON_NODES_S), "srun", f"--jobid={job_id}", "--overlap", f"--nodes={inv.slurm.nodes}",
            "--ntasks-per-node=1", "--label", "--quiet", "--kill-on-bad-exit=0", "sh", "-c", script, "sh", *args)


def progress_argv(inv: Inventory, job_id: str, run: str) -> tuple[str, ...]:
    return on_nodes_argv(inv, job_id, NODE_PROGRESS, f"{job_dir(inv, runtime(inv).job_dirs().ckpt)}/runs/{run}")


def diagnose_argv(inv: Inventory, job_id: str) -> tuple[str, ...]:
    spy = "py-spy" if inv.slurm.container is not None else spy_beside(inv.python_path())
    return on_nodes_argv(inv, job_id, NODE_DIAGNOSE, spy)


def by_node(stdout: str) -> dict[str, str]:
    """What a step on the nodes printed (:func:`on_nodes_argv`), each node's lines apart: srun's
    label names the task, the task's "node NAME" line the node, a "~ " piece the line before it
    goes on. Lines of no task are dropped."""
    tasks: dict[str, list[str]] = {}
    for line in text_lines(stdout):
        label, sep, text = line.partition(": ")
        if not (sep and label.strip().isdigit()):
            continue
        lines = tasks.setdefault(label.strip(), [])
        if text.startswith("~ ") and lines:
            lines[-1] += text[2:]
        else:
            lines.append(text)
    found = {}
    for lines in tasks.values():
        if lines and lines[0].startswith("node ") and lines[0][5:].strip():
            found[lines[0][5:].strip()] = "\n".join(lines[1:]) + "\n"
    return found


def write_argv(path: str) -> tuple[str, ...]:
    return ("sh", "-c", WRITE_FILE, "sh", path)


def submit_argv(inv: Inventory, run: str) -> tuple[str, ...]:
    return ("sh", "-c", SUBMIT, "sh", job_dir(inv), script_path(inv, run), run)


def status_argv(inv: Inventory) -> tuple[str, ...]:
    return ("sh", "-c", STATUS, "sh", job_dir(inv))


def stop_argv(inv: Inventory, grace: int = 0, by: str | None = None) -> tuple[str, ...]:
    """Ends the job's Slurm job; ``by`` (default: runtime.operator()) is kept as who stopped it."""
    return ("sh", "-c", STOP, "sh", job_dir(inv), str(grace), by or operator())


def check_argv(inv: Inventory) -> tuple[str, ...]:
    s = inv.storage
    return ("sh", "-c", CHECK, "sh", inv.slurm.partition or "", s.checkpoints.host, s.data.host)


ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT")


@dataclass(frozen=True)
class SlurmState:
    """What STATUS printed: the job's current Slurm job and how its nodes are doing."""

    job_id: str | None = None
    run: str | None = None
    state: str = "none"
    """Slurm's JobState (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...); none: never
    submitted; gone: Slurm no longer knows the job."""
    reason: str = ""
    exit_code: str = ""
    elapsed: str = ""
    nodelist: str = ""
    restarts: int = 0
    """How often Slurm requeued the job."""
    nodes: dict = field(default_factory=dict)
    """node -> runs.NodeRun (exits, last METRICS line)."""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED"


def parse_status(stdout: str) -> SlurmState:
    lines = text_lines(stdout)  # a node's METRICS line is the job's: a \r in it is data
    if not lines or lines[0].strip() == "none":
        return SlurmState()
    _, job_id, run = (lines[0].split() + ["", "", ""])[:3]
    fields: dict[str, str] = {}
    state = "gone"
    if len(lines) > 1 and lines[1].startswith("scontrol "):
        for kv in lines[1][len("scontrol "):].split():
            k, _, v = kv.partition("=")
            fields[k] = v
        state = fields.get("JobState", "?")
    elif len(lines) > 1 and lines[1].startswith("sacct "):
        parts = (lines[1][len("sacct "):].split("|") + ["", "", "", ""])[:4]
        state = parts[0].split()[0] if parts[0] else "?"
        fields = {"ExitCode": parts[1], "RunTime": parts[2], "NodeList": parts[3]}
    kept = parse_runs("\n".join(lines[2:]))
    nodes = kept[0].nodes if kept else {}
    reason = fields.get("Reason", "")
    return SlurmState(job_id, run, state, "" if reason in ("None", "(null)") else reason, fields.get("ExitCode", ""),
                      fields.get("RunTime", ""), fields.get("NodeList", ""),
                      count(fields.get("Restarts", "")), nodes)
