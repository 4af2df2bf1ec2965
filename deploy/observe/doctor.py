"""Why a job does not move: every rank's Python stack on every node, grouped by where it waits,
the odd ones named first. Nothing here connects anywhere.

Each node's diagnose program (deploy/job/runtime.py) lists the job's workers by exact identity and
dumps each one's threads with py-spy (a well-kept sampling profiler that reads a process's memory
without changing it: https://github.com/benfred/py-spy). A rank in a collective of
``torch.distributed`` waits for the others; a rank elsewhere (asleep, spinning, reading a file
that never comes) or stopped is what they wait for. When every rank waits, in different
collectives, the smaller group is the odd one out; a rank missing from the nodes is named as gone.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from .view import LARGEST

COLLECTIVES = "/torch/distributed/"
"""A frame in a file under this path is torch.distributed's: the rank waits in a collective there."""
HOOK = "ddp_deploy_progress.py"
"""The progress hook's wrappers of the collectives (agent/progress_hook): not the program's line."""
BACKWARD = "/torch/autograd/"
"""A frame in a file under this path is autograd's backward, where DDP's gradient all-reduce runs
(from the autograd engine's hooks, below any Python frame): a rank of a stalled DDP job there waits
for the other ranks' gradients."""
DDP = "/torch/nn/parallel/distributed.py"
DDP_COLLECTIVES = frozenset({"_distributed_broadcast_coalesced"})
"""DDP's own collectives, called from Python outside torch/distributed/: the broadcast of the module's
buffers at the start of every forward (a model with BatchNorm's running statistics) and of the
parameters when it is built. A rank there waits for the others as in any collective. py-spy names a
method by its qualified name on Python 3.11 and later (``DistributedDataParallel._distributed_broadcast_coalesced``)."""


@dataclass(frozen=True)
class Frame:
    name: str
    file: str
    """Its path (the short name, for display: :attr:`short`)."""
    line: int | None

    @property
    def short(self) -> str:
        return self.file.rsplit("/", 1)[-1]

    def text(self) -> str:
        return f"{self.name} ({self.short}:{'?' if self.line is None else self.line})"

    @property
    def in_collective(self) -> bool:
        return COLLECTIVES in self.file or (self.file.endswith(DDP) and self.name.rsplit(".", 1)[-1] in DDP_COLLECTIVES)

    @property
    def in_backward(self) -> bool:
        return BACKWARD in self.file


@dataclass(frozen=True)
class RankStack:
    """One worker of the job on a node, as the node's diagnose program found it."""

    node: str
    pid: int
    rank: int | None
    local_rank: int | None
    state: str
    """/proc's state letter: R running, S sleeping, D in the kernel (disk, NFS), T stopped, Z gone."""
    frames: tuple[Frame, ...] = ()
    """Its main thread's stack, innermost first (empty: not read, see ``problem``)."""
    problem: str | None = None
    collective: tuple[int, str] | None = None
    """Its newest collective in torch's flight recorder (trainer/flight.py): sequence number and name;
    None where the rank keeps none (a program other than the built-in trainer, an older torch)."""

    @property
    def label(self) -> str:
        return f"{self.node} rank {'?' if self.rank is None else self.rank}"

    @property
    def waiting(self) -> bool:
        """In a collective of torch.distributed, or in backward (DDP's gradient all-reduce), waiting
        for the other ranks."""
        return self.state != "T" and any(f.in_collective or f.in_backward for f in self.frames[:8])

    def where(self) -> str:
        """``all_reduce (train.py:88)``: the collective and the program's line that called it; else the
        innermost frame; or why nothing is known."""
        if self.state == "T":
            return "stopped (SIGSTOP: state T)"
        if self.state == "Z":
            return "exited (a zombie: its parent has not collected it)"
        if not self.frames:
            return f"unknown ({self.problem or 'no stack'})"
        if self.waiting:
            inside = [f for f in self.frames[:8] if f.in_collective]
            call = (next((f for f in inside if f.short == "distributed_c10d.py"), inside[0])  # not its wrappers
                    if inside else Frame("backward", BACKWARD, None))
            caller = next((f for f in self.frames if "/torch/" not in f.file and f.short != HOOK), None)
            at = caller or call
            where = f"({at.short}:{'?' if at.line is None else at.line})"
            if self.collective is None:
                return f"{call.name} {where}"
            # ranks on one line may be in different collectives (one a step behind): the number tells
            seq, op = self.collective
            return f"{call.name} #{seq} {where}" if op == call.name else f"{call.name} {where} in {op} #{seq}"
        return self.frames[0].text()


@dataclass(frozen=True)
class Diagnosis:
    summary: str
    ranks: tuple[RankStack, ...]
    groups: dict[str, list[str]]
    """Where -> the ranks there (labels), the largest group first."""
    culprits: tuple[str, ...]
    """The ranks named as holding the others up."""
    silent: dict[str, str] = field(default_factory=dict)
    """Nodes that did not answer, and why."""
    gone: tuple[int, ...] = ()
    """Ranks of the job found on no node (exited, or never started)."""


def _whole(word: str) -> int | None:
    return int(word) if word.isascii() and word.isdigit() and len(word) <= 9 else None


