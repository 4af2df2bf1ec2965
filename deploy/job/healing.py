"""What the watcher of a job (``heal.watch``) keeps and decides, with nothing connected: its record
on the shared volume, each decision kept with the run, and the decision itself.

    <checkpoints.host>/.ddp-deploy/<job>/watch           who watches the job now, and what it does
    <checkpoints.host>/.ddp-deploy/<job>/runs/<id>/heal  each of its decisions about that run

Both sit where only this tool writes (tool_dir); they are read as data all the same: a line that
is not one of these records is no record. deploy/engines/fleet/heal.py runs the watch.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from ..inventory import Inventory
from ..programs import node_program
from .runtime import RUN_SUBDIR
from .scripts import TOOL_DIR

HEAL = TOOL_DIR + node_program("heal.sh")

WATCHING, HEALING, ENDED = "watching", "healing", "ended"
FINISHED, FAILED, STOPPED, NOT_HEALED = "finished", "failed", "stopped", "not healed"
OUTCOMES = (FINISHED, FAILED, STOPPED, NOT_HEALED)
STALE_S = 120  # a watcher whose record's beat is older is taken for gone
MIN_POLLS = 3  # a node is lost only after this many polls in a row found it silent, however long they took


def _argv(inv: Inventory, what: str, run: str = "") -> tuple[str, ...]:
    return ("sh", "-c", HEAL, "sh", what, inv.storage.checkpoints.host, RUN_SUBDIR, inv.job.name, run)


def put_argv(inv: Inventory) -> tuple[str, ...]:
    """stdin: the watcher's record (Watcher.line), which becomes the job's ``watch``."""
    return _argv(inv, "put")


def add_argv(inv: Inventory, run: str) -> tuple[str, ...]:
    """stdin: one decision (Event.line), appended to the run's ``heal``."""
    return _argv(inv, "add", run)


def read_argv(inv: Inventory) -> tuple[str, ...]:
    """``@@watch LINE``, where the job has a watch record."""
    return _argv(inv, "read")


def _object(text: str) -> dict | None:
    """The JSON object ``text`` holds (a record's line), if it holds one."""
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) else None


def _text(value, most: int = 2000) -> str | None:
    return value[:most] if isinstance(value, str) else None


