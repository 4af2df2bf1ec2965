"""Each rank's progress, kept where `status` reads it cheaply: one small file per local rank in a
node-local directory, never on the shared volume. No torch here (the deploy tool reads these too).

``ddp-deploy launch`` sets ``DDP_HEARTBEAT_DIR`` on every node
(``/dev/shm/ddp-heartbeat-RUNTIME-JOB@NODE-WHERE``, WHERE a hash of the job's directory on the
shared volume: memory, and a container with ``--ipc host`` shares it with its node); the launcher makes it empty
and private to the run. A rank writes ``$DDP_HEARTBEAT_DIR/$LOCAL_RANK`` whenever it makes
progress: one line, ``STEP [RANK [GAP_MS]]``, the file's modification time being when. The
built-in trainer writes it at every optimizer step, evaluation batch and checkpoint, in place
(``pwrite`` of a fixed-width line: a few microseconds). A user program may opt in with one line
and no import of this bundle (docs/failures.md, "When a job hangs")::

    open(f"{os.environ['DDP_HEARTBEAT_DIR']}/{os.environ['LOCAL_RANK']}", "w").write(f"{step} {os.environ['RANK']}\\n")

``GAP_MS`` is the longest time between two of the rank's beats so far: what the default
``job.stall_timeout`` is derived from, so that a slow but healthy job is never called stalled.

Any other program beats with no change to it: the launcher installs a hook in each of its workers
(trainer/progress_hook/ddp_deploy_progress.py) that writes the same line, ``-`` for a step or a gap
it does not know, and a fourth word, the rank's :data:`PHASES`: ``start`` when the worker starts
(the watch's clock for the rank starts there), ``init`` in ``init_process_group``, ``run`` after
the group formed and after each collective and DDP step, ``done`` after
``destroy_process_group``, ``ended`` when the worker exited (``left``: before its group formed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback

HEARTBEAT_DIR_ENV = "DDP_HEARTBEAT_DIR"
ON_STALL_ENV = "DDP_ON_STALL"
"""``job.on_stall`` for the launcher's :class:`Watchdog`: ``report``, ``restart`` or ``stop``."""
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
zygote forked (trainer/zygote.py), whose /proc environment is the launcher's."""
LAUNCHER_FILE = "launcher"
"""In the heartbeat directory: ``PID START`` of the launcher that made it (:func:`prepare`), its pid in
its own pid namespace and its start (/proc/PID/stat's 22nd field, clock ticks after boot, which a pid
reused later never has): every worker of the job descends from that process, torchrun's agent."""
LINE_BYTES = 46
"""A beat's line: step (20 digits), rank (10), gap in ms (13), the spaces and the newline: fixed,
so that a write in place never leaves a longer line's end behind."""


class Heartbeat:
    """One rank's beats; a no-op where the directory is not set or cannot be written."""

    def __init__(self, directory: str | None, local_rank: int = 0, rank: int = 0, clock=time.monotonic) -> None:
        self.path = os.path.join(directory, str(local_rank)) if directory else None
        self.rank, self.clock = rank, clock
        self.gap = 0.0
        self.step = 0
        self._fd: int | None = None
        self._last: float | None = None

    @classmethod
    def from_environ(cls, environ=os.environ, rank: int | None = None) -> "Heartbeat":
        local = environ.get("LOCAL_RANK", "0")
        return cls(environ.get(HEARTBEAT_DIR_ENV) or None, int(local) if local.isdigit() else 0,
                   rank if rank is not None else int(environ.get("RANK", "0") or 0))

    def beat(self, step: int | None = None) -> None:
        """Progress now, at ``step`` (None: the step of the last beat, as in an evaluation)."""
        if step is not None:
            self.step = step
        if self.path is None:
            return
        now = self.clock()
        if self._last is not None:
            self.gap = max(self.gap, now - self._last)
        self._last = now
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                sys.stderr.write(f"trainer: warning: no heartbeat ({self.path}: {exc.strerror or exc}); "
                                 "`ddp-deploy status` cannot tell a stall from progress on this rank\n")
                self.path = None
                return
        line = f"{self.step:20d} {self.rank:10d} {min(int(self.gap * 1000), 10 ** 13 - 1):13d}\n".encode()
        try:
            os.pwrite(self._fd, line, 0)
        except OSError:
            pass  # never the job's end: status falls back to the node's output

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def finish(self) -> None:
        """This rank is done (trained, evaluated, saved; or stopped as planned, its checkpoint
        written): its beat goes, so that the seconds it still takes to end (the process group's
        teardown, the interpreter's exit, a peer's final save) are never judged a stall. Under load
        these took over a short job.stall_timeout, and the launcher's watchdog killed a job that had
        finished (on_stall restart ran its last step again)."""
        self.close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None


HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "progress_hook")
"""The ``sitecustomize`` and the hook it installs (trainer/progress_hook): first on the workers' path."""


def hooked_path(python_path: str | None) -> str:
    """``PYTHONPATH`` for the workers: :data:`HOOK_DIR` first, then what it was."""
    return os.pathsep.join([HOOK_DIR, *(p for p in (python_path or "").split(os.pathsep) if p and p != HOOK_DIR)])


def prepare(directory: str | None) -> str | None:
    """The launcher's part: ``directory`` made (or emptied: a run's beats are its own), private to
    this user, and this process named in it (:data:`LAUNCHER_FILE`); None (beats off, with a warning)
    where it is not ours to use: another user's, a link."""
    if not directory:
        return None
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        try:
            st = os.lstat(directory)
        except OSError as exc:
            return _off(directory, exc.strerror or str(exc))
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return _off(directory, "it exists and is not this user's directory")
        _empty(directory)
    except OSError as exc:
        return _off(directory, exc.strerror or str(exc))
    _name_launcher(directory)
    return directory


def _name_launcher(directory: str) -> None:
    """This process named in ``directory`` as the one the job's workers descend from: how `doctor`
    tells them from any other process that sets the same environment."""
    here = _stat(os.getpid())
    why = "this system has no /proc" if here is None else None
    if here is not None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            with os.fdopen(os.open(os.path.join(directory, LAUNCHER_FILE), flags, 0o644), "w") as fh:
                fh.write(f"{os.getpid()} {here[1]}\n")
        except OSError as exc:
            why = exc.strerror or str(exc)
    if why is not None:
        sys.stderr.write(f"trainer.launch: warning: the launcher is not named in {directory} ({why}): "
                         "`ddp-deploy doctor` finds no worker of this node\n")


def _empty(directory: str, workers_too: bool = True, keep: tuple[str, ...] = ()) -> None:
    """Every file in ``directory`` but those named in ``keep`` removed, as far as it can be; and,
    ``workers_too``, in its ``workers/`` (trainer/zygote.py: which worker the launcher's zygote forked
    for each local rank)."""
    for name in os.listdir(directory):
        if name in keep:
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except IsADirectoryError:
            if name == WORKERS_DIR and workers_too:
                _empty(os.path.join(directory, name), False)
        except OSError:
            pass


def remove(directory: str | None) -> None:
    if not directory:
        return
    try:
        _empty(directory)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(os.path.join(directory, WORKERS_DIR))
        os.rmdir(directory)
    except OSError:
        pass


def _off(directory: str, why: str) -> None:
    sys.stderr.write(f"trainer.launch: warning: heartbeats off ({directory}: {why}); `ddp-deploy status` reads "
                     "this node's output instead\n")
    return None


# --- when a node is stalled ----------------------------------------------------------------------

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


# --- what `doctor` reads -------------------------------------------------------------------------

