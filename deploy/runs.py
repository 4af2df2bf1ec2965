"""Every launch is a run with an id of its own, kept on the shared volume after it ends:

    <checkpoints.host>/.ddp-deploy/<job>/launch.json              the current run's record (join reads it)
    <checkpoints.host>/.ddp-deploy/<job>/runs/<id>/run.json       its record (record.py): what ran, where,
                                                                  the resolved hosts.yaml (secrets redacted),
                                                                  the image id, the start time
    <checkpoints.host>/.ddp-deploy/<job>/runs/<id>/<node>/log     the node's output, workers' lines with
                                                                  their rank in front
    <checkpoints.host>/.ddp-deploy/<job>/runs/<id>/<node>/exits   ``TIME CODE`` at each end of its launcher
                                                                  (one line per restart)

The trainer's metrics records carry the id (``"run"``, trainer/output.py RUN_ID_ENV), and its
TensorBoard files are in ``<checkpoints.host>/tensorboard/<id>``. A launch keeps the newest
``job.keep_runs`` runs and removes older ones with their TensorBoard files; the run it starts is
the newest. Here: ids, paths and the shell that reads and writes them, as argv lists, and the
parsing of what they print. Nothing here connects anywhere.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field

from .inventory import Inventory
from .plan import NodeState
from .runtime import LAST_METRICS, job_dir, kept_dir, tail_argv

RUN_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{4}")
"""UTC start time and 4 random hex digits: sorted by name, runs are sorted by start."""


def new_id(now: float | None = None) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + secrets.token_hex(2)


def runs_dir(inv: Inventory) -> str:
    return f"{job_dir(inv)}/runs"


def tensorboard_dir(inv: Inventory) -> str:
    return f"{inv.storage.checkpoints.host}/tensorboard"


# $1 = job dir, $2 = run id, $3 = runs to keep, $4 = TensorBoard dir. stdin: the run's record.
# Writes runs/ID/run.json and launch.json (the current run) atomically, then removes the oldest
# runs beyond the count (never this one) and their TensorBoard directories, saying which.
START_RUN = r"""job=$1; run=$2; keep=$3; tb=$4
mkdir -p "$job/runs/$run" || exit 1
cat > "$job/runs/$run/run.json.tmp" && mv "$job/runs/$run/run.json.tmp" "$job/runs/$run/run.json" || exit 1
cp "$job/runs/$run/run.json" "$job/launch.json.tmp" && mv "$job/launch.json.tmp" "$job/launch.json" || exit 1
ls -1 "$job/runs" | grep -E '^[0-9]{8}-[0-9]{6}-[0-9a-f]{4}$' | sort -r | tail -n +$((keep + 1)) | while read -r old; do
  [ "$old" = "$run" ] && continue
  rm -rf "$job/runs/$old" "$tb/$old" && echo "pruned $old"
