"""A job that heals itself (``heal.watch``): a watcher polls every node of the job, its spares and
the nodes it lost, and decides (deploy/job/healing.py) without an operator attached.

A node that stays unreachable for ``heal.lost_after`` seconds is lost for good. The watcher then
stops what is left of the run and launches the job again (``launch``, with its lock, its checks,
all or nothing) without the lost node: a spare in its place where one is ready (the same world
size: the same weights as an uninterrupted run, from the newest checkpoint), the rendezvous moved
to a surviving node if it was on the lost one. An elastic job that keeps its rendezvous goes on
without the node by itself; a job that cannot go on (no spare, fewer than ``job.min_nodes``, the
relaunch refused: its checks name why, a lost checkpoint volume among them) is stopped, with
that reason. A lost node that answers again has what is left of the job there ended, and stays
out: the job never takes back a node it lost, so a node that flaps costs one relaunch, not one per
flap. Each decision is kept with its run (``runs``); the job's ``watch`` record says who watches
it and what it does (``status``). ``stop`` ends the watch first (its record, ``ended``), so a
watcher never starts again a job its operator stopped: it reads that record before each start
and once more after.

It runs where the operator's tool runs (the CLI starts it detached from the terminal: a closed
terminal or a logged-out session does not end it), and it survives that machine sleeping: it
polls again when it wakes, a node counted lost only after ``MIN_POLLS`` polls in a row that found
it silent, and never while no node of the job answers at all (the watcher's own network is then
what is lost).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...errors import DeployError, JobStopped, RuntimeFailure
from ...inventory import Inventory, Node, load
from ...job import healing, plan, record, runs
from ...job.healing import ENDED, HEALING, WATCHING, Event, Watcher
from ...job.runtime import operator
from ...nodes.remote import Remote
from .actions import launch
from .common import Say, quiet, undo_start
from .watch import read_watch, states_of, verdict

POLL_S = 5.0
BEAT_POLLS = 3  # the watch record's beat is written every this many polls


class NotWanted(RuntimeFailure):
    """The watch was ended (``stop``) or taken over by another watcher: ``outcome`` as the record
    says ("" where taken over)."""

    def __init__(self, message: str, outcome: str = "") -> None:
        super().__init__(message)
        self.outcome = outcome


def machine_id() -> str:
    try:
        return Path("/etc/machine-id").read_text()[:64].strip()
    except OSError:
        return ""


class Watch:
    """One job's watch, from the run ``run`` of ``job`` (the inventory it was launched with: its
    nodes, its spares left). ``remote`` reaches every machine of hosts.yaml (``listed``)."""

    def __init__(self, job: Inventory, run: str, remote: Remote, *, hosts: str, redact=str, say: Say = quiet,
                 warn: Say = quiet, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.job, self.run, self.remote, self.hosts = job, run, remote, hosts
        self.redact, self.say, self.warn = redact, say, warn
        self.clock, self.sleep = clock, sleep
        # a short heal.lost_after is polled more often: a node is lost after MIN_POLLS polls and that long
        self.poll_s = max(1.0, min(POLL_S, job.heal.lost_after / (healing.MIN_POLLS + 1)))
        self.gone: dict[str, Node] = {}  # the nodes it lost, kept out
        self.refused: set[str] = set()  # spares whose relaunch was refused
        self.silences = healing.Silences(job.heal.lost_after)
        self.reader = job.nodes[0].name
        now = round(time.time(), 3)  # as its record keeps it: the record is compared with it
        self.me = Watcher(run, operator(), os.getpid(), machine_id(), now, now, WATCHING, f"watching run {run}",
                          tuple(n.name for n in job.nodes), tuple(s.name for s in job.spares))

    # --- the record ---------------------------------------------------------------------------

    def put(self, state: str | None = None, said: str | None = None) -> None:
        """The watch record rewritten: its state, its last decision (a secret the job printed, that a
        refusal quotes, masked: nothing of it rests on the volume), its beat."""
        said = self.redact(said) if said else self.me.said
        self.me = dataclasses.replace(self.me, state=state or self.me.state, said=said,
                                      beat=time.time(), run=self.run, nodes=tuple(n.name for n in self.job.nodes),
                                      spares=tuple(s.name for s in self.job.spares if s.name not in self.refused))
        got = self.remote.run({self.reader: healing.put_argv(self.job)}, stdin={self.reader: self.me.line()},
                              check=False, timeout=60)[self.reader]
        if not got.ok:
            self.warn(f"{self.reader}: the watch record was not written: {got.summary()}")

    def keep(self, run: str, what: str, said: str, other: str | None = None) -> None:
        """A decision about ``run``, kept with it (masked), and said."""
        said = self.redact(said)
        self.say(said)
        line = Event(time.time(), what, said, other).line()
        got = self.remote.run({self.reader: healing.add_argv(self.job, run)}, stdin={self.reader: line},
                              check=False, timeout=60)[self.reader]
        if not got.ok:
            self.warn(f"{self.reader}: the decision was not kept with run {run}: {got.summary()}")

    def still_mine(self, sure: bool = False) -> None:
        """A NotWanted where the watch record is no longer this watcher's (stopped, taken over);
        where no node reads it, nothing (``sure``: a NotWanted after a few tries, as before a start)."""
        for _ in range(3 if sure else 1):
            got = read_watch(self.job, self.remote, [self.reader, *(n.name for n in self.job.nodes)])
            if got is not None:
                break
            self.sleep(2 * sure)
        else:
            if sure:
                raise NotWanted("no node read the watch record just before a start: the watcher starts nothing "
                                "unsure that the job is still wanted")
            return
        found = got[1]
        if found is None:  # it wrote one when it began: the volume was lost or emptied since
            raise NotWanted(f"the watch record is gone from the shared volume ({self.reader} read none: the "
                            "checkpoint volume lost or emptied): the watcher ends, healing nothing more",
                            healing.NOT_HEALED)
        if not self.me.same(found):
            if found.state == ENDED:
                raise NotWanted(found.said, found.outcome)
            raise NotWanted("another watcher took the job over")

    # --- the watch ----------------------------------------------------------------------------

    def watch(self) -> tuple[str, str]:
        """Watches until the job ends, healing it where it can: how it ended (healing.OUTCOMES, or
        "" where another watcher took it over) and the last decision, one sentence."""
        self.put(WATCHING)
        polls = 0
        try:
            while True:
                ending = self.poll()
                if ending is not None:
                    self.me = dataclasses.replace(self.me, outcome=ending[0])
                    self.put(ENDED, ending[1])
                    return ending
                polls += 1
                if polls % BEAT_POLLS == 0:
                    self.put()
                self.sleep(self.poll_s)
        except NotWanted as e:
            return e.outcome, e.message

    def poll(self) -> tuple[str, str] | None:
        """One look at every machine, and what it calls for; the end's sentence once the watch is over."""
        every = (*self.job.nodes, *self.job.spares, *self.gone.values())
        states = states_of(self.job, every, self.remote, self.redact)
        now = self.clock()
        self.silences.poll({n: s.state != "unreachable" for n, s in states.items()}, now)
        # the job's nodes first: the reader of the shared volume (a spare mounts it too)
        answering = [n.name for n in (*self.job.nodes, *self.job.spares) if states[n.name].state != "unreachable"]
        if not answering:  # the watcher's own network, or its machine asleep: nothing to judge by
            return None
        self.reader = answering[0]
        self.still_mine()
        self.clear_returned(states)
        mine = {n.name: states[n.name] for n in self.job.nodes}
        if all(s.state != "unreachable" for s in mine.values()):
            ended = self.ended(mine)
            if ended is not None:
                return ended
        lost = self.silences.lost([n.name for n in self.job.nodes], now)
        return self.heal(lost, states, now) if lost else None

    def ended(self, states: dict[str, plan.NodeState]) -> tuple[str, str] | None:
        """The job's end, where every node of it has ended (or was stopped): how, and what to say of it."""
        if not all(s.ended or s.state == "absent" for s in states.values()):
            return None
        ending = self._verdict(states)
        self.keep(self.run, "ended", f"run {self.run} ended: {ending[1]}")
        return ending

    def _verdict(self, states) -> tuple[str, str]:
        try:
            return healing.FINISHED, verdict(self.job, states, self.remote, self.redact)
        except JobStopped as e:
            return healing.STOPPED, e.message
        except DeployError as e:  # a failure of the program, nothing trained: neither is a lost node
            return healing.FAILED, f"{e.message} (the program's end, not a lost node: not healed)"

    def heal(self, lost: tuple[str, ...], states, now: float) -> tuple[str, str] | None:
        spares = [s.name for s in self.job.spares
                  if s.name not in self.refused and states.get(s.name) and states[s.name].state not in
                  ("unreachable", "unknown") and not states[s.name].running]
        silent = {n: self.silences.for_s(n, now) for n in lost}
        decided = healing.decide(self.job, lost, spares, silent)
        if isinstance(decided, healing.GoOn):
            self.keep(self.run, "lost", decided.said)
            self._leave_out(lost)
            self.put(WATCHING, decided.said)
            return None
        survivors = self.job.without(lost) if isinstance(decided, healing.Relaunch) else None
        self.put(HEALING, decided.said)
        self._stop_what_is_left(lost)
        refusals = []  # each refused relaunch's spares and reason: the end says them
        while isinstance(decided, healing.Relaunch):
            try:
                self.relaunch(survivors, decided)
                return None
            except NotWanted:
                raise
            except DeployError as e:
                self.keep(self.run, "refused", f"the relaunch ({decided.said}) was refused: {e.message}")
                if not decided.spares:
                    said = f"{', '.join(lost)} lost, and the relaunch was refused: {e.message}"
                    break
                refusals.append(f"the relaunch with {', '.join(decided.spares)} was refused: {e.message}")
                self.refused.update(decided.spares)
                spares = [s for s in spares if s not in self.refused]
                decided = healing.decide(self.job, lost, spares, silent)
                if isinstance(decided, healing.GoOn):  # what was left is stopped now: it goes on by a relaunch
                    decided = healing.Relaunch(lost, (), decided.said)
        else:  # no relaunch left to try: the decision's reason, and each refusal's
            said = "; ".join((decided.said, *refusals))
        self.keep(self.run, "ended", said)
        return healing.NOT_HEALED, said

    def _stop_what_is_left(self, lost: tuple[str, ...]) -> None:
        """The run ended at once on every node that answers (a lost node's part, once it is back)."""
        left = [n.name for n in self.job.nodes if n.name not in lost]
        for n in undo_start(self.job, self.remote, left):
            self.warn(f"{n}: what was left of run {self.run} may still run there: it did not answer the stop")

    def relaunch(self, survivors: Inventory, decided: healing.Relaunch) -> None:
        new = survivors.with_spares(decided.spares) if decided.spares else survivors
        started = launch(new, self.remote, hosts=self.hosts, redact=self.redact, say=self.say, warn=self.warn,
                         confirm=lambda: self.still_mine(sure=True))
        try:
            self.still_mine(sure=True)  # a stop that began while it started: undone
        except NotWanted:
            undo_start(new, self.remote, list(started.nodes))
            raise
        old, self.run = self.run, started.run
        self._leave_out(decided.lost, new)
        self.keep(old, "healed", decided.said + f": run {started.run}", started.run)
        self.keep(started.run, "started", f"started by the watcher in place of run {old}: {decided.said}", old)
        self.put(WATCHING, f"{decided.said}: run {started.run}")

    def _leave_out(self, lost: tuple[str, ...], then: Inventory | None = None) -> None:
        """``lost`` kept out from now on (watched for their return); the job runs on ``then``
        (default: the others)."""
        for name in lost:
            self.gone[name] = self.job.node(name)
            self.silences.silent.pop(name, None)
        self.job = then or self.job.without(lost)

    def clear_returned(self, states) -> None:
        """A lost node that answers again with what is left of the job there: that part ended; the
        node stays out."""
        back = [n for n in self.gone if states[n].exists]
        if not back:
            return
        got = self.remote.run({n: plan.stop_argv(self.job, self.gone[n]) for n in back}, check=False, timeout=120)
        for n, r in got.items():
            if r.ok:
                self.keep(self.run, "returned", f"{n} answers again: what was left of the job there was ended; it "
                                                "stays out of the job (a node once lost is not taken back while "
                                                "the job runs)")
            else:
                self.warn(f"{n} answers again, but what is left of the job there was not ended: {r.summary()}")