def _time(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok and 0 <= value < 1e11 else None


def _names(value) -> tuple[str, ...]:
    return tuple(v[:64] for v in value[:64] if isinstance(v, str)) if isinstance(value, list) else ()


@dataclass(frozen=True)
class Watcher:
    """The job's watcher, as it keeps itself in ``watch``."""

    run: str
    """The run it watches now."""
    by: str
    """user@host it runs as and on."""
    pid: int
    machine: str
    """/etc/machine-id of its machine ("" where unknown)."""
    since: float
    beat: float
    """When it last polled the nodes (its machine's clock)."""
    state: str
    """watching | healing | ended"""
    said: str
    """Its last decision, one sentence."""
    nodes: tuple[str, ...] = ()
    """The nodes the job runs on now."""
    spares: tuple[str, ...] = ()
    """The spares left."""
    outcome: str = ""
    """Once ended: finished | failed | stopped (the operator's ``stop``) | not healed (the watcher
    ended the job: it could not go on)."""

    def line(self) -> bytes:
        return (json.dumps({"run": self.run, "by": self.by, "pid": self.pid, "machine": self.machine,
                            "since": round(self.since, 3), "beat": round(self.beat, 3), "state": self.state,
                            "said": self.said, "nodes": list(self.nodes), "spares": list(self.spares),
                            "outcome": self.outcome}) + "\n").encode()

    @classmethod
    def parse(cls, text: str) -> "Watcher | None":
        d = _object(text)
        if d is None or d.get("state") not in (WATCHING, HEALING, ENDED):
            return None
        run, by, said = _text(d.get("run"), 64), _text(d.get("by"), 200), _text(d.get("said"))
        since, beat, pid = _time(d.get("since")), _time(d.get("beat")), d.get("pid")
        if None in (run, by, said, since, beat) or not isinstance(pid, int) or isinstance(pid, bool):
            return None
        outcome = d.get("outcome") if d.get("outcome") in OUTCOMES else ""
        return cls(run, by, pid, _text(d.get("machine"), 64) or "", since, beat, d["state"], said,
                   _names(d.get("nodes")), _names(d.get("spares")), outcome)

    def alive(self, now: float) -> bool:
        """Ended, or polled within STALE_S of ``now`` (the clock of its machine against the
        reader's): a watcher that is gone (its machine lost, it was killed) decides nothing."""
        return self.state == ENDED or now - self.beat < STALE_S

    def same(self, other: "Watcher | None") -> bool:
        """``other`` is this very watcher (its record not replaced by another's, nor ended)."""
        return (other is not None and other.state != ENDED and (other.pid, other.machine, other.since)
                == (self.pid, self.machine, self.since))

    def describe(self, now: float) -> str:
        """``watcher root@op (pid 4242): watching run R on node1, node2 (spares: s1), polled 3 s ago: SAID``."""
        head = f"watcher {self.by} (pid {self.pid}): "
        if self.state == ENDED:
            return head + f"ended: {self.said}"
        where = f" on {', '.join(self.nodes)}" if self.nodes else ""
        spares = f" (spares: {', '.join(self.spares) or 'none left'})"
        said = f"{self.state} run {self.run}{where}{spares}, polled {max(0, now - self.beat):.0f} s ago"
        if not self.alive(now):
            said += (" (gone, it seems: its machine off or asleep, or it was killed; `ddp-deploy watch --detach` "
                     "starts another)")
        return head + said + (f"; {self.said}" if self.said else "")


@dataclass(frozen=True)
class Event:
    """One decision of the watcher about a run: kept in the run's ``heal``."""

    time: float
    what: str
    """lost | healed | refused | returned | ended | started"""
    said: str
    run: str | None = None
    """healed: the run it started; started: the run it took over from."""

    def line(self) -> bytes:
        return (json.dumps({"time": round(self.time, 3), "what": self.what, "said": self.said, "run": self.run})
                + "\n").encode()

    @classmethod
    def parse(cls, text: str) -> "Event | None":
        d = _object(text)
        if d is None:
            return None
        when, what, said = _time(d.get("time")), _text(d.get("what"), 20), _text(d.get("said"))
        if when is None or what is None or said is None:
            return None
        return cls(when, what, said, _text(d.get("run"), 64))

    def describe(self) -> str:
        return f"{time.strftime('%H:%M:%S', time.localtime(self.time))} {self.said}"

    def as_data(self) -> dict:
        return {"time": self.time, "what": self.what, "said": self.said, "run": self.run}


def parse_read(text: str) -> Watcher | None:
    """The watch record ``read_argv`` printed, if it is one."""
    found = [line[8:] for line in text.splitlines() if line.startswith("@@watch ")]
    return Watcher.parse(found[0]) if found else None


# --- deciding -----------------------------------------------------------------------------------

@dataclass
class Silence:
    """How long a node has not answered: since when (the watcher's monotonic clock) and how many
    polls in a row."""

    since: float
    polls: int = 1


@dataclass(frozen=True)
class Relaunch:
    """Stop what is left of the run and launch it again without ``lost``, ``spares`` in their place."""

    lost: tuple[str, ...]
    spares: tuple[str, ...]
    said: str


@dataclass(frozen=True)
class GoOn:
    """The job goes on without ``lost`` by itself (an elastic job, its rendezvous kept)."""

    lost: tuple[str, ...]
    said: str


@dataclass(frozen=True)
class End:
    """Healing is impossible: stop what is left of the job, and say why."""

    lost: tuple[str, ...]
    said: str


@dataclass
class Silences:
    """Each node's silence, poll after poll."""

    lost_after: float
    silent: dict[str, Silence] = field(default_factory=dict)

    def poll(self, answered: dict[str, bool], now: float) -> None:
        for name, ok in answered.items():
            if ok:
                self.silent.pop(name, None)
            elif name in self.silent:
                self.silent[name].polls += 1
            else:
                self.silent[name] = Silence(now)

    def lost(self, names, now: float) -> tuple[str, ...]:
        """Of ``names``, those silent for lost_after seconds and MIN_POLLS polls in a row."""
        return tuple(n for n in names if n in self.silent and self.silent[n].polls >= MIN_POLLS
                     and now - self.silent[n].since >= self.lost_after)

    def for_s(self, name: str, now: float) -> float:
        return now - self.silent[name].since if name in self.silent else 0.0


def decide(job: Inventory, lost: tuple[str, ...], spares: list[str], silent_s: dict[str, float]) -> Relaunch | GoOn | End:
    """What to do about ``lost`` (nodes of ``job``, lost for good), with ``spares`` ready (in the
    order to use them). The same world size where spares allow (a spare of each lost node's
    processes first: the same weights as an uninterrupted run); else the job smaller where
    job.min_nodes allows; else the end, with the reason."""
    kept = [n for n in job.nodes if n.name not in lost]
    gone = [job.node(n) for n in lost]
    by_procs = sorted(spares, key=lambda s: job.node(s).nprocs not in {g.nprocs for g in gone})
    use = tuple(by_procs[:len(lost)])
    floor = job.job.min_nodes or len(job.nodes)
    named = ", ".join(f"{n} (unreachable for {silent_s.get(n, 0):.0f} s)" for n in lost)
    rdzv_lost = job.rdzv_node.name in lost
    if len(kept) + len(use) < floor:
        why = (f"job.min_nodes is {job.job.min_nodes}" if job.job.min_nodes
               else f"a job of fixed size (job.min_nodes not set) needs its {len(job.nodes)} nodes")
        left = f"{len(use)} spare{'s' * (len(use) != 1)}" if use else "no spare"
        return End(lost, f"{named} lost for good, {left} left and {len(kept)} node(s) still answering: {why}; "
                         "the job ended here")
    if not use and not rdzv_lost:
        return GoOn(lost, f"{named} lost for good, no spare left: the job goes on on {len(kept)} nodes "
                          f"(job.min_nodes {job.job.min_nodes}), as its launchers do without a watcher")
    moved = f", the rendezvous moved from {job.rdzv_node.name} to {kept[0].name}" if rdzv_lost else ""
    instead = (f" with {', '.join(use)} in {'their' if len(lost) > 1 else 'its'} place" if use
               else f" on {len(kept)} nodes (job.min_nodes {job.job.min_nodes})")
    return Relaunch(lost, use, f"{named} lost for good: relaunched{instead}{moved}, from the newest checkpoint")


__all__ = ["ENDED", "FAILED", "FINISHED", "NOT_HEALED", "OUTCOMES", "STOPPED", "End", "Event", "GoOn", "HEALING", "Relaunch", "Silences", "WATCHING", "Watcher",
           "add_argv", "decide", "parse_read", "put_argv", "read_argv"]
