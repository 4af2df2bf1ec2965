"""The SSH fleet's verbs as a Python API: the procedures the CLI is built on.

Each one takes the inventory, an open :class:`~deploy.nodes.remote.Remote` and a ``redact`` for the
job's secrets, returns data or raises a :class:`~deploy.errors.DeployError` naming the cause,
and reports progress through callbacks (``say``: a line of progress, ``warn``: a warning), so that
a notebook or a CI pipeline can launch, follow and stop a job without a shell::

    from deploy.engines.fleet import Fleet

    fleet = Fleet("hosts.yaml", say=print)
    run = fleet.launch()                 # the run; run.started: its nodes and where the launch's time went
    final = fleet.wait(timeout=3600)     # every node's state once the job has ended
    print(fleet.verdict(final))          # or a RuntimeFailure naming the first failure (JobStopped: stopped)
    fleet.stop()

The click commands (deploy/cli/) only parse, call these and render (deploy/cli/render.py).

Its parts: ``common`` (what the verbs share), ``watch`` (a running job followed, and its end told
truly), ``kept`` (the runs on the shared volume), ``actions`` (launch, stop, deploy, join, unlock),
``heal`` (the watcher that heals a job without its operator),
``logs``, ``alljobs`` (every user's jobs on the nodes) and ``api`` (the :class:`Fleet` object).
"""

from __future__ import annotations

from .common import (
    FAILURE_TAIL, Say, check, node_index, on_any_node, one_image, quiet, readers, refuse_failed_checks,
    running_job, start_run, sync_code, undo_start, without_interface,
)
from .watch import (
    NOTHING_TRAINED_HINT, UNREACHABLE_POLLS, diagnose, end_watch, first_failure, node_states, nothing_trained,
    read_watch, stalled_and_stopped, watcher_of, stopped_by_operator, verdict, wait, watched_inventory, witnesses,
)
from .kept import goodputs, kept_failure, kept_run, kept_runs, kept_stalls, metrics, newest_stall, plot, when
from .actions import Joined, Shipping, Started, Unlocked, deploy, join, joinable, launch, no_progress, stop, unlock
from .logs import LogLine, log_reads, read_logs
from .alljobs import FleetJob, FleetJobs, jobs
from .heal import NotWanted, Watch, current_run, detached, log_path, watcher_argv
from .heal import start as start_watcher
from .api import Fleet

__all__ = [
    "NotWanted", "Watch", "current_run", "start_watcher", "detached", "end_watch", "log_path", "read_watch", "watched_inventory", "watcher_of",
    "watcher_argv",
    "FAILURE_TAIL", "Fleet", "FleetJob", "FleetJobs", "Joined", "LogLine", "NOTHING_TRAINED_HINT", "Say",
    "Shipping", "Started",    "UNREACHABLE_POLLS", "Unlocked", "check", "deploy", "diagnose", "first_failure", "goodputs", "jobs", "join",
    "joinable", "kept_failure", "kept_run", "kept_runs", "kept_stalls", "launch", "log_reads", "metrics",
    "newest_stall", "no_progress", "node_index", "node_states", "nothing_trained", "on_any_node", "one_image",
    "plot", "quiet", "read_logs", "readers", "refuse_failed_checks", "running_job",
    "stalled_and_stopped", "start_run", "stop", "stopped_by_operator", "sync_code", "undo_start", "unlock",
    "verdict", "wait", "when", "without_interface", "witnesses",
]
