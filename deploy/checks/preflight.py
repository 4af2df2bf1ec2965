"""Checks run on every node before anything is started anywhere.

Every node runs ONE command (one SSH session: on fleets whose login shell runs conda or pyenv
init, each command costs a fraction of a second before it does anything), built by
:func:`check_argv`: a constant bash script that runs each check's argv list at the same time,
every value a positional argument, and prints tagged lines (``TAG o LINE``, ``TAG e LINE``,
``TAG rc CODE``) that ``parse_tagged`` turns back into one :class:`Result` per check. Each check
is its argv beside its judge (deploy/checks/node_checks.py, the nodes' meeting in meetings.py);
this module runs the session and collects the rows.

Two checks need the nodes to meet, and the session has two phases for them
(:func:`converse`):

- shared storage: in phase 1 every node writes its own token file under the checkpoint
  directory; once all have, the first reachable node is the reference and every other node
  reads the reference's token in phase 2; the reference ends last, and every node removes its
  own token file as it ends.
- rendezvous: the endpoint listens on the port during phase 1 while every other node connects.

An unreachable node gets one failed ``ssh`` (or ``local``) check naming the cause and no further
checks.

The same session reads each node's platform (its docker engine's, or the kernel's on the host
runtime): shown, and on the docker runtime nodes of another platform than the first node's are
refused (one image serves one platform; deploy builds it for the nodes' platform).

The same session gathers the node's facts that shape its launch command (:class:`NodeFacts`:
the NIC holding its address, InfiniBand devices), and runs ``agent.probe`` where the job will
run (in the image, or with the host interpreter; with the job's GPUs): torch and CUDA versions,
judged against the supported range, and on GPU nodes whether CUDA works there at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..inventory import Inventory, Node
from ..job.runtime import CodeDir, NodeFacts
from ..nodes.remote import Remote, Result
from .meetings import LISTEN_SECONDS, FleetMeeting, JoinMeeting
from .node_checks import (
    AFTER_MEETING, BEFORE_MEETING, PROBE_SECONDS, Asked, Check, FabricFact, NicsFact, parse_tagged,
)


MARKER = "@phase2"

# $1 = seconds each check may take, then per check: TAG N and the N words of its argv.
# Phase 1 starts every check at once, then prints each one's output as tagged lines (rc
# "124": it ran past the limit) and the MARKER line. Phase 2 reads one line from stdin:
# "READ PATH" prints PATH's content as tag "seen"; anything else, or EOF, just ends. On exit
# the node removes the token file its "token" check wrote.
PHASES = r"""limit=$1; shift
tmp=$(mktemp -d) || exit 1
mine=
trap 'rm -rf "$tmp"; [ -z "$mine" ] || timeout "$limit" rm -f "$mine"' EXIT
emit() {
  local line
  while IFS= read -r line || [ -n "$line" ]; do printf '%s o %s\n' "$1" "$line"; done < "$tmp/$1.o"
  while IFS= read -r line || [ -n "$line" ]; do printf '%s e %s\n' "$1" "$line"; done < "$tmp/$1.e"
  printf '%s rc %s\n' "$1" "$2"
}
tags=(); pids=()
while [ $# -gt 0 ]; do
  tag=$1; n=$2; shift 2
  timeout "$limit" "${@:1:n}" < /dev/null > "$tmp/$tag.o" 2> "$tmp/$tag.e" &
  tags+=("$tag"); pids+=($!)
  shift "$n"
done
for i in "${!tags[@]}"; do
  wait "${pids[i]}"; rc=$?
  [ "${tags[i]}" = token ] && mine=$(head -n 1 "$tmp/token.o")
  emit "${tags[i]}" "$rc"
done
echo '""" + MARKER + r"""'
if IFS= read -r -t $((2 * limit)) line && [ "${line%% *}" = READ ]; then
  timeout "$limit" cat "${line#READ }" < /dev/null > "$tmp/seen.o" 2> "$tmp/seen.e"
  emit seen $?
fi
"""

@dataclass(frozen=True)
class Preflight:
    """Every check's row, and what the sessions found on each reachable node."""

    checks: list[Check]
    facts: dict[str, NodeFacts]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def check_argv(inv: Inventory, node: Node, token: str, code: CodeDir | None = None,
               meeting: Sequence[tuple[str, Sequence[str]]] | None = None, *, reuse_probe: bool = False
               ) -> tuple[str, ...]:
    """The one command run on ``node``: every check's argv (deploy/checks/node_checks.py) in PHASES;
    ``token`` is empty for a one-node inventory; ``code``: the code snapshot the probe imports the
    program from; ``meeting``: the checks by which the node meets the others (default: the fleet's,
    :class:`FleetMeeting`); ``reuse_probe``: a probe answer the node kept for the same command and
    image serves (a launch's checks; ``check`` itself always probes, and keeps a good answer)."""
    asked = Asked(code, reuse_probe)
    if meeting is None:
        meeting = FleetMeeting.meeting_checks(inv, node, token)
    checks = [(c.tag, c.argv(inv, node, asked)) for c in BEFORE_MEETING if c.applies(inv, node)]
    checks += [*meeting, *((c.tag, c.argv(inv, node, asked)) for c in AFTER_MEETING if c.applies(inv, node))]
    argv = ["bash", "-c", PHASES, "bash", str(PROBE_SECONDS)]
    for tag, words in checks:
        argv += [tag, str(len(words)), *words]
    return tuple(argv)


def checks_from(inv: Inventory, first: Mapping[str, Result], final: Mapping[str, Result],
                meeting, *, for_launch: bool = False, code: CodeDir | None = None,
                nodes: Sequence[Node] | None = None) -> list[Check]:
    """Every node's Check rows from its session's output (``first``: up to the barrier)."""
    nodes = inv.nodes if nodes is None else nodes
    checks: list[Check] = []
    for n in nodes:
        r = first[n.name]
        how = "local" if n.connection == "local" else "ssh"
        checks.append(Check(n.name, how, r.connected, "reachable" if r.connected else r.error))
    up = [n.name for n in nodes if first[n.name].connected]
    if not up:
        return checks
    results = {}
    for node in up:
        got = parse_tagged(node, final[node].stdout)
        missing = Result(node, None, error=f"no result ({final[node].summary()})")
        results[node] = _Tags(got, missing)

    asked = Asked(code, for_launch)
    for check in BEFORE_MEETING:
        checks += check.judge(inv, up, results, asked)
    checks += meeting.judge(up, results)
    for check in AFTER_MEETING:
        checks += check.judge(inv, up, results, asked)
    return checks


class _Tags(dict):
    def __init__(self, got: dict[str, Result], missing: Result) -> None:
        super().__init__(got)
        self.missing = missing

    def __missing__(self, tag: str) -> Result:
        return self.missing



def run_checks(inv: Inventory, remote: Remote, *, for_launch: bool = False, code: CodeDir | None = None) -> Preflight:
    """Every check on every node, one session each; ``for_launch``: the image must be on the
    nodes already (``check`` alone accepts a node that ``deploy`` has yet to ship it to);
    ``code``: the synced code snapshot (train.code), where the program must import."""
    return _run(inv, remote, inv.nodes, FleetMeeting(inv), for_launch=for_launch, code=code)


def join_checks(inv: Inventory, remote: Remote, node: str, record: tuple[str, str],
                code: CodeDir | None = None) -> Preflight:
    """The launch's checks on ``node`` alone, before it joins the job that runs on the others
    (``inv``'s rendezvous node hosts its store): ``record`` is the job's launch record (path,
    content) as a running node read it, which ``node`` must see the same on the shared storage."""
    return _run(inv, remote, (inv.node(node),), JoinMeeting(inv, *record), for_launch=True, code=code)


def _run(inv: Inventory, remote: Remote, nodes: Sequence[Node], meeting, *, for_launch: bool,
         code: CodeDir | None) -> Preflight:
    commands = {n.name: check_argv(inv, n, "", code, meeting.checks(n), reuse_probe=for_launch) for n in nodes}
    first: dict[str, Result] = {}

    def reply(phase1: dict[str, Result]) -> list[dict[str, str]]:
        first.update(phase1)
        return meeting.waves(phase1)

    final = converse(remote, commands, marker=MARKER, reply=reply, timeout=PROBE_SECONDS + LISTEN_SECONDS + 30)
    return Preflight(checks_from(inv, first, final, meeting, for_launch=for_launch, code=code, nodes=nodes),
                     facts_from(inv, first, final, nodes))


def converse(
    remote: Remote,
    commands: Mapping[str, Sequence[str]],
    *,
    marker: str,
    reply: Callable[[dict[str, Result]], Sequence[Mapping[str, str]]],
    timeout: float | None = None,
) -> dict[str, Result]:
    """Run commands whose stdin stays open, in two phases with one barrier between them.

    Once every node has printed the line ``marker`` (or ended, or failed to start),
    ``reply`` gets each node's output so far (``exit_code`` None while it still runs) and
    returns waves of ``{node: text}``: each wave's nodes get their text on stdin, then EOF,
    and are read to the end before the next wave starts; nodes in no wave get EOF last.
    Each node's final :class:`Result` holds its whole output except the marker line. One
    command per node however many phases: a login shell that is slow to start starts once.
    ``timeout`` bounds each wait for output.
    """
    sessions = {}
    first: dict[str, Result] = {}

    def start(node: str) -> Result:
        s = sessions[node] = remote.start(node, commands[node], timeout)
        lines = []
        try:
            while raw := s.readline():
                line = raw.decode(errors="replace")
                if line.rstrip("\n") == marker:
                    return Result(node, None, "".join(lines))
                lines.append(line)
        except BaseException:
            sessions.pop(node).close()
            raise
        code, _, err = sessions.pop(node).finish(b"")
        return Result(node, code, "".join(lines), err.decode(errors="replace"))

    def finish(node: str, text: str) -> Result:
        code, rest, err = sessions.pop(node).finish(text.encode())
        return Result(node, code, first[node].stdout + rest.decode(errors="replace"), err.decode(errors="replace"))

    try:
        first.update(remote.parallel(list(commands), start))
        final = {n: r for n, r in first.items() if n not in sessions}
        for wave in [*reply(dict(first)), {n: "" for n in commands}]:
            todo = {n: text for n, text in wave.items() if n in sessions}
            final.update(remote.parallel(list(todo), lambda n: finish(n, todo[n])))
    finally:
        for s in sessions.values():
            s.close()
    return {n: final[n] for n in commands}


def facts_from(inv: Inventory, first: Mapping[str, Result], final: Mapping[str, Result],
               nodes: Sequence[Node] | None = None) -> dict[str, NodeFacts]:
    facts = {}
    for n in inv.nodes if nodes is None else nodes:
        if not first[n.name].connected:
            continue
        got = parse_tagged(n.name, final[n.name].stdout)
        facts[n.name] = NodeFacts(interface=NicsFact.fact(n, got.get(NicsFact.tag)),
                                  infiniband=FabricFact.fact(got.get(FabricFact.tag)))
    return facts