done
exit 0
"""

# A shell function: nodes_of RUNDIR prints, per node of the run, "@@node NAME", its exits and its
# last METRICS line (what ``parse`` reads; slurm.STATUS uses it too).
NODES_OF = r"""nodes_of() {
  for n in "$1"/*/; do
    [ -d "$n" ] || continue
    echo "@@node $(basename "$n")"
    cat "$n/exits" 2>/dev/null
    [ -e "$n/log" ] && tail -c 1000000 "$n/log" | """ + LAST_METRICS + r"""
  done
}
"""

# $1 = runs dir, $2 = an id or the start of one ("" for all). For every such run, oldest first:
# "@@run ID", its record, then its nodes (NODES_OF).
LIST_RUNS = NODES_OF + r"""cd "$1" 2>/dev/null || exit 0
for d in $(ls -1 | grep -E '^[0-9]{8}-[0-9]{6}-[0-9a-f]{4}$' | sort); do
  case "$d" in "$2"*) ;; *) continue ;; esac
  echo "@@run $d"
  cat "$d/run.json" 2>/dev/null; echo
  nodes_of "$d"
done
exit 0
"""


def start_argv(inv: Inventory, run: str) -> tuple[str, ...]:
    return ("sh", "-c", START_RUN, "sh", job_dir(inv), run, str(inv.job.keep_runs), tensorboard_dir(inv))


def list_argv(inv: Inventory, prefix: str = "") -> tuple[str, ...]:
    return ("sh", "-c", LIST_RUNS, "sh", runs_dir(inv), prefix)


def log_argv(inv: Inventory, run: str, node: str, *, tail: int | None, follow: bool) -> tuple[str, ...]:
    """A node's log of a kept run, as ``logs`` reads the running one."""
    return tail_argv(f"{kept_dir(inv, run, node)}/log", tail=tail, follow=follow)


@dataclass(frozen=True)
class NodeRun:
    """What a node left in a run's directory."""

    exits: tuple[tuple[float, int], ...] = ()
    """(time, exit code) at each end of its launcher."""
    metrics: str = ""
    """Its last METRICS line."""

    def state(self) -> NodeState:
        if not self.exits:
            return NodeState("no exit recorded", self.metrics)
        return NodeState(f"exited({self.exits[-1][1]})", self.metrics, len(self.exits) - 1)


@dataclass(frozen=True)
class Run:
    id: str
    record: dict = field(default_factory=dict)
    nodes: dict[str, NodeRun] = field(default_factory=dict)

    @property
    def start(self) -> float | None:
        t = self.record.get("time")
        return float(t) if isinstance(t, (int, float)) else None

    @property
    def end(self) -> float | None:
        """When the last node ended, once every node has."""
        if not self.nodes or any(not n.exits for n in self.nodes.values()):
            return None
        return max(n.exits[-1][0] for n in self.nodes.values())

    def outcome(self) -> str:
        """``exit 0`` | ``exit 1 (node2)`` | ``no exit recorded (node1)``: what its nodes ended with."""
        if not self.nodes:
            return "no node started"
        open_ = [n for n, r in self.nodes.items() if not r.exits]
        failed = {n: r.exits[-1][1] for n, r in self.nodes.items() if r.exits and r.exits[-1][1] != 0}
        if failed:
            code = next(iter(failed.values()))
            return f"exit {code} ({', '.join(failed)})"
        if open_:
            return f"no exit recorded ({', '.join(open_)})"
        return "exit 0"


def parse(stdout: str) -> list[Run]:
    """The runs LIST_RUNS printed, oldest first."""
    runs: list[Run] = []
    run_id, record_lines, nodes, node, exits, metrics = None, [], {}, None, [], ""

    def close_node():
        if node is not None:
            nodes[node] = NodeRun(tuple(exits), metrics)

    def close_run():
        if run_id is not None:
            close_node()
            try:
                record = json.loads("\n".join(record_lines) or "{}")
            except ValueError:
                record = {}
            runs.append(Run(run_id, record if isinstance(record, dict) else {}, dict(nodes)))

    for line in stdout.splitlines():
        if line.startswith("@@run "):
            close_run()
            run_id, record_lines, nodes, node, exits, metrics = line[6:].strip(), [], {}, None, [], ""
        elif line.startswith("@@node "):
            close_node()
            node, exits, metrics = line[7:].strip(), [], ""
        elif node is not None:
            parts = line.split()
            if line.startswith("METRICS "):
                metrics = line.strip()
            elif len(parts) == 2 and parts[1].lstrip("-").isdigit():
                try:
                    exits.append((float(parts[0]), int(parts[1])))
                except ValueError:
                    pass
        elif run_id is not None:
            record_lines.append(line)
    close_run()
    return runs


def pick(runs: list[Run], wanted: str) -> Run:
    """The run whose id is ``wanted`` or starts with it; ValueError naming the choices if none or several."""
    exact = [r for r in runs if r.id == wanted]
    found = exact or [r for r in runs if r.id.startswith(wanted)]
    if len(found) == 1:
        return found[0]
    if not found:
        known = ", ".join(r.id for r in runs[-5:]) or "none"
        raise ValueError(f"no run {wanted!r} is kept (the newest: {known})")
    raise ValueError(f"{wanted!r} names {len(found)} runs ({', '.join(r.id for r in found[:5])}): give more of the id")
