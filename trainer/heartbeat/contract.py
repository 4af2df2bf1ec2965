"""The names a node's launcher, its ranks and the deploy tool share: the variables that set a
job's watch and the files of a heartbeat directory."""

from __future__ import annotations


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
STATES = ("starting", "running", "stalled", "ending")
"""A node's part of a job as its launcher tells ``ddp-deploy jobs`` (trainer.heartbeat.judge.state)."""