def parse(node: str, stdout: str) -> list[RankStack]:
    """A node's diagnose program output."""
    found: dict[int, dict] = {}
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "rank":
            parts = rest.split()
            if len(parts) == 4 and _whole(parts[0]) is not None:
                found[int(parts[0])] = {"rank": _whole(parts[1]), "local_rank": _whole(parts[2]),
                                        "state": parts[3][:1] if parts[3][:1].isalpha() else "?"}
        elif word == "stack":
            pid, _, dump = rest.partition(" ")
            if _whole(pid) in found:
                found[int(pid)].update(_stack(int(pid), dump))
        elif word == "fr":  # "fr PID SEQ OP" (trainer/flight.py)
            parts = rest.split()
            if len(parts) == 3 and _whole(parts[0]) in found and _whole(parts[1]) is not None \
                    and parts[2].isascii() and parts[2].replace("_", "").isalpha() and len(parts[2]) <= 40:
                found[int(parts[0])]["collective"] = (int(parts[1]), parts[2])
    return [RankStack(node=node, pid=pid, **fields) for pid, fields in found.items()]


def _stack(pid: int, dump: str) -> dict:
    """The main thread's frames from py-spy's JSON, or why there are none (its own words, cut short)."""
    try:
        threads = json.loads(dump)
    except (ValueError, RecursionError):
        return {"problem": " ".join(dump.split())[:200] or "py-spy printed nothing"}
    if not isinstance(threads, list) or not all(isinstance(t, dict) for t in threads):
        return {"problem": "py-spy printed no threads"}
    main = next((t for t in threads if t.get("os_thread_id") == pid), threads[0] if threads else None)
    frames = []
    for f in (main or {}).get("frames") or []:
        if isinstance(f, dict):
            line = f.get("line")
            frames.append(Frame(name=str(f.get("name"))[:200], file=str(f.get("filename"))[:500],
                                line=line if isinstance(line, int) and 0 <= line <= LARGEST else None))
    return {"frames": tuple(frames)} if frames else {"problem": "no Python frame"}


def _names(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def diagnose(ranks: list[RankStack], silent: dict[str, str], world_size: int | None = None) -> Diagnosis:
    """Groups the ranks by where they are and names the odd ones out, in one line first."""
    ranks = sorted(ranks, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.node, r.pid))
    groups: dict[str, list[RankStack]] = defaultdict(list)
    for r in ranks:
        groups[r.where()].append(r)
    ordered = dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))
    known = {r.rank for r in ranks if r.rank is not None}
    gone = tuple(i for i in range(world_size) if i not in known) if world_size and not silent else ()

    # Who holds the others up: ranks outside any collective (asleep, spinning, stopped, blocked in a
    # read); when every rank waits, the smaller groups of a split (ranks in mismatched collectives).
    readable = [r for r in ranks if r.frames or r.state in ("T", "Z")]
    culprits = [r for r in readable if not r.waiting]
    if not culprits and len({r.where() for r in readable}) > 1:
        largest = max(len(v) for v in ordered.values())
        culprits = [r for r in readable if len(ordered[r.where()]) < largest]
    others = [r for r in readable if r not in culprits]

    parts = []
    for where in dict.fromkeys(r.where() for r in culprits):
        labels = [r.label for r in culprits if r.where() == where]
        verb = "is" if len(labels) == 1 else "are"
        parts.append(f"{_names(labels)} {verb} {'' if where.startswith(('stopped', 'exited')) else 'in '}{where}")
    if others and culprits:
        places = list(dict.fromkeys(r.where() for r in others))
        wait = "waits" if len(others) == 1 else "wait"
        parts.append(f"the {len(others)} other rank{'s' * (len(others) != 1)} {wait} in {' / '.join(places)}")
    elif others:
        places = list(dict.fromkeys(r.where() for r in others))
        parts.append(f"all {len(others)} ranks found are in {' / '.join(places)}" if len(others) > 1
                     else f"the one rank found is in {places[0]}")
    if gone:
        parts.append(f"rank{'s' * (len(gone) != 1)} {', '.join(map(str, gone))} run{'s' * (len(gone) == 1)} on no node "
                     "(exited, or never started)")
    unknown = [r for r in ranks if r not in readable]
    if unknown:
        parts.append(f"no stack for {_names([r.label for r in unknown])}: {unknown[0].problem}")
    for node, why in silent.items():
        parts.append(f"{node} did not answer ({why})")
    if not ranks and not silent:
        parts.append("no rank of the job runs on any node")
    return Diagnosis(summary="; ".join(parts), ranks=tuple(ranks),
                     groups={k: [r.label for r in v] for k, v in ordered.items()},
                     culprits=tuple(r.label for r in culprits), silent=dict(silent), gone=gone)


def detail(d: Diagnosis, depth: int = 6) -> list[str]:
    """The lines after the summary: each rank, where it is, and on a line of its own, indented, the
    top of its stack. Each is one line: the caller shows it as text, where a newline inside would be
    shown escaped."""
    out = []
    for r in d.ranks:
        top = " < ".join(f.text() for f in r.frames[:depth])
        newest = f", newest collective {r.collective[1]} #{r.collective[0]}" if r.collective and not r.waiting else ""
        out.append(f"{r.label} (pid {r.pid}, state {r.state}{newest}): {r.where()}")
        if top:
            out.append(f"    {top}")
    return out
