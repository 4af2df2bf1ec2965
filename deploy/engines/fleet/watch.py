"""A running job watched to its end, and what is true of it then: every node's state, the first
failure, a stall's diagnosis, a stop, a run that trained nothing."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from ...errors import JobStopped, LostContact, RuntimeFailure, StillRunning
from ...job import healing, outcome, plan, secretenv, stall
from ...observe import doctor, failure
from .common import FAILURE_TAIL, Say, quiet
from .kept import kept_runs, newest_stall


def verdict(inv, final, remote, redact) -> str:
    """The end of a followed job: what to say if every node (of an elastic job: every node not
    lost) exited with 0 and something shows that it trained; else a failure naming the nodes and
    the first failure (node, rank, exit code, the program's first error line), or a JobStopped
    where the operator's ``stop`` ended it."""
    if inv.heal.watch:
        watcher = watcher_of(inv, remote, final)
        if watcher is not None and watcher.outcome == healing.NOT_HEALED:
            raise RuntimeFailure(f"the job could not be healed: {watcher.said}",
                                 hint="`ddp-deploy runs` shows each of its watcher's decisions; bring a node back "
                                      "or add a spare, then launch again (it resumes from the newest checkpoint)")
    final = with_kept_ends(inv, remote, final, redact)
    lost = [n for n, s in final.items() if s.state in ("unreachable", "unknown")] if inv.elastic else []
    stopped = [n for n, s in final.items() if outcome.is_stopped(s.state)]
    failed = [n for n, s in final.items() if s.state != "exited(0)" and n not in lost and n not in stopped]
    stalled = [n for n, s in final.items() if s.state == stall.STOPPED]
    if stalled:  # the cause of any other node's end: each launcher ends its part when it finds the stall
        raise stalled_and_stopped(inv, remote, stalled, redact)
    if stopped:  # the ranks' ends under a stop (a peer gone first) are the stop's, not failures
        raise stopped_by_operator(final, stopped)
    if failed:
        first = first_failure(inv, remote, witnesses(final), redact)
        raise RuntimeFailure(f"the job failed on {', '.join(failed)}" + (f": {first.describe()}" if first else ""),
                             hint=f"`ddp-deploy logs{f' --tail {FAILURE_TAIL}' if first else ''}` shows the rest")
    untrained = nothing_trained(final, lost)
    if untrained:
        raise RuntimeFailure(untrained, hint=NOTHING_TRAINED_HINT)
    if lost:
        return (f"finished without {', '.join(lost)} (lost; job.min_nodes {inv.job.min_nodes}): the other "
                "nodes exited with code 0")
    return "all nodes finished with exit code 0"


def with_kept_ends(inv, remote, final, redact) -> dict[str, plan.NodeState]:
    """``final`` with each ``absent`` node (its container or run cleared by a ``stop`` that came after
    its part had ended on its own: no stop of it kept) in the state the job's newest run kept for it,
    so that a job that finished as a stop came is no failure; a node with no end kept stays absent."""
    cleared = [n for n, s in final.items() if s.state == "absent"]
    if not cleared:
        return final
    try:
        kept = kept_runs(inv, remote, "", redact).runs
    except RuntimeFailure:  # no node could read the volume: what the nodes showed is all there is
        return final
    nodes = kept[-1].nodes if kept else {}
    return {**final, **{n: nodes[n].state() for n in cleared if n in nodes and nodes[n].exits}}


NOTHING_TRAINED_HINT = ("a program that trains forms the process group (init_process_group) or prints METRICS lines "
                        "(docs/own-code.md); `ddp-deploy logs` shows what it did")


def nothing_trained(states, lost=()) -> str | None:
    """``every node exited 0, but ...: nothing shows it trained`` where every node (but the
    ``lost``) exited 0 and none formed a process group or printed a METRICS line; else None."""
    ended = [s for n, s in states.items() if n not in lost]
    if ended and all(s.state == "exited(0)" for s in ended) and not outcome.trained(ended):
        return f"every node {outcome.NOTHING_TRAINED}"
    return None


def stopped_by_operator(final, stopped: list[str]) -> JobStopped:
    """The end of a job that ``stop`` ended on the nodes ``stopped``: who stopped it, when and how,
    and how each other node had ended."""
    stops = [final[n].stop for n in stopped if final[n].stop is not None]
    said = outcome.describe_stop(stops, time.time()) if stops else "stopped (how: unknown)"
    before = [f"{n} {s.state}" for n, s in final.items() if n not in stopped]
    return JobStopped(f"the job was {said} with `ddp-deploy stop`, on {', '.join(stopped)}"
                      + (f"; ended before the stop reached them: {', '.join(before)}" if before else ""),
                      hint="not a failure of the job; launch again to resume from the newest checkpoint")


def stalled_and_stopped(inv, remote, stalled: list[str], redact) -> RuntimeFailure:
    """The end of a job whose nodes' launchers stopped it on a stall, with the kept diagnosis."""
    why = newest_stall(inv, remote, redact)
    return RuntimeFailure(f"the job stalled and was stopped on {', '.join(stalled)} (job.on_stall: stop)"
                          + (f": {why}" if why else ""),
                          hint="`ddp-deploy status --run ID` shows each stall and where the ranks were; "
                               "launch again to resume from the newest checkpoint")


UNREACHABLE_POLLS = 30  # consecutive 1-s polls before a silent node ends --wait
WATCHER_POLLS = 5  # a watched job's watcher record is read every this many polls


def watcher_of(inv, remote, states) -> healing.Watcher | None:
    """The job's watcher as its record says, read on a node that answered (``states``)."""
    got = read_watch(inv, remote, [n for n, s in states.items() if s.state != "unreachable"])
    return got[1] if got else None


def watched_inventory(inv, watcher: healing.Watcher):
    """The inventory of the nodes the watcher's record says the job runs on now: ``inv`` without
    the nodes it lost, with the spares it put in their place."""
    spares = {s.name for s in inv.spares}
    gone = [n.name for n in inv.nodes if n.name not in watcher.nodes]
    smaller = inv.without(gone) if gone else inv
    return smaller.with_spares([n for n in watcher.nodes if n in spares])


def wait(inv, remote, timeout, redact, show: Callable[[dict], None] = lambda states: None, say: Say = quiet,
         last: Callable[[dict], None] = lambda states: None) -> dict[str, plan.NodeState]:
    """Polls every node's state each second until the job has ended (an elastic job: on the nodes
    not lost), ``show`` each time; a RuntimeFailure past ``timeout`` or once too many nodes are
    lost, after ``last`` (the states then). A job with a live watcher (heal.watch) is followed into
    each run it heals the job to, and a lost node is the watcher's to judge: until it has healed
    the job, or ended it (heal.py)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    silent = {n.name: 0 for n in inv.nodes}
    floor = inv.job.min_nodes or len(inv.nodes)  # an elastic job goes on without lost nodes, down to this
    diagnosed = False
    polls, watcher = 0, None
    while True:
        states = node_states(inv, remote, redact)
        show(states)
        stalled = any(s.stall for s in states.values())
        if stalled and not diagnosed:  # once per stall: what every rank is doing, the odd ones first
            say(f"stalled: {diagnose(inv, remote, redact).summary} (`ddp-deploy doctor` shows each rank)")
        diagnosed = stalled
        for n, s in states.items():
            silent[n] = silent.get(n, 0) + 1 if s.state in ("unreachable", "unknown") else 0
        lost = [n for n, count in silent.items() if count >= UNREACHABLE_POLLS]
        polls += 1
        if inv.heal.watch and (polls % WATCHER_POLLS == 1 or all(
                s.ended or s.state in ("absent", "unreachable") for s in states.values())):
            watcher = watcher_of(inv, remote, states)  # what a lost node means is its watcher's to decide
            if watcher is not None and watcher.state == healing.WATCHING and watcher.nodes and set(
                    watcher.nodes) != {n.name for n in inv.nodes}:  # followed into the run it healed the job to
                inv = watched_inventory(inv, watcher)
                silent = {n.name: 0 for n in inv.nodes}
                say(f"healed: {watcher.said}; following run {watcher.run} on {', '.join(watcher.nodes)}")
                continue
        if watcher is not None and watcher.alive(time.time()):
            over = all(s.ended or s.state == "absent" for s in states.values())
            if (over and watcher.state != healing.HEALING) or watcher.outcome == healing.NOT_HEALED:
                return states
        elif len(inv.nodes) - len(lost) >= floor and all(
                s.ended or s.state == "absent" or n in lost for n, s in states.items()):
            return states
        if lost and len(inv.nodes) - len(lost) < floor and (watcher is None or not watcher.alive(time.time())):
            last(states)
            raise LostContact(f"lost contact with {', '.join(lost)} while the job ran",
                              hint="`ddp-deploy stop` ends it on the nodes still reachable; launch again to resume "
                                   f"(`ddp-deploy --without {lost[0]} launch` leaves a node out for good)")
        if deadline is not None and time.monotonic() > deadline:
            last(states)
            raise StillRunning(f"still running after {timeout:g} s",
                               hint="follow with `ddp-deploy status`, end it with `ddp-deploy stop`")
        time.sleep(1)


def witnesses(states) -> list[str]:
    """The nodes whose logs tell the first failure: the failed ones, and, once one has failed, those
    that exited 0 too (a rank that left early, failure.LeftEarly, is the cause on a node that ended well)."""
    if not any(s.failed for s in states.values()):
        return []
    return [n for n, s in states.items() if s.failed or s.state == "exited(0)"]


def first_failure(inv, remote, nodes, redact) -> failure.Failure | None:
    if not nodes:
        return None
    got = remote.run({n: plan.logs_argv(inv, inv.node(n), tail=FAILURE_TAIL, follow=False) for n in nodes},
                     check=False, timeout=60)
    return secretenv.masked(failure.first_failure({n: r.stdout for n, r in got.items() if r.ok}), redact)


def node_states(inv, remote, redact) -> dict[str, plan.NodeState]:
    """Every node's state; ``redact`` hides secret values in the metrics (a program may print them),
    once parsed: what a node's state is never depends on them. A spare is asked too, and shown
    where the job (or a run of it) is there: one put in the job by a ``--with`` that this command
    was not given."""
    states = states_of(inv, inv.and_spares().nodes, remote, redact)
    spares = {s.name for s in inv.spares}
    return {n: s for n, s in states.items() if n not in spares or s.exists}


def states_of(inv, nodes, remote, redact) -> dict[str, plan.NodeState]:
    """The job's state on each of ``nodes`` (of the inventory or not: a node left out, a spare)."""
    res = remote.run({n.name: plan.status_argv(inv, n) for n in nodes}, check=False, timeout=60)
    return {n: plan.with_stall(secretenv.masked(plan.parse_status(r.stdout) if r.ok else plan.NodeState(
                "unknown" if r.connected else "unreachable", r.summary()), redact), inv.job.stall_timeout)
            for n, r in res.items()}


def diagnose(inv, remote, redact) -> doctor.Diagnosis:
    """Every node's workers and their stacks, grouped (deploy/observe/doctor.py); what the job's stacks
    say is masked like its output (a secret in a function's name or a path)."""
    res = remote.run({n.name: plan.diagnose_argv(inv, n) for n in inv.nodes}, check=False, timeout=60)
    ranks, silent = [], {}
    for n, r in res.items():
        if r.ok:
            ranks += doctor.parse(n, redact(r.stdout))
        else:
            silent[n] = redact(r.summary())
    return doctor.diagnose(ranks, silent, sum(n.nprocs for n in inv.nodes))


def read_watch(inv, remote, nodes) -> tuple[str, healing.Watcher | None] | None:
    """The job's watch record (heal.py), as the first of ``nodes`` (names) that answers reads the
    shared volume: that node and the record (None: there is none); None where no node answered."""
    for node in nodes:
        got = remote.run({node: healing.read_argv(inv)}, check=False, timeout=60)[node]
        if got.ok:
            return node, healing.parse_read(got.stdout)
    return None


def end_watch(inv, remote, said: str) -> healing.Watcher | None:
    """Ends the job's watch, if one runs: its record says ``said``, and its watcher stops at its
    next poll and never starts the job again. The watcher it ended, if any."""
    got = read_watch(inv, remote, [n.name for n in inv.nodes])
    if got is None or got[1] is None or got[1].state == healing.ENDED:
        return None
    node, found = got
    ended = dataclasses.replace(found, state=healing.ENDED, said=said, outcome=healing.STOPPED)
    remote.run({node: healing.put_argv(inv)}, stdin={node: ended.line()}, check=False, timeout=60)
    return found