# A node program (doctor runs it through the job's runtime, the Watchdog here on a stall):
# $1 = the job's heartbeat dir, $2 = py-spy (a path, else the name on PATH). Every worker of the job
# on this node, found by what the kernel says of it, as _marked does: it runs with the job's uid
# alone (real, effective, saved and filesystem: this script's, or as root, `docker exec -u 0` in the
# job's container, that of this pid namespace's first process, the container's launcher; a node's is
# init, root), and it descends from the launcher named in $1/launcher ("PID START", while it is that
# process) or from what runs this script (the launcher's own watchdog). Among those: its environment
# holds DDP_HEARTBEAT_DIR=$1 and LOCAL_RANK (torchrun's workers; the launcher and torchrun have
# none); or, forked by the launcher's zygote (trainer/zygote.py), whose environment is the
# launcher's, it is named in $1/workers/LOCAL_RANK and its environment holds DDP_HEARTBEAT_DIR=$1.
# Any process may set that environment: it narrows the search, it proves nothing.
# Per worker: "rank PID RANK LOCAL_RANK STATE" (STATE: /proc's letter, T when stopped; read again
# for up to 3 s while another tracer holds the worker, t), then, unless it is stopped (py-spy
# would wait on it), "stack PID JSON", py-spy's dump of its threads on one line (or its error;
# asked again for up to 3 s while another tracer holds the worker). Then "workers N". Last, where
# the workers keep torch's flight recorder (trainer/flight.py: a file fr-LOCAL_RANK in $1 says so), "fr PID SEQ OP" for each one that answered
# this request, or one made since, within 2 s: the newest collective it is in or did. The job's own values are printed
# only as digits, lowercase names or py-spy's JSON.
DIAGNOSE = r"""marker="DDP_HEARTBEAT_DIR=$1"; spy=$2; found=0; ask=""; fr=""; since=0
[ -x "$spy" ] || spy=py-spy
fresh() {  # TOKEN: a request made when this one was or later (its first word, digits of the same length)
  t=${1%%-*}
  case $t in ''|*[!0-9]*) return 1 ;; esac
  [ ${#t} -eq ${#since} ] && [ "$t" -ge "$since" ] 2>/dev/null
}
if [ -d "$1" ] && [ ! -L "$1" ] && ls "$1"/fr-[0-9]* > /dev/null 2>&1; then
  # the directory is the job's: a new file (noclobber: O_EXCL), never through a link it put there
  # A diagnosis beside this one (status's, the launcher's watch, doctor) may ask at the same moment:
  # the workers answer the newest request only, and any answer to a request made since this one
  # asked serves both. A token is "NANOSECONDS-PID".
  since=$(date +%s%N); ask="$since-$$"; rm -f "$1/fr-request"
  # another asker's request made between the two stands: an answer to a request of the second
  # before serves (a stall is far longer)
  (set -C; echo "$ask" > "$1/fr-request") 2>/dev/null || since=$((since - 1000000000))
fi
seen=" "
worker() {  # PID RANK LOCAL_RANK
  tries=0
  while :; do
    state=$(sed -n 's/^State:[[:space:]]*\([A-Za-z]\).*/\1/p' "/proc/$1/status" 2>/dev/null)
    # t: another tracer holds it for a moment (a diagnosis beside this one): its own state after
    if [ "$state" != t ] || [ $tries -ge 30 ]; then break; fi
    tries=$((tries + 1)); sleep 0.1
  done
  found=$((found + 1)); seen="$seen$1 "
  echo "rank $1 ${2:-?} $3 ${state:-?}"
  [ -f "$dir/fr-$3" ] && fr="$fr $1:$3"
  [ "$state" = T ] && return
  tries=0
  while :; do
    dump=$(timeout 20 "$spy" dump --pid "$1" --json 2>&1 | tr '\n' ' ')
    # another tracer holds it for a moment (a diagnosis beside this one: the launcher's on a stall,
    # an operator's doctor or status): it may be suspended by one at a time
    case $dump in *"Failed to suspend process"*) ;; *) break ;; esac
    tries=$((tries + 1)); [ $tries -lt 15 ] || break; sleep 0.2
  done
  echo "stack $1 $dump"
}
dir=$1
uid_of() {  # PID: its uid, where its real, effective, saved and filesystem uids are one
  awk '/^Uid:/ { if ($2 == $3 && $2 == $4 && $2 == $5) print $2; exit }' "/proc/$1/status" 2>/dev/null
}
uid=$(id -u); [ "$uid" = 0 ] && uid=$(uid_of 1)
roots=" "; [ "$PPID" -gt 0 ] && roots=" $PPID "
if [ -f "$1/launcher" ] && [ ! -L "$1/launcher" ] && read -r lpid lstart _ 2>/dev/null < "$1/launcher"; then
  case "$lpid.$lstart" in
    *[!0-9.]*|.*|*.) ;;
    *) if [ "$(awk '{ sub(/.*\) /, ""); print $20 }' "/proc/$lpid/stat" 2>/dev/null)" = "$lstart" ] &&
          [ "$(uid_of "$lpid")" = "$uid" ]; then roots="$roots$lpid "; fi ;;
  esac
fi
ours() {  # PID: it runs with the job's uid, and one of $roots is in its chain of parents (/proc/PID/stat)
  [ -n "$uid" ] && [ "$(uid_of "$1")" = "$uid" ] || return 1
  awk -v p="$1" -v roots="$roots" 'BEGIN {
    for (n = 0; n < 4096 && p > 0; n++) {
      f = "/proc/" p "/stat"; if ((getline s < f) <= 0) exit 1; close(f)
      sub(/.*\) /, "", s); split(s, w, " "); p = w[2]
      if (index(roots, " " p " ")) exit 0
    }
    exit 1 }'
}
above() {  # PID: the processes between it and the first of $roots, each followed by a space
  awk -v p="$1" -v roots="$roots" 'BEGIN {
    f = "/proc/" p "/stat"; if ((getline s < f) <= 0) exit; close(f); sub(/.*\) /, "", s); split(s, w, " "); p = w[2]
    for (n = 0; n < 4096 && p > 0 && !index(roots, " " p " "); n++) {
      printf "%s ", p
      f = "/proc/" p "/stat"; if ((getline s < f) <= 0) exit; close(f); sub(/.*\) /, "", s); split(s, w, " "); p = w[2]
    }
  }'
}
# workers named in workers/LOCAL_RANK as "PID RANK": those the launcher's zygote forked (their /proc
# environment is the launcher's: marker, no ranks), and a process a worker started that formed a
# group of its own (train.spawn; trainer/progress_hook), whose environment holds its parent's ranks
parents=" "
if [ -d "$1/workers" ] && [ ! -L "$1/workers" ]; then
  for w in "$1"/workers/[0-9]*; do
    lrank=${w##*/}
    case $lrank in *[!0-9]*) continue ;; esac
    if [ ! -f "$w" ] || [ -L "$w" ]; then continue; fi
    read -r pid rank _ < "$w" 2>/dev/null || continue
    case $pid in ''|*[!0-9]*) continue ;; esac
    case $rank in ''|*[!0-9]*) rank="" ;; esac
    case $seen in *" $pid "*) continue ;; esac
    grep -qzxF -e "$marker" "/proc/$pid/environ" 2>/dev/null || continue
    ours "$pid" || continue
    parents="$parents$(above "$pid")"
    worker "$pid" "$rank" "$lrank"
  done
fi
# torchrun's workers: their environment holds the ranks. Not one: a worker that only started ranks
# of their own (an ancestor of one named above), or a process below a rank or such a worker (a data
# loader's worker, multiprocessing's resource tracker), which holds the environment it was started with
for p in /proc/[0-9]*; do
  pid=${p#/proc/}
  case "$seen$parents" in *" $pid "*) continue ;; esac
  grep -qzxF -e "$marker" "$p/environ" 2>/dev/null || continue
  rank=$(tr '\0' '\n' < "$p/environ" 2>/dev/null | sed -n 's/^RANK=\([0-9]\{1,9\}\)$/\1/p' | head -n 1)
  lrank=$(tr '\0' '\n' < "$p/environ" 2>/dev/null | sed -n 's/^LOCAL_RANK=\([0-9]\{1,9\}\)$/\1/p' | head -n 1)
  [ -n "$lrank" ] || continue
  ours "$pid" || continue
  below=0; for a in $(above "$pid"); do case "$seen$parents" in *" $a "*) below=1; break ;; esac; done
  [ $below = 0 ] || continue
  worker "$pid" "$rank" "$lrank"
done
echo "workers $found"
[ -n "$ask" ] && [ -n "$fr" ] || exit 0
i=0
while [ $i -lt 20 ]; do
  all=1; for pl in $fr; do fresh "$(head -c 64 "$1/fr-${pl#*:}" 2>/dev/null | cut -d ' ' -f 1)" || all=0; done
  [ $all = 1 ] && break; sleep 0.1; i=$((i+1))
done
for pl in $fr; do
  read -r tok seq op <<ANSWER
$(head -c 80 "$1/fr-${pl#*:}" 2>/dev/null | head -n 1 | tr -cd 'a-z0-9_ .-')
ANSWER
  fresh "$tok" && [ -n "$seq" ] && [ "$seq" != none ] && echo "fr ${pl%%:*} $seq ${op:-?}"
done
exit 0
"""


