"""Every launch is a run with an id of its own, kept on the shared volume after it ends:

    <checkpoints.host>/.ddp-deploy/<job>/launch.json              the current run's record (join reads it)
    <checkpoints.host>/.ddp-deploy/<job>/runs/<id>/run.json       its record (record.py): what ran, where,
                                                                  the resolved hosts.yaml (secrets redacted),
                                                                  the image id, the start time
    <checkpoints.host>/.ddp-deploy/<job>/runs/<id>/<node>/log     the node's output, workers' lines with
                                                                  their rank in front
    <checkpoints.host>/.ddp-deploy/<job>/runs/<id>/<node>/exits   ``TIME CODE`` at each end of its launcher
                                                                  (one line per restart)
    <checkpoints.host>/.ddp-deploy/<job>/runs/<id>/<node>/group-formed   its launcher saw a rank's heartbeat
                                                                  (agent/formed.py)
    <checkpoints.host>/.ddp-deploy/<job>/runs/<id>/<node>.stopped the operator's stop (outcome.Stop), in the
                                                                  run's directory, which only this tool writes

The trainer's metrics records carry the id (``"run"``, agent/contract.py RUN_ID_ENV), and its
TensorBoard files are in ``<checkpoints.host>/tensorboard/<id>``. A launch keeps the newest
``job.keep_runs`` runs and removes older ones with their TensorBoard files; the run it starts is
the newest. Here: ids, paths and the shell that reads and writes them, as argv lists, and the
parsing of what they print. Nothing here connects anywhere.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import dataclass, field

from ..inventory import Inventory
from ..programs import node_program
from ..text import lines
from .healing import Event
from .outcome import FORMED_MARKER, NOTHING_TRAINED, Stop, describe_stop, trained
from .plan import NodeState
from .runtime import RUN_SUBDIR, as_job_argv, job_dir, kept_dir, runtime, tail_argv
from .scripts import AS_JOB_LIB, LAST_METRICS, TOOL_DIR
from .stall import STOPPED as STALL_STOPPED
from .stall import StallRecord, ended_state

RUN_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{4}")
"""UTC start time and 4 random hex digits: sorted by name, runs are sorted by start."""


def new_id(now: float | None = None) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + secrets.token_hex(2)


def runs_dir(inv: Inventory) -> str:
    return f"{job_dir(inv)}/runs"


def tensorboard_dir(inv: Inventory) -> str:
    return f"{inv.storage.checkpoints.host}/tensorboard"


# stdin: the run's record (start_run.sh has the arguments). Writes runs/ID/run.json and launch.json
# (the current run) atomically, then removes the oldest runs beyond the count (never this one) and
# their TensorBoard directories, saying which.
START_RUN = TOOL_DIR + AS_JOB_LIB + node_program("start_run.sh")

# A shell function: nodes_of RUNDIR prints, per node of the run, "@@node NAME", its exits and its
# last METRICS line (what ``parse`` reads; slurm.STATUS uses it too). The exits are the launcher's,
# which runs as the job: the end of the file alone (a thousand restarts' lines fit many times over),
# and no line of it that would read as one of this program's own (@@stopped: a stop never made).
NODES_OF = r"""nodes_of() {
  for n in "$1"/*/; do
    [ -d "$n" ] || continue
    echo "@@node $(basename "$n")"
    tail -c 65536 "$n/exits" 2>/dev/null | grep -a -v '^@@'
    [ -e "${n%/}.stopped" ] && { echo; head -c 300 "${n%/}.stopped" | head -n 1 | sed 's/^/@@stopped /'; echo; }
    [ -e "$n/stalls" ] && { echo; head -c 4000 "$n/stalls" | head -n 50 | sed 's/^/@@stall /'; echo; }
    [ -e "$n/""" + FORMED_MARKER + r"""" ] && { echo; echo @@formed; }
    [ -e "$n/log" ] && tail -c 1000000 "$n/log" | """ + LAST_METRICS + r"""
  done
}
"""

# $1 = a run's directory, then NODE/TIME for each kept stall wanted (runs.StallRecord): for each,
# "@@node NAME", "@@stall TIME" and what the node's diagnose program printed then (agent/heartbeat/,
# Watchdog.keep). Only the files the stall records name: the job can write this directory too.
STALL_DIAGNOSES = node_program("stall_diagnoses.sh")

# $1 = runs dir, $2 = an id or the start of one ("" for all). For every such run, oldest first:
# "@@run ID", its record, the watcher's decisions about it ("@@heal LINE", healing.Event), then its
# nodes (NODES_OF).
LIST_RUNS = NODES_OF + r"""cd "$1" 2>/dev/null || exit 0
for d in $(ls -1 | grep -E '^[0-9]{8}-[0-9]{6}-[0-9a-f]{4}$' | sort); do
  case "$d" in "$2"*) ;; *) continue ;; esac
  echo "@@run $d"
  cat "$d/run.json" 2>/dev/null; echo
  [ -f "$d/heal" ] && [ ! -L "$d/heal" ] && head -c 65536 "$d/heal" | head -n 200 | sed 's/^/@@heal /'
  nodes_of "$d"
done
exit 0
"""


def start_argv(inv: Inventory, run: str) -> tuple[str, ...]:
    return ("sh", "-c", START_RUN, "sh", runtime(inv).job_uid, inv.storage.checkpoints.host, RUN_SUBDIR,
            inv.job.name, run, str(inv.job.keep_runs), tensorboard_dir(inv))


def list_argv(inv: Inventory, prefix: str = "") -> tuple[str, ...]:
    return as_job_argv(inv, ("sh", "-c", LIST_RUNS, "sh", runs_dir(inv), prefix))


def stall_diagnoses_argv(inv: Inventory, run: str, wanted: list[tuple[str, int]]) -> tuple[str, ...]:
    """The kept diagnoses of ``wanted`` (node, time) in run ``run`` (STALL_DIAGNOSES)."""
    return as_job_argv(inv, ("sh", "-c", STALL_DIAGNOSES, "sh", f"{runs_dir(inv)}/{run}",
                             *(f"{n}/{t}" for n, t in wanted)))


def log_argv(inv: Inventory, run: str, node: str, *, tail: int | None, follow: bool) -> tuple[str, ...]:
    """A node's log of a kept run, as ``logs`` reads the running one."""
    return as_job_argv(inv, tail_argv(f"{kept_dir(inv, run, node)}/log", tail=tail, follow=follow))


STALL_WINDOW_S = 120
"""Stalls that nodes' launchers found within this many seconds of each other are one of the job."""


def parse_diagnoses(stdout: str) -> dict[tuple[str, int], str]:
    """What STALL_DIAGNOSES printed: (node, time) -> the node's diagnose program output for that stall."""
    found: dict[tuple[str, int], list[str]] = {}
    node, key = None, None
    for line in lines(stdout):
        if line.startswith("@@node "):
            node, key = line[7:].strip(), None
        elif line.startswith("@@stall ") and node is not None:
            word = line[8:].strip()
            key = (node, int(word)) if word.isascii() and word.isdigit() and len(word) <= 11 else None
            if key is not None:
                found[key] = []
        elif key is not None:
            found[key].append(line)
    return {k: "\n".join(v) for k, v in found.items()}


LAST_TIME = 253402300799.0
"""The last second of year 9999: a time past it (or before 1970, or not a number) is none a run
had, and reads as unknown."""


def _time(value) -> float | None:
    """A UNIX time read from the volume, or None where it is none: NaN, infinite, 400 digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        t = float(value)
    except (ValueError, OverflowError):
        return None
    return t if math.isfinite(t) and 0 <= t <= LAST_TIME else None


def _exit_code(word: str) -> int | None:
    """An exit status as a shell (0-255) or Python (minus a signal's number) reports it; None for
    any other word (``nan``, ``1e999``, 23 digits)."""
    if not re.fullmatch(r"-?[0-9]{1,3}", word):
        return None
    code = int(word)
    return code if -255 <= code <= 255 else None


def _finite(word: str) -> float | None:
    value = float(word)
    return value if math.isfinite(value) else None


def _json(text: str):
    """The JSON value of ``text``, NaN and infinite numbers (``NaN``, ``1e999``) as None, so that
    ``--json`` stays JSON; None where ``text`` is not JSON (or nested past the parser's depth)."""
    try:
        return json.loads(text, parse_float=_finite, parse_constant=lambda word: None)
    except (ValueError, RecursionError):
        return None


@dataclass(frozen=True)
class NodeRun:
    """What a node left in a run's directory."""

    exits: tuple[tuple[float | None, int | None], ...] = ()
    """(time, exit code) at each end of its launcher; None where its ``exits`` line said no
    number that fits (``_time``, ``_exit_code``)."""
    metrics: str = ""
    """Its last METRICS line."""
    stopped: Stop | None = None
    """How ``stop`` ended it, if it did (kept in ``<node>/stopped``)."""
    stalls: tuple[StallRecord, ...] = ()
    """The stalls its launcher found, oldest first (kept in ``<node>/stalls``)."""
    formed: bool = False
    """Its launcher saw a rank's heartbeat: a process group formed there (agent/formed.py)."""

    @property
    def stop(self) -> Stop | None:
        """The stop that ended the node's part of the run, if one did."""
        return self.stopped if self.stopped is not None and self.stopped.ended(self.exits) else None

    @property
    def ended(self) -> float | None:
        """When the node's part ended: its last exit, or its stop (None: not yet, or unknown)."""
        last = self.exits[-1][0] if self.exits else None
        if self.stop is not None and (last is None or last < self.stop.time - 1):
            return float(self.stop.time)
        return last

    def state(self) -> NodeState:
        if self.stop is not None:
            s = self.stop
            before = sum(1 for t, _ in self.exits if t is not None and t < s.time - 1)
            return NodeState(s.state(), self.metrics, before, stop=s, formed=self.formed)
        if not self.exits:
            return NodeState("no exit recorded", self.metrics, formed=self.formed)
        code = self.exits[-1][1]
        state = ended_state(code, self.stalls[-1] if self.stalls else None) or f"exited({'?' if code is None else code})"
        return NodeState(state, self.metrics, len(self.exits) - 1, formed=self.formed)

    @property
    def stall_stopped(self) -> bool:
        """Its launcher ended it on a stall (job.on_stall: stop)."""
        return self.stop is None and self.state().state == STALL_STOPPED


@dataclass(frozen=True)
class Run:
    id: str
    record: dict = field(default_factory=dict)
    nodes: dict[str, NodeRun] = field(default_factory=dict)
    heals: tuple[Event, ...] = ()
    """What the job's watcher decided about it (heal.watch), oldest first."""

    @property
    def healed(self) -> Event | None:
        """The watcher's relaunch that took the run's place, if one did."""
        return next((e for e in reversed(self.heals) if e.what == "healed"), None)

    @property
    def start(self) -> float | None:
        t = self.record.get("time")
        return _time(t) if isinstance(t, (int, float)) else None

    @property
    def end(self) -> float | None:
        """When the last node ended, once every node has (None: one has not, or its time is unknown)."""
        if not self.nodes or any(n.ended is None for n in self.nodes.values()):
            return None
        return max(n.ended for n in self.nodes.values())

    @property
    def stops(self) -> dict[str, Stop]:
        """The nodes a ``stop`` ended, and how."""
        return {n: r.stop for n, r in self.nodes.items() if r.stop is not None}

    def stop_data(self) -> dict | None:
        """How ``stop`` ended the run, as data (--json): the first node's stop (who, when), graceful
        on every node, and the step the program said it checkpointed at where every node that said
        one agrees (None otherwise; each node's own is in its ``stopped``)."""
        stops = list(self.stops.values())
        if not stops:
            return None
        steps = {s.step for s in stops if s.step is not None}
        return {**min(stops, key=lambda s: s.time).as_data(), "graceful": all(s.graceful for s in stops),
                "step": steps.pop() if len(steps) == 1 else None}

    def field(self, key: str) -> str | None:
        """The record's ``key`` where it is a string (the record is data from the volume)."""
        value = self.record.get(key)
        return value if isinstance(value, str) else None

    @property
    def image_id(self) -> str | None:
        image = self.record.get("image")
        return image.get("id") if isinstance(image, dict) and isinstance(image.get("id"), str) else None

    def procs(self, node: str) -> int | None:
        """How many processes ``node`` ran, as its record says (None: it does not say)."""
        listed = self.record.get("nodes")
        for n in listed if isinstance(listed, list) else ():
            if isinstance(n, dict) and n.get("name") == node:
                procs = n.get("procs")
                return procs if isinstance(procs, int) and not isinstance(procs, bool) and 0 <= procs < 2 ** 31 else None
        return None

    def stall_events(self, window: int = STALL_WINDOW_S) -> list[tuple[int, dict[str, StallRecord]]]:
        """The run's stalls, oldest first: each node's records within ``window`` s of the first of
        them are one stall of the job (a hang stalls every node, each launcher finds it by itself)."""
        found = sorted(((r.time, n, r) for n, nr in self.nodes.items() for r in nr.stalls), key=lambda x: (x[0], x[1]))
        events: list[tuple[int, dict[str, StallRecord]]] = []
        for when, node, rec in found:
            if events and when - events[-1][0] <= window and node not in events[-1][1]:
                events[-1][1][node] = rec
            else:
                events.append((when, {node: rec}))
        return events

    def stall_text(self) -> str:
        """``-`` | ``1 (restarted)`` | ``3 (2 restarted)`` | ``1 (reported)``: for ``runs``."""
        events = self.stall_events()
        if not events:
            return "-"
        restarted = sum(1 for _, recs in events if any(r.action == "restart" for r in recs.values()))
        stopped = any(r.action == "stop" for _, recs in events for r in recs.values())
        if stopped and len(events) == 1:
            what = "stopped"
        elif restarted == len(events):
            what = "restarted"
        elif not restarted and not stopped:
            what = "reported"
        else:
            what = ", ".join([f"{restarted} restarted"] * bool(restarted) + ["stopped"] * stopped)
        return f"{len(events)} ({what})"

    def outcome(self) -> str:
        """``exit 0`` | ``exit 1 (node2)`` | ``stopped by root@op at 12:01:03 (graceful, checkpoint at
        step 40)`` | ``no exit recorded (node1)`` | ``exited 0, but ... nothing shows it trained``
        (outcome.NOTHING_TRAINED): what its nodes ended with."""
        if not self.nodes:
            return "no node started"
        if self.healed is not None:  # its survivors' stop was the watcher's, to start the run that goes on
            return f"healed: run {self.healed.run} went on in its place"
        stops = self.stops
        stopped = describe_stop(list(stops.values()), self.start) if stops else ""
        open_ = [n for n, r in self.nodes.items() if not r.exits and n not in stops]
        failed = {n: r.exits[-1][1] for n, r in self.nodes.items()
                  if r.exits and r.exits[-1][1] != 0 and n not in stops}
        if failed:
            code = next(iter(failed.values()))
            return (f"exit {'?' if code is None else code} ({', '.join(failed)})"
                    + (f"; {stopped}" if stopped else ""))
        if stopped:
            return stopped + (f"; no exit recorded ({', '.join(open_)})" if open_ else "")
        if open_:
            return f"no exit recorded ({', '.join(open_)})"
        stalled = [n for n, r in self.nodes.items() if r.stall_stopped]
        if stalled:
            return f"stalled, stopped on {', '.join(stalled)} (job.on_stall: stop)"
        return "exit 0" if trained(self.nodes.values()) else NOTHING_TRAINED


def parse(stdout: str) -> list[Run]:
    """The runs LIST_RUNS printed, oldest first. A line ends at a newline alone (text.lines): the
    last METRICS line of a node is the job's text, and what it holds after a ``\\r`` (``@@node``,
    ``TIME CODE``) stays in it, never a line of its own."""
    runs: list[Run] = []
    run_id, record_lines, nodes, node, exits, metrics = None, [], {}, None, [], ""
    stops: dict[str, Stop | None] = {}

    stalls: dict[str, list[StallRecord]] = {}
    formed: set[str] = set()
    heals: list[Event] = []

    def close_node():
        if node is not None:
            nodes[node] = NodeRun(tuple(exits), metrics, stops.pop(node, None), tuple(stalls.pop(node, ())),
                                  node in formed)

    def close_run():
        if run_id is not None:
            close_node()
            record = _json("\n".join(record_lines) or "{}")
            runs.append(Run(run_id, record if isinstance(record, dict) else {}, dict(nodes), tuple(heals)))

    for line in lines(stdout):
        if line.startswith("@@run "):
            close_run()
            run_id, record_lines, nodes, node, exits, metrics = line[6:].strip(), [], {}, None, [], ""
            heals = []
        elif line.startswith("@@heal ") and node is None:
            event = Event.parse(line[len("@@heal "):])
            if event is not None:
                heals.append(event)
        elif line.startswith("@@node "):
            close_node()
            node, exits, metrics = line[7:].strip(), [], ""
        elif line.startswith("@@stopped ") and node is not None:
            stops[node] = Stop.parse(line[len("@@stopped "):])
        elif line == "@@formed" and node is not None:
            formed.add(node)
        elif line.startswith("@@stall ") and node is not None:
            found = StallRecord.parse(line[len("@@stall "):])
            if found is not None:
                stalls.setdefault(node, []).append(found)
        elif node is not None:
            parts = line.split()
            if line.startswith("METRICS "):
                metrics = line.strip()
            elif len(parts) == 2:  # TIME CODE: an end of the launcher, whether or not its words are numbers
                exits.append((_time(parts[0]), _exit_code(parts[1])))
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