def current_run(inv: Inventory, remote: Remote) -> str:
    """The id of the job's current run, as its launch record says (on the first node that reads it)."""
    where = record.path(inv)
    why = "no node answered"
    for node in inv.nodes:
        got = remote.run({node.name: ("cat", where)}, check=False, timeout=60)[node.name]
        found = record.decode(got.stdout) if got.ok else None
        run = found.get("run") if isinstance(found, dict) else None
        if isinstance(run, str) and runs.RUN_ID.fullmatch(run):
            return run
        why = got.summary() if not got.ok else "not a record this version wrote"
    raise RuntimeFailure(f"watch: no current run of {inv.job.name} in {where} ({why})",
                         hint="`ddp-deploy launch` starts one (and its watcher, with heal.watch)")


def detached(argv: list[str], log: Path) -> int:
    """Starts ``argv`` in a session of its own, its output to ``log``: a closed terminal (SIGHUP
    to its session) or the end of the command that started it does not end it. Its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, close_fds=True)
    return child.pid


def watcher_argv(hosts: str, without: tuple[str, ...], spares: tuple[str, ...], run: str) -> list[str]:
    """The command of a watcher of run ``run`` of the job launched with ``without`` and ``spares``."""
    return [sys.executable, "-m", "deploy", "--hosts", str(Path(hosts).resolve()),
            *(a for n in without for a in ("--without", n)), *(a for s in spares for a in ("--with", s)),
            "watch", "--run", run]


@dataclass(frozen=True)
class Started:
    """A watcher started detached: its process and its log."""

    pid: int
    log: Path

    def describe(self) -> str:
        return (f"watcher started (pid {self.pid}), detached from this terminal: it heals the job without you; "
                f"`ddp-deploy status` shows what it does, `ddp-deploy stop` ends it with the job; its log: {self.log}")


def start(inv: Inventory, hosts: str, run: str) -> Started:
    """A watcher of run ``run`` of the job ``inv`` (the nodes a launch ran it on), detached."""
    listed = load(hosts)
    ran = {n.name for n in inv.nodes}
    without = tuple(n.name for n in listed.nodes if n.name not in ran)
    spares = tuple(s.name for s in listed.spares if s.name in ran)
    log = log_path(inv)
    return Started(detached(watcher_argv(hosts, without, spares, run), log), log)


def log_path(inv: Inventory) -> Path:
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "ddp-deploy" / f"{inv.job.name}.watch.log"


__all__ = ["NotWanted", "POLL_S", "Started", "Watch", "current_run", "detached", "log_path", "start", "watcher_argv"]