# --- the node's own watch (job.on_stall: restart) ---------------------------------------------------

def read_beats(directory: str, now: float | None = None) -> list[Beat]:
    """The beats in ``directory`` as :func:`parse_beat` reads them (ages by this machine's clock)."""
    now = time.time() if now is None else now
    found = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            with open(path, "rb") as fh:
                first = fh.read(64).split(b"\n")[0].decode("ascii", "replace")
        except OSError:
            continue
        beat = parse_beat(name, str(max(0, int(now - st.st_mtime))), first)
        if beat is not None:
            found.append(beat)
    return found


def group_formed(directory: str) -> bool:
    """A rank of this node formed the process group or made a step: a heartbeat file in
    ``directory`` past its hook's start (:data:`PHASES`), or one the program wrote itself."""
    return any(b[5] not in ("start", "init", "left") for b in read_beats(directory))


def workers(directory: str) -> list[int]:
    """The pids of this node's workers of the job, by identity (:func:`_marked`): those whose
    environment holds a ``LOCAL_RANK`` (torchrun's workers and what they started; not the launcher),
    or the launcher's zygote named them (:func:`ranked`)."""
    marked = _marked(directory)
    found = [m.pid for m in marked if m.local is not None]
    return found + [pid for _, pid in _named(directory, marked) if pid not in found]


