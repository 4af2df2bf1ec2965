"""What the deploy tool and the node agent share, and nothing else crosses between them.

The variables ``ddp-deploy launch`` sets for the agent and its ranks, the lines a job prints that
the tool reads, the files a heartbeat directory and a run's directory hold, a heartbeat and what
it says (when a node is stalled), how a secret is masked, and the two node programs both sides run
(:func:`program`). Standard library only: the operator's install imports it without torch, and the
agent's modules run it on the nodes. deploy imports nothing else of ``agent`` or ``trainer``
(tests/test_deploy_imports.py).
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from urllib.parse import quote, quote_plus

# --- the modules the tool starts on a node --------------------------------------------------------

RUN_MODULE = ("import runpy, sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
              "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")
"""``python -c RUN_MODULE MODULE ARGS`` runs MODULE as ``-m`` would, without the working directory
on ``sys.path``: a project (the code snapshot, an image's WORKDIR) holding a top-level package of
the same name would otherwise be run instead (Python 3.11's ``-P``, for 3.10 too). The program the
launcher starts gets the working directory back: torchrun runs it with ``-m`` or as a script, its
own directory first, as usual. With ``-c``, sys.path[0] is '' (the working directory); the module
to run is argv[1]."""
LAUNCH_MODULE = "agent.launch"
"""A node's launcher: torchrun's agent, the job's watch, its holds, its output's copy."""
PROBE_MODULE = "agent.probe"
"""What ``check`` and ``launch`` ask a node first: versions, GPUs, the program importing."""
NETCHECK_MODULE = "trainer.netcheck"
"""``check --network``: collectives between the nodes, started by torchrun as a job is."""
TRAINER_MODULE = "trainer"
"""The built-in training program (``train.module`` unset, no ``train.script``)."""
TRAINER_FLAGS_MODULE = "trainer.config"
"""Run with the built-in trainer's flags: the one line saying what it refuses in them (exit 2), or
nothing (exit 0). The deploy tool asks it of ``train.args`` before anything starts."""


def module_argv(module: str) -> list[str]:
    """The interpreter's arguments that run ``module`` as ``-m`` would, the working directory left
    off the import path; the module's own arguments follow."""
    return ["-c", RUN_MODULE, module]


TORCH_SUPPORTED = ">=2.5.1,<2.15"
"""The torch versions the agent and the trainer run on (pip specifier; the same string as in
pyproject.toml). Tested at both ends and at the Dockerfile's default base (docs/testing.md)."""

# --- what the tool sets on every node ------------------------------------------------------------

RUN_ID_ENV = "DDP_LAUNCH_ID"
"""This launch's run id, new at every launch (``ddp-deploy runs`` lists them; ``DDP_RUN_ID``, the
job's rendezvous.id, stays the same across relaunches). The trainer tags each metrics record with it
(``"run"``) and names the run's TensorBoard directory after it."""
LOG_DIR_ENV = "DDP_DEPLOY_LOG_DIR"
"""For a container: the node's directory of the run on the shared volume, where the launcher keeps
a copy of its output (``log``) and its exit codes (``exits``)."""
HOLD_ENV = "DDP_HOLD"
"""What the launcher tells of its job, and the GPUs it holds: ``{"job": NAME, "run": ID, "gpus":
[INDEX...]}`` (agent/holds.py)."""
PREFORK_ENV = "DDP_PREFORK"
"""``1``: the launcher forks its workers from a zygote (deploy sets it on CPU nodes); ``0``: torchrun
starts them; unset: a zygote where no GPU can be opened (agent/zygote.py)."""
LAUNCHER_PID_ENV = "DDP_LAUNCHER_PID"
"""In a forked worker's environment: the launcher's pid (its parent is the zygote), where
trainer/startup.py starts its clock."""
SECRET_NAMES_ENV = "DDP_SECRET_NAMES"
"""Set when the job has secrets: their names, comma-separated (never a value). The launcher reads
the values from its own environment and masks its output with them."""
SNAPSHOT_ENV = "DDP_CODE_SNAPSHOT"
"""Set with train.code: the code is a read-only snapshot, at this path."""
CKPT_ENV = "DDP_CKPT_DIR"
NODE_ENV = "DDP_NODE_NAME"
WORK_SUBDIR = "work"
"""Under ``$DDP_CKPT_DIR``: a working directory per node, for a program run from train.code."""
FORMED_MARKER = "group-formed"
"""In the node's directory of the run: an empty file, a rank's heartbeat was seen there (a process
group formed on that node in that run; agent/formed.py)."""

# --- the lines a job prints that the tool reads ----------------------------------------------------

METRICS_PREFIX = "METRICS "
"""Rank 0 prints each metrics record as ``METRICS {json}``."""
RANK_PREFIXES = re.compile(r"^(?:\[rank(\d+)\]: ?)+")
"""On a fleet torchrun echoes every worker's line with its global rank in front (the launcher tees
them): ``[rank3]: ...``, twice on an uncaught exception's lines, which torch prefixes as well."""
PROBE_PREFIX = "PROBE "
"""The probe's answer: ``PROBE {json}``."""
PROBE_KEPT_PREFIX = "PROBE_KEPT"
"""The line before a kept answer: ``PROBE_KEPT <when it was probed, epoch seconds>``."""
HINT_PREFIX = "agent.launch: "
HINT_MARK = "read-only code snapshot"
"""In every line of the launcher's that says a write failed on the read-only code (agent/
snapshot_hint.py), and in no other."""


def printed(text: str) -> list[dict]:
    """The records in printed output, in order: ``METRICS`` lines, with or without the rank in front."""
    out = []
    for line in text.splitlines():
        line = RANK_PREFIXES.sub("", line, count=1)
        if line.startswith(METRICS_PREFIX):
            out.append(json.loads(line[len(METRICS_PREFIX):]))
    return out


def is_hint(line: str) -> bool:
    """Whether ``line`` (without a rank's prefix) is the launcher's word on a write into the snapshot."""
    return line.startswith(HINT_PREFIX) and HINT_MARK in line


# --- a job's watch: the heartbeat directory and what its files say ----------------------------------

HEARTBEAT_DIR_ENV = "DDP_HEARTBEAT_DIR"
ON_STALL_ENV = "DDP_ON_STALL"
"""``job.on_stall`` for the launcher's watchdog: ``report``, ``restart`` or ``stop``."""
STALL_TIMEOUT_ENV = "DDP_STALL_TIMEOUT"
"""``job.stall_timeout`` for the watchdog: ``auto``, seconds, or ``None`` (off)."""
STALL_RECORD_ENV = "DDP_STALL_RECORD"
"""Where the watchdog keeps a stall: the node's directory of the run (the launcher sets it)."""
DIAGNOSE_S = 120
"""The longest a stall's diagnosis may take (py-spy is given 20 s a worker)."""
SETTLE_S = 5.0
"""How long a launcher waits after its diagnosis before it kills its workers (restart, stop): a hang
stalls every node, and each one's launcher finds it within a few seconds of the others (their
limits alike); once one node's workers are killed, the others' fail, and their stacks say no more."""
DIAGNOSIS_BYTES = 1 << 20
"""The most of a diagnosis kept: py-spy's JSON of deep stacks, many threads, is large."""
WORKERS_DIR = "workers"
"""Under the heartbeat directory: ``LOCAL_RANK`` holding ``PID RANK`` of each worker the launcher's
zygote forked (agent/zygote.py), whose /proc environment is the launcher's."""
LAUNCHER_FILE = "launcher"
"""In the heartbeat directory: ``PID START`` of the launcher that made it, its pid in its own pid
namespace and its start (/proc/PID/stat's 22nd field, clock ticks after boot, which a pid reused
later never has): every worker of the job descends from that process, torchrun's agent."""
LINE_BYTES = 46
"""A beat's line: step (20 digits), rank (10), gap in ms (13), the spaces and the newline: fixed,
so that a write in place never leaves a longer line's end behind."""
STATES = ("starting", "running", "stalled", "ending")
"""A node's part of a job as its launcher tells ``ddp-deploy jobs`` (:func:`state`)."""

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


LARGEST = 2 ** 53


def _whole(word: str) -> int | None:
    return int(word) if word.isascii() and word.isdigit() and len(word) <= 16 and int(word) <= LARGEST else None


PHASES = ("start", "init", "run", "done", "ended", "left")
"""A hooked worker's phase (the fourth word of its line; agent/progress_hook): started, in
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
    "step"}``, the state one of :data:`STATES`. ``starting``: no rank has beaten yet, or
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


# --- secrets: masked alike on the node and on the operator's machine ---------------------------------

MASK = "***"


def _escapes(text: str) -> set[str]:
    """``text`` as a string literal's body: JSON (ASCII-only or not), Python's repr and ascii(),
    and the repr of its UTF-8 bytes."""
    return {json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1], ascii(text)[1:-1],
            repr(text)[1:-1], repr(text.encode())[2:-1]}


def forms(value: str) -> set[str]:
    """Every spelling of ``value`` masked: as is; as a JSON, Python (repr, ascii, bytes) string
    body, and each of those escaped once more (a JSON string in a JSON line, a repr in a dict);
    percent-encoded (a URL's query or path, ``+`` or ``%20`` for a space); base64 of its UTF-8
    bytes (standard and URL-safe, with and without padding). A program rarely prints a secret only
    as it is: a dict printed whole, a log record, a METRICS line or a URL spell it escaped."""
    once = _escapes(value)
    out = {value, *once}
    for text in once:
        out |= _escapes(text)
    out |= {quote(value, safe=""), quote_plus(value, safe="")}
    raw = value.encode()
    for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        out |= {encoded.decode(), encoded.decode().rstrip("=")}
    return {f for f in out if f}


class Mask:
    """Replaces every form of the given values with ``***``, in text or bytes, in one pass: on the
    node before a job's output is written anywhere (agent.launch), and on the operator's machine
    (deploy.job.secretenv.Redactor)."""

    def __init__(self, values=()) -> None:
        spelled = sorted({f for v in values if v for f in forms(v)}, key=len, reverse=True)
        # Longest first: where two forms start at the same place, the whole of the longer goes.
        self._text = re.compile("|".join(map(re.escape, spelled))) if spelled else None
        self._data = re.compile(b"|".join(re.escape(f.encode()) for f in spelled)) if spelled else None
        self.longest = len(spelled[0].encode()) if spelled else 0
        """The longest form, in bytes: how much of an unfinished line a stream's mask holds back."""

    def __bool__(self) -> bool:
        return self._text is not None

    def __call__(self, text: str) -> str:
        return self._text.sub(MASK, text) if self._text is not None else text

    def data(self, chunk: bytes) -> bytes:
        return self._data.sub(MASK.encode(), chunk) if self._data is not None else chunk

    @classmethod
    def from_environ(cls, names: str, environ=os.environ) -> Mask:
        """The values of the variables ``names`` lists (SECRET_NAMES_ENV's format) in ``environ``."""
        return cls(environ.get(n, "") for n in names.split(",") if n)


# --- the node programs both sides run ---------------------------------------------------------------

PROGRAMS = {
    "holds": "holds.py",
    "diagnose": "heartbeat/diagnose.sh",
}
"""``holds``: which jobs run on a node and which GPUs each holds (standard library only, Python
3.6+): the launcher holds its GPUs with it, and ``check`` and ``jobs`` send its text to a node's
``python3``. ``diagnose``: the job's workers on a node and their stacks, which ``doctor`` runs
through the job's runtime and the launcher's watch runs on a stall."""


def program(name: str) -> str:
    """The text of the node program ``name`` (a key of :data:`PROGRAMS`)."""
    return (Path(__file__).parent / PROGRAMS[name]).read_text()
