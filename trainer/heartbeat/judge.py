"""When a node is stalled (``job.stall_timeout``, ``auto`` from the ranks' own gaps), and a
heartbeat file as the node's status script prints it."""

from __future__ import annotations


FLOOR_S = 300.0
"""``stall_timeout: auto`` is never less than this."""
GAP_FACTOR = 10
"""``auto`` is this many times the longest interval between two beats a rank has shown."""
QUIET_S = 1800.0
"""``auto`` for a program without heartbeats: seconds of silence in its output."""


def stall_limit(setting, gaps: list[float | None], beating: bool) -> float | None:
    """The seconds without progress after which a node is stalled, under ``job.stall_timeout``
    (``setting``: ``auto``, a number, None for never), from its ranks' longest intervals (``gaps``;
    None where a rank does not say) when they beat, else for its output (``beating`` False)."""
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    if not beating:
        return QUIET_S
    return max(FLOOR_S, GAP_FACTOR * max((g for g in gaps if g is not None), default=0.0))


# --- what `status` reads ------------------------------------------------------------------------

LARGEST = 2 ** 53


def _whole(word: str) -> int | None:
    return int(word) if word.isascii() and word.isdigit() and len(word) <= 16 and int(word) <= LARGEST else None


PHASES = ("start", "init", "run", "done", "ended", "left")
"""A hooked worker's phase (the fourth word of its line; trainer/progress_hook): started, in
``init_process_group``, running (the group formed), done (``destroy_process_group``), ended (exited),
left (exited before its process group formed)."""
ENDED = ("ended", "left")

Beat = tuple  # (local rank, step, rank, gap in seconds, age in seconds, phase): parse_beat's


def parse_beat(name: str, age: str, text: str) -> Beat | None:
    """A heartbeat file as the node's status script printed it (its name, its age in seconds, its
    first line): (local rank, step, rank, gap in seconds, age in seconds, phase), or None where it is
    not one. A file written after the node's clock read (a negative age) is new: 0. The file is the
    job's: any field that is not a plain number is None, a phase not one of :data:`PHASES` None."""
    local, seconds = _whole(name), _whole("0" if age[:1] == "-" and _whole(age[1:]) is not None else age)
    if local is None or seconds is None:
        return None
    words = text.split()[:4]
    step, rank, gap = (*(_whole(w) for w in words[:3]), None, None, None)[:3]
    phase = words[3] if len(words) > 3 and words[3] in PHASES else None
    return local, step, rank, None if gap is None else gap / 1000, float(seconds), phase


LEFT_S = 10.0
"""How long a rank has ended, and its node's other ranks have not moved since, before that is a hang
whatever ``job.stall_timeout`` (:func:`verdict`): no peer's group forms without it."""


def verdict(setting, beats: list) -> tuple[float, float, str | None] | None:
    """What a node's beats (:func:`parse_beat`'s tuples) say under ``job.stall_timeout``
    (``setting``): ``(age, limit, left)``, the node stalled where ``age > limit``; ``left``: ``rank N`` (else
    ``local rank N``), the rank that ended while the others wait on it. None: they tell nothing (no live rank,
    or, with ``auto``, none has shown an interval yet: its start, judged by its output as before).

    A rank's clock starts when its worker starts (``start``). A number: no rank of the node moved for
    that long. ``auto``: :func:`stall_limit` of the intervals the ranks have shown; a start-up is not
    guessed from silence. Either way: a rank that ended (any exit code) while every other rank of
    the node is in ``init_process_group`` or has not got past its first collective (no interval
    yet) holds them for good, once :data:`LEFT_S` has passed. Ranks that ended, or are done with
    the process group, are not judged: their slow exit is no stall."""
    if setting is None:
        return None
    live = [b for b in beats if b[5] != "done" and b[5] not in ENDED]
    if not live:
        return None
    age = min(b[4] for b in live)
    ended = [b for b in beats if b[5] in ENDED]
    waiting = all(b[5] == "init" or (b[5] == "run" and b[3] is None) for b in live)
    if ended and waiting:
        last = min(ended, key=lambda b: b[4])
        age = min(age, last[4])
        if age > LEFT_S:
            return age, LEFT_S, f"rank {last[2]}" if last[2] is not None else f"local rank {last[0]}"
    shown = [b for b in live if b[5] is None or b[1] is not None or b[3] is not None]
    if setting == "auto" and not shown:
        return None
    return age, stall_limit(setting, [b[3] for b in shown], True), None


def state(setting, beats: list) -> dict:
    """What a node's ranks are doing, from their beats, for ``ddp-deploy jobs``: ``{"state",
    "step"}``, the state one of contract.STATES. ``starting``: no rank has beaten yet, or
    (``auto``) none has shown an interval; ``ending``: every rank is done with its process group or
    has ended (a finish, or a restart of the workers); ``stalled``: :func:`verdict` says so; else
    ``running``. With ``job.stall_timeout`` null nothing is judged stalled."""
    step = max((b[1] for b in beats if b[1] is not None), default=None)
    if not any(b[5] != "done" and b[5] not in ENDED for b in beats):
        return {"state": "ending" if beats else "starting", "step": step}
    seen = verdict(setting, beats)
    if seen is None:
        told = "running" if setting is None else "starting"
    else:
        told = "stalled" if seen[0] > seen[1] else "running"
    return {"state": told, "step": step}