def ranked(directory: str) -> dict[int, int]:
    """This node's workers of the job by local rank: the process torchrun's agent (or the launcher's
    zygote) started for each, not the processes it started itself; pids as this machine's /proc
    numbers them (a container's zygote names its own, which :func:`_named` maps)."""
    marked = _marked(directory)
    ranked_pids = {m.pid for m in marked if m.local is not None}
    found = {m.local: m.pid for m in marked if m.local is not None and m.parent not in ranked_pids}
    found.update(_named(directory, marked))
    return found


class _Marked:
    __slots__ = ("pid", "local", "parent", "inner", "uid", "start")

    def __init__(self, pid: int, local: int | None, parent: int, inner: int, uid: int | None, start: int) -> None:
        self.pid, self.local, self.parent, self.inner, self.uid, self.start = pid, local, parent, inner, uid, start


def _marked(directory: str) -> list[_Marked]:
    """This node's processes of the job, by what the kernel says of them: each runs with the job's uid
    alone (:func:`_job_uid`) and descends from the launcher named in ``directory`` (:data:`LAUNCHER_FILE`)
    or from this process (the launcher's own watchdog), and its /proc environment holds
    ``DDP_HEARTBEAT_DIR=directory``. Any process may set that environment: it only narrows the search.
    For each: its LOCAL_RANK (None without one), its parent, and its pid in its own pid namespace."""
    every = _with_marker(directory)
    launcher = _launcher(directory, every)
    uid = _job_uid(launcher)
    if uid is None:
        return []
    roots = {os.getpid()} | ({launcher.pid} if launcher is not None and launcher.uid == uid else set())
    parents = {m.pid: m.parent for m in every}
    return [m for m in every if m.uid == uid and _descends(m.pid, roots, parents)]


