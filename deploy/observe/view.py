"""What an operator sees of a running job: each node's state and progress, as data and as text.

A node's status (plan.NodeState: its state, restarts, last ``METRICS`` line) becomes a
:class:`Progress` (the fields of that line that say how far the job is), then a table row
(``status``), a dict (``status --json``) or one plain line (``--wait`` / ``--follow`` where the
output is not a terminal: CI logs, pipes). Nothing here connects anywhere.

The fields read from the program's METRICS line (docs/own-code.md); any may be
missing, or not a number that fits (:data:`LARGEST`), and shows as ``-``: ``epoch`` (with
``epochs``, the total), ``step``, ``loss``, ``acc``, ``samples_per_s``, and for the ETA ``eta_s``,
or ``steps_left`` with ``step_time_s``. Everything the job wrote is shown as text (deploy/text.py).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass, replace

from ..job.plan import NodeState
from ..job.stall import Stall
from ..text import safe

METRICS_PREFIX = "METRICS "


# torch's prefix of a worker's line (agent/launch.py RANK_PREFIX), its space gone where the line
# was empty and its end was stripped. ASCII digits only, and few: a prefix no worker has is text.
_RANK_PREFIX = re.compile(r"\[rank([0-9]{1,9})\]:(?: |$)")


def split_rank(line: str) -> tuple[int | None, str]:
    """``"[rank3]: text"`` -> (3, "text"); a line of torchrun's own -> (None, line).

    The rank is the first prefix's: torchrun's tee puts it in front of every line of a worker's
    stream, so it says whose stream the line came from. What comes after it is the program's, which
    can print ``[rank1]: `` too: that is text of the first prefix's rank, never a line of rank 1.
    The same rank's prefix again (torch prefixes an uncaught traceback's lines once more) is
    removed with it."""
    m = _RANK_PREFIX.match(line)
    if m is None:
        return None, line
    rest = line[m.end():]
    while (again := _RANK_PREFIX.match(rest)) and again[1] == m[1]:
        rest = rest[again.end():]
    return int(m[1]), rest


def log_label(node: str, rank: int | None) -> str:
    """What `logs` puts in front of a line: ``node1 rank3``, or the node alone (torchrun's lines)."""
    return node if rank is None else f"{node} rank{rank}"


def said_once(results: dict, shown: dict[str, str]) -> dict:
    """The results of a failed ``logs`` read (deploy/nodes/transport.py ``Result``s) to name in its
    error: a node's read that ran and failed says why in its last line, which ``logs`` showed among
    the node's lines where it was the last line shown (``shown``: node -> the last line shown); that
    one's result refers to it instead of repeating it. One it did not show (a ``--rank`` that
    left it out) stays in the error."""
    def once(node, r):
        if r.ok or r.error or not r.stdout or shown.get(node) != r.stdout:
            return r
        return replace(r, stdout="", stderr="its last line, shown above")
    return {n: once(n, r) for n, r in results.items()}


LARGEST = 2 ** 53
"""The largest magnitude a field may have to be shown (a float holds every integer up to it): no
count, rate or duration of a real job comes near it; beyond it, or not finite, a field is ``-``.
A loss may be any finite number (a diverging run's is huge): it shows in 4 digits."""


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)  # a 400-digit integer overflows
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _fits(value: float | None) -> float | None:
    return value if value is not None and abs(value) <= LARGEST else None


def _load(text: str):
    """A METRICS line's JSON, or None where it is none (or nested past the parser's depth)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


@dataclass(frozen=True)
class Progress:
    """How far one node's job is, from its last METRICS line."""

    kind: str | None = None
    epoch: int | None = None
    epochs: int | None = None
    step: int | None = None
    loss: float | None = None
    acc: float | None = None
    samples_per_s: float | None = None
    eta_s: float | None = None

    @classmethod
    def from_line(cls, line: str) -> "Progress":
        if not line.startswith(METRICS_PREFIX):
            return cls()
        m = _load(line[len(METRICS_PREFIX):])
        if not isinstance(m, dict):
            return cls()
        num = {k: _number(m.get(k)) for k in ("epoch", "epochs", "step", "loss", "acc", "eval_loss", "eval_acc",
                                               "samples_per_s", "eta_s", "steps_left", "step_time_s")}
        eta = num["eta_s"]
        if eta is None and num["steps_left"] is not None and num["step_time_s"] is not None:
            eta = _number(num["steps_left"] * num["step_time_s"])  # inf where the product overflows
        whole = lambda v: None if _fits(v) is None else int(v)  # noqa: E731
        return cls(kind=m["kind"] if isinstance(m.get("kind"), str) else None, epoch=whole(num["epoch"]),
                   epochs=whole(num["epochs"]), step=whole(num["step"]),
                   loss=num["loss"] if num["loss"] is not None else num["eval_loss"],
                   acc=_fits(num["acc"] if num["acc"] is not None else num["eval_acc"]),
                   samples_per_s=_fits(num["samples_per_s"]), eta_s=_fits(eta))

    def cells(self) -> dict[str, str]:
        """The columns of ``status``, formatted."""
        epoch = "-" if self.epoch is None else f"{self.epoch}" + ("" if self.epochs is None else f"/{self.epochs}")
        return {"epoch": epoch, "step": _fmt(self.step, "d"), "loss": _fmt(self.loss, ".4g"),
                "acc": acc_text(self.acc),
                "samples/s": _fmt(self.samples_per_s, ",.0f"),
                "ETA": "-" if self.eta_s is None or self.kind != "train" else duration(self.eta_s)}


