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

    open(f"{os.environ['DDP_HEARTBEAT_DIR']}/{os.environ['LOCAL_RANK']}", "w").write(f"{step} {os.environ['RANK']}\n")

``GAP_MS`` is the longest time between two of the rank's beats so far: what the default
``job.stall_timeout`` is derived from, so that a slow but healthy job is never called stalled.

Any other program beats with no change to it: the launcher installs a hook in each of its workers
(agent/progress_hook/ddp_deploy_progress.py) that writes the same line, ``-`` for a step or a gap
it does not know, and a fourth word, the rank's :data:`PHASES`: ``start`` when the worker starts
(the watch's clock for the rank starts there), ``init`` in ``init_process_group``, ``run`` after
the group formed and after each collective and DDP step, ``done`` after
``destroy_process_group``, ``ended`` when the worker exited (``left``: before its group formed).

Its parts: ``writer`` (a rank's file), ``directory`` (the directory's life), ``procs`` (the job's
workers found by kernel facts), ``watchdog`` (the launcher's watch) and ``diagnose.sh`` (the node
program ``doctor`` runs). The variables, the file names, a beat's format and when a node is stalled
are the contract's (agent/contract.py): the deploy tool judges alike.
"""

from __future__ import annotations

from .writer import Heartbeat
from .directory import HOOK_DIR, empty, hooked_path, prepare, remove
from .procs import group_formed, proc_stat, ranked, read_beats, workers
from .watchdog import Watchdog, main_thread_at, stall_setting

__all__ = [
    "HOOK_DIR", "Heartbeat", "Watchdog", "empty", "group_formed", "hooked_path", "main_thread_at", "prepare",
    "proc_stat", "ranked", "read_beats", "remove", "stall_setting", "workers",
]