def _with_marker(directory: str) -> list[_Marked]:
    """Every process but this one whose /proc environment holds ``DDP_HEARTBEAT_DIR=directory``."""
    marker = f"{HEARTBEAT_DIR_ENV}={directory}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            if marker not in env:
                continue
            rank = next((v[11:] for v in env if v.startswith(b"LOCAL_RANK=")), b"")
            with open(f"/proc/{entry}/status", "rb") as fh:
                status = dict(line.split(b":", 1) for line in fh.read().splitlines() if b":" in line)
            inner = status.get(b"NSpid", b"").split() or [entry.encode()]
            here = _stat(int(entry))
            if here is None:
                continue
            found.append(_Marked(int(entry), int(rank) if rank.isdigit() else None, here[0], int(inner[-1]),
                                 _one_uid(status.get(b"Uid", b"")), here[1]))
        except (OSError, ValueError):
            continue
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent, start) of process ``pid`` from /proc/PID/stat: its parent's pid and its start in clock
    ticks after boot; None once it has ended. Read after the command name, which may hold anything."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _one_uid(field: bytes) -> int | None:
    """The uid of a /proc/PID/status ``Uid:`` line (real, effective, saved, filesystem) where all four
    are one; None where they differ (a setuid program), which is no job's process."""
    uids = field.split()
    return int(uids[0]) if len(uids) == 4 and len(set(uids)) == 1 and uids[0].isdigit() else None