def acc_text(acc: float | None) -> str:
    """``acc`` as ``status`` shows it (docs/own-code.md, Metrics): a fraction from 0 to 1 as the
    percentage it is (0.975 -> ``97.5%``; 1 is a fraction: ``100.0%``), a percentage above 1 up to
    100 as printed (97.5 -> ``97.5%``), and a value outside 0 to 100 as the number printed, no
    ``%`` (scaling it would show a share no accuracy has)."""
    if acc is None:
        return "-"
    if 0 <= acc <= 1:
        return f"{acc:.1%}"
    if 1 < acc <= 100:
        return f"{acc:.1f}%"
    return format(acc, ".6g")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def duration(seconds: float) -> str:
    """12s, 4m05s, 2h03m; ``-`` for a time that is no number (from the volume: NaN, infinite)."""
    if _fits(_number(seconds)) is None:
        return "-"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def state_text(s: NodeState) -> str:
    """running | running (2 restarts) | restarting (3 restarts) | exited(1) | unreachable ...
    | stalled 3m12s (last step 1234 since 12:01:03): a running node where nothing moved (deploy/job/stall.py)."""
    state = s.state if s.stall is None else stall_text(s.stall)
    if s.restarts and (s.running or s.ended):
        return f"{state} ({s.restarts} restart{'s' * (s.restarts != 1)})"
    return state


def stall_text(st: Stall) -> str:
    """``stalled 3m12s (last step 1234 since 12:01:03)``; a program without heartbeats:
    ``stalled 31m00s (no output since 12:01:03)``."""
    what = "no output" if st.evidence == "output" else "no step" if st.last_step is None else f"last step {st.last_step}"
    return f"stalled {duration(st.for_s)} ({what} since {time.strftime('%H:%M:%S', time.localtime(st.since))})"


def kept_stall_line(stall: dict) -> str:
    """``stalled at 12:01:03 on node1, node2 (no step for 6s after step 12; job.stall_timeout 5s):
    workers restarted``: one stall of a kept run (cli's ``status --run``)."""
    recs = stall["nodes"]
    steps = sorted({r["step"] for r in recs.values() if r["step"] is not None})
    after = f" after step {', '.join(map(str, steps))}" if steps else ""
    quiet = max(r["quiet_s"] for r in recs.values())
    limit = max(r["limit_s"] for r in recs.values())
    done = {"restart": "workers restarted (job.on_stall: restart)", "stop": "stopped (job.on_stall: stop)"}.get(
        stall["action"], "reported (job.on_stall: report)")
    return (f"stalled at {time.strftime('%H:%M:%S', time.localtime(stall['time']))} on {', '.join(sorted(recs))} "
            f"(no step for {duration(quiet)}{after}; job.stall_timeout {duration(limit)}): {done}")


def _key(s: NodeState) -> str:
    """What a plain follower shows a line for when it changes: the state, stalled or not."""
    return f"{s.state} {s.restarts} {s.stall is not None}"


COLUMNS = ("node", "state", "ranks", "epoch", "step", "loss", "acc", "samples/s", "ETA")


def as_data(node: str, ranks: int, s: NodeState) -> dict:
    """One node of ``status --json``: its state, restarts, progress fields, and the raw METRICS
    line (``metrics``; an unreachable node's: why)."""
    return {"node": node, "state": s.state, "restarts": s.restarts, "ranks": ranks,
            **asdict(Progress.from_line(s.metrics)), "metrics": s.metrics,
            "stalled": None if s.stall is None else asdict(s.stall),
            "heartbeats": [asdict(b) for b in s.beats], "quiet_s": s.quiet_s}


def line(node: str, s: NodeState, width: int = 0) -> str:
    """One plain line for a node: ``node1  running  epoch 1/8  step 37  loss 0.12 ...``."""
    cells = Progress.from_line(s.metrics).cells()
    shown = "  ".join(f"{k} {v}" for k, v in cells.items() if v != "-")
    return safe(f"{node:<{width}}  {state_text(s)}" + (f"  {shown}" if shown else ""))


class PlainFollower:
    """Plain lines for a log (not a terminal): a node's line when its state changes, else at most
    every ``every`` seconds while its progress moves."""

    def __init__(self, echo, every: float = 10.0, clock=time.monotonic) -> None:
        self.echo, self.every, self.clock = echo, every, clock
        self._shown: dict[str, tuple[str, str, float]] = {}

    def update(self, states: dict[str, NodeState]) -> None:
        width = max((len(n) for n in states), default=0)
        now = self.clock()
        for n, s in states.items():
            text = _key(s)
            last = self._shown.get(n)
            if last is None or last[0] != text or (last[1] != s.metrics and now - last[2] >= self.every):
                self.echo(line(n, s, width))
                self._shown[n] = (text, s.metrics, now)