def _uid_of(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            line = next((line for line in fh if line.startswith(b"Uid:")), b"")
    except OSError:
        return None
    return _one_uid(line[4:])


def _launcher(directory: str, marked: list[_Marked]) -> _Marked | None:
    """The launcher named in ``directory`` (:data:`LAUNCHER_FILE`), while it runs: among ``marked``,
    the one process whose pid in its own namespace and start are those written there."""
    path = os.path.join(directory, LAUNCHER_FILE)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with open(path, "rb") as fh:
            words = fh.read(64).split()
    except OSError:
        return None
    if len(words) < 2 or not words[0].isdigit() or not words[1].isdigit():
        return None
    same = [m for m in marked if m.inner == int(words[0]) and m.start == int(words[1])]
    return same[0] if len(same) == 1 else None


def _job_uid(launcher: _Marked | None) -> int | None:
    """The uid the job's processes run with: this process's (doctor runs as the job's user, the
    watchdog in its launcher). As root: that of the first process of the launcher's pid namespace,
    where that namespace is this one or a container's made in this user namespace (only a privileged
    runtime makes one: a user without privileges makes a pid namespace only inside a user namespace
    of their own). A container's first process is its launcher (``docker exec -u 0`` runs doctor in
    it); this namespace's, on a node, is init: root."""
    me = os.getuid()
    if me != 0:
        return me
    first: int | None = 1
    if launcher is not None and _namespace(launcher.pid, "pid") != _namespace("self", "pid") \
            and _namespace(launcher.pid, "user") == _namespace("self", "user"):
        first = _first_in(_namespace(launcher.pid, "pid"))
    return None if first is None else _uid_of(first)


def _namespace(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _first_in(namespace: str | None) -> int | None:
    """The pid (as this machine's /proc numbers it) of the process that is 1 in pid namespace ``namespace``."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and namespace is not None and _namespace(entry, "pid") == namespace:
            try:
                with open(f"/proc/{entry}/status", "rb") as fh:
                    inner = next((line[6:].split() for line in fh if line.startswith(b"NSpid:")), [])
            except OSError:
                continue
            if inner and inner[-1] == b"1":
                return int(entry)
    return None


def _descends(pid: int, roots: set[int], parents: dict[int, int]) -> bool:
    """Whether one of ``roots`` is an ancestor of ``pid`` (its chain of parents, from ``parents`` or
    /proc). A process whose parent ended has been given to another (init, or a child subreaper):
    it descends from that one since."""
    seen = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        parent = parents.get(pid)
        if parent is None:
            here = _stat(pid)
            parent = here[0] if here is not None else 0
        if parent in roots:
            return True
        pid = parent
    return False


def _named(directory: str, marked: list[_Marked]) -> list[tuple[int, int]]:
    """(local rank, pid) of each worker the launcher's zygote named in ``workers/`` (trainer/zygote.py):
    one of the job's marked processes (a forked worker's /proc environment is the launcher's), found
    by its pid in its own namespace, which is the one the zygote wrote (a container's, seen from its node)."""
    try:
        names = os.listdir(os.path.join(directory, WORKERS_DIR))
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(directory, WORKERS_DIR, name), "rb") as fh:
                words = fh.read(64).split()
        except OSError:
            continue
        if not words or not words[0].isdigit():
            continue
        said = int(words[0])
        same = [m.pid for m in marked if m.pid == said] or [m.pid for m in marked if m.inner == said]
        if len(same) == 1:
            found.append((int(name), same[0]))
    return found


def main_thread_at(depth: int = 5) -> str:
    """Where this process's main thread is, its innermost ``depth`` frames innermost first: in the
    launcher, torchrun's agent."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    frames = traceback.extract_stack(frame)[-depth:]
    return " < ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in reversed(frames))


class Watchdog:
    """A node's own watch of its ranks, in its launcher: when none of them has beaten for the stall
    timeout, it keeps the stall with the run and acts on ``job.on_stall``.

    Kept (``record``: the node's directory of the run on the shared volume, runs.py): a line in
    ``stalls``, ``TIME STEP QUIET_S LIMIT_S ACTION`` (deploy/job/runs.py reads it), and in
    ``stall-TIME`` what :data:`DIAGNOSE` found: each worker's state and Python stacks, the
    diagnosis ``status --run`` gives later, when the hung processes may be long gone.

    ``report``: that, and a line in the log, once per stall. ``restart``: then it kills its workers
    (a hung rank cannot checkpoint) and empties the heartbeats; torchrun's agent starts them again,
    counted against ``--max-restarts``, in a new rendezvous round the other nodes' agents join, and
    the job resumes from its newest checkpoint. ``stop``: it kills its workers and ends the launcher
    with 0, so that nothing starts them again (a hang stalls every node: each one's launcher ends its
    part). A rank's clock starts when its worker starts (its hook's ``start``, :func:`verdict`); with
    ``auto``, a start-up is not judged until a rank shows an interval, unless a rank ended while the
    others wait on it. Before any worker's first line, and after a restart until the next one, there
    is nothing to judge: nothing is done."""

    def __init__(self, directory: str, setting, action: str = "report", record: str | None = None,
                 every: float = 1.0, out=sys.stderr, spy: str | None = None, end=None,
                 settle: float = SETTLE_S) -> None:
        self.directory, self.setting, self.action, self.record = directory, setting, action, record
        self.every, self.out, self.settle = every, out, settle
        self.end = end or self._end_here
        self.spy = spy or os.path.join(os.path.dirname(sys.executable), "py-spy")  # installed beside it
        self.actions = 0
        self.stopping = False
        """Set once it has decided to stop (job.on_stall: stop), before it kills: from then on the
        launcher ends with 0 however torchrun ends (another node's stop may fail these workers first)."""
        self._reported = False

    @classmethod
    def from_environ(cls, directory: str | None, environ=os.environ) -> "Watchdog | None":
        """None where nothing is watched: no heartbeats, no ``job.on_stall`` set by the deploy
        tool, or ``job.stall_timeout`` null."""
        action = environ.get(ON_STALL_ENV)
        if not directory or action not in ("report", "restart", "stop"):
            return None
        raw = environ.get(STALL_TIMEOUT_ENV, "auto")
        if raw == "None":
            return None
        try:
            setting = "auto" if raw == "auto" else float(raw)
        except ValueError:
            setting = "auto"
        return cls(directory, setting, action, environ.get(STALL_RECORD_ENV) or None)

    def check(self, now: float | None = None) -> bool:
        """One look; True when it found a new stall (and acted on it)."""
        beats = read_beats(self.directory, now)
        seen = verdict(self.setting, beats)
        if seen is None:
            return False
        age, limit, left = seen
        if age <= limit:
            self._reported = False  # moving again: the next stall is a new one
            return False
        if self._reported:
            return False
        step = max((b[1] for b in beats if b[1] is not None), default=None)
        kept = self.keep(int(time.time() if now is None else now), step, age, limit)
        what = f"no rank on this node moved for {age:.0f} s (last step {'?' if step is None else step}; " \
               f"job.stall_timeout {limit:g} s)" if left is None else \
               f"{left} ended {age:.0f} s ago while the others on this node never formed the process group or " \
               "wait in their first collective"
        if not workers(self.directory):  # they ended, and nothing started them again: the agent hangs
            what += f"; no worker of it runs, and torchrun's agent is in {main_thread_at()}"
        if self.action == "report":
            self.out.write(f"trainer.launch: stalled: {what}: {kept} (job.on_stall: report)\n")
            self.out.flush()
            self._reported = True
            self.actions += 1
            return True
        self.stopping = self.action == "stop"
        time.sleep(self.settle)  # the other nodes' launchers read their stacks before these workers' end shakes them
        pids = workers(self.directory)
        then = ("which torchrun starts again from the newest checkpoint (job.on_stall: restart)"
                if self.action == "restart" else "and ending this node's part of the job, which nothing starts "
                "again (job.on_stall: stop): launch again to resume from the newest checkpoint")
        self.out.write(f"trainer.launch: stalled: {what}: {kept}; killing its {len(pids)} workers, {then}\n")
        self.out.flush()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _empty(self.directory, keep=(LAUNCHER_FILE,))  # the next beats are the new workers'
        self.actions += 1
        if self.action == "stop":
            self.end()
        return True

    def _end_here(self) -> None:
        """``stop``: this launcher ends at once, with 0, so that neither torchrun's agent nor Docker's
        restart policy nor the host supervisor starts the job again; the kept stall says why
        (``status`` shows the node stopped, stalled)."""
        remove(self.directory)
        os._exit(0)

    def keep(self, when: int, step: int | None, age: float, limit: float) -> str:
        """The stall and its diagnosis kept with the run; what the log says of it."""
        if not self.record:
            return "not kept (no run directory)"
        try:
            found = subprocess.run(["sh", "-c", DIAGNOSE, "sh", self.directory, self.spy], stdin=subprocess.DEVNULL,
                                   capture_output=True, timeout=DIAGNOSE_S).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            found = f"problem {exc}\n".encode()
        try:
            with open(os.path.join(self.record, f"stall-{when}"), "wb") as fh:
                fh.write(found[:DIAGNOSIS_BYTES])
            with open(os.path.join(self.record, "stalls"), "a") as fh:
                fh.write(f"{when} {'-' if step is None else step} {int(age)} {int(limit)} {self.action}\n")
        except OSError as exc:
            return f"not kept ({exc.strerror or exc})"
        return "the stacks of its workers are kept with the run (ddp-deploy status --run)"

    def start(self) -> threading.Thread:
        def run():
            while True:
                time.sleep(self.every)
                try:
                    self.check()
                except OSError:
                    pass
        thread = threading.Thread(target=run, name="stall-watchdog", daemon=True)
        thread.start()
        return thread
