"""A real Slurm cluster on a running NetCluster, for the cluster tests of ddp-deploy on Slurm.

On this machine: ``munged`` (its own key and socket) and one ``slurmctld`` that clients reach at the
bridge address; in each node's namespace one ``slurmd -N <host name>``: the Slurm node names are the
cluster's host names (node1, node2, ...) and their NodeAddr the hosts' addresses. One partition
holds every node. Any SSH session on a node finds the config through ``SLURM_CONF`` (netcluster.py
hands it out), so node1 can be the login node: ``ssh root@node1 sbatch ...``; batch jobs inherit
sbatch's environment, SLURM_CONF included, so ``scontrol``/``srun`` work inside them too.

Files: config, munge key and socket, pid files and the controller's state under SLURM_ROOT
(/run/ddpcluster/slurm); the slurmds' spool directories, where batch scripts are executed from,
under /var/lib/ddpcluster/slurm (/run may be mounted noexec); logs in the cluster's
``state_dir/logs``. No accounting database: ``sacct`` answers that accounting is disabled, and
finished jobs stay known to ``scontrol show job`` for MinJobAge (an hour).

Needs Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (Slurm 22.05 on bookworm).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from .netcluster import (DAEMON_MARK, DATA_ROOT, OPERATOR_ADDRESS, SLURM_CONF, SLURM_ROOT,
                         NetCluster, _kill_and_wait, _log, _marked_processes, _ns_path, _reap,
                         _Timings, _which)

SLURM_SPOOL = DATA_ROOT / "slurm"       # SlurmdSpoolDir per node: batch scripts run from here
MUNGE_DIR = SLURM_ROOT / "munge"
MUNGE_SOCKET = MUNGE_DIR / "munge.socket"
CONTROLLER_STATE = SLURM_ROOT / "ctld"  # StateSaveLocation
# Not Slurm's default ports, so that a system slurmctld on this machine cannot be the one answering.
CONTROLLER_PORT = 6917
NODE_PORT = 6918
PARTITION = "debug"
KILL_WAIT_S = 30  # SIGTERM, then this long before SIGKILL: a planned stop's checkpoint fits in it
DAEMON_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

REQUIRED_TOOLS = ("munged", "munge", "slurmctld", "slurmd", "sinfo", "squeue", "sbatch", "srun",
                  "scontrol", "scancel")


class SlurmError(RuntimeError):
    """The Slurm cluster could not be started or did not reach the state asked for."""


class SlurmCommandError(subprocess.CalledProcessError):
    """A Slurm client command failed; unlike CalledProcessError's, the message has its stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}: {(self.stderr or self.stdout or '').strip()[-2000:]}"


def missing_prerequisites() -> list[str]:
    """What stops a Slurm cluster from starting here: empty when everything is in place."""
    missing = [t for t in REQUIRED_TOOLS if _which(t) is None]
    if not missing:
        return []
    return [f"{', '.join(missing)} not found "
            "(apt-get install -y slurmctld slurmd slurm-client munge)"]


def node_hardware() -> dict[str, str]:
    """This machine's CPU layout as slurmd sees it (``slurmd -C``): every node shares it, and a
    node declared with more than it has registers as invalid (sinfo: inval), never idle."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    if not all(k in fields for k in keys):
        raise SlurmError(f"slurmd -C printed no CPU layout: {out.strip()!r}")
    return {k: fields[k] for k in keys}


def slurm_conf(hosts: Sequence[Any], *, controller: str, logs: Path,
               hardware: dict[str, str], partition: str = PARTITION) -> str:
    """slurm.conf for one controller on this machine and a slurmd per host, all of them root."""
    layout = " ".join(f"{k}={v}" for k, v in hardware.items())
    lines = [
        "ClusterName=ddpcluster",
        # slurmctld refuses to start unless the name is this machine's short hostname
        f"SlurmctldHost={controller}({OPERATOR_ADDRESS})",
        f"SlurmctldPort={CONTROLLER_PORT}",
        f"SlurmdPort={NODE_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also holds a requeued job back (120 s by default) before it may start again
        f"AuthInfo=socket={MUNGE_SOCKET},cred_expire=10",
        f"StateSaveLocation={CONTROLLER_STATE}",
        f"SlurmctldPidFile={SLURM_ROOT / 'slurmctld.pid'}",
        f"SlurmctldLogFile={logs / 'slurmctld.log'}",
        # every slurmd shares this file system: %n (the node name) keeps their files apart
        f"SlurmdSpoolDir={SLURM_SPOOL / '%n'}",
        f"SlurmdPidFile={SLURM_ROOT / 'slurmd-%n.pid'}",
        f"SlurmdLogFile={logs / 'slurmd-%n.log'}",
        # no cgroups in the namespaces: track a job's processes by parentage, bind nothing
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "MailProg=/bin/true",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "JobRequeue=1",
        "MinJobAge=3600",      # scontrol show job still knows a finished job for the whole test
        "ReturnToService=2",   # a node that was down comes back as soon as its slurmd registers
        f"KillWait={KILL_WAIT_S}",
        "SchedulerType=sched/backfill",
        # pending jobs are looked at every 2 s (60 s by default): a requeued one restarts promptly
        "SchedulerParameters=sched_interval=2,bf_interval=2",
        # cores, not whole nodes: a one-task-per-node job leaves the rest of a node to others
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    lines += [f"NodeName={h.name} NodeAddr={h.address} {layout} State=UNKNOWN" for h in hosts]
    lines.append(f"PartitionName={partition} Nodes={','.join(h.name for h in hosts)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """Slurm on the hosts of ``cluster``; ``start()`` brings it up with every node idle, ``stop()``
    ends every daemon (and job) it started and removes its files; both are safe to repeat."""

    def __init__(self, cluster: NetCluster, *, login: str | None = None,
                 partition: str = PARTITION) -> None:
        self.cluster = cluster
        self.nodes = [h.name for h in cluster.hosts]   # Slurm's node names: the host names
        self.partition = partition
        self.conf = str(SLURM_CONF)
        self.login = login or self.nodes[0]            # where the tests submit from, over SSH
        self.controller_address = OPERATOR_ADDRESS
        self.timings = _Timings()
        self._daemons: dict[str, subprocess.Popen] = {}

    @property
    def logs_dir(self) -> Path:
        return Path(self.cluster.state_dir) / "logs"

    def env(self) -> dict[str, str]:
        """The environment for a Slurm client here: this config, no SLURM_* of an outer job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": self.conf}

    # ---- lifecycle

    def start(self, timeout: float = 60) -> "SlurmCluster":
        start = time.monotonic()
        try:
            with self.timings.step("slurm: clean leftovers"):
                stop_daemons()
            with self.timings.step("slurm: munged"):
                self._start_munged()
            with self.timings.step("slurm: config"):
                self._write_config()
            with self.timings.step("slurm: slurmctld + slurmds to idle"):
                self._start("slurmctld", ["slurmctld", "-D", "-c", "-f", self.conf])
                for h in self.cluster.hosts:
                    self._start(f"slurmd-{h.name}",
                                ["nsenter", f"--net={_ns_path(h.ns)}",
                                 "slurmd", "-D", "-N", h.name, "-f", self.conf])
                self.wait_idle(timeout)
            _log(f"slurm: {len(self.nodes)} nodes idle in {time.monotonic() - start:.1f} s "
                 f"(SLURM_CONF={self.conf})")
            return self
        except BaseException:
            _log("slurm: start failed: stopping what was started")
            self.stop()
            raise

    def stop(self) -> None:
        """Kill every daemon this started, with their jobs, and remove Slurm's files (not logs)."""
        stop_daemons(list(self._daemons.values()))
        self._daemons.clear()

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _start_munged(self) -> None:
        MUNGE_DIR.mkdir(parents=True, exist_ok=True)
        os.chmod(MUNGE_DIR, 0o755)  # munged insists that everybody may reach its socket
        key = MUNGE_DIR / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        # -F logs to stderr, which goes to the log file
        self._start("munged", ["munged", "-F", f"--socket={MUNGE_SOCKET}", f"--key-file={key}",
                               f"--pid-file={MUNGE_DIR / 'munged.pid'}",
                               f"--seed-file={MUNGE_DIR / 'munged.seed'}"])
        deadline = time.monotonic() + 10
        while subprocess.run(["munge", "-n", "-S", str(MUNGE_SOCKET)],
                             capture_output=True).returncode != 0:
            self._check_alive("munged")
            if time.monotonic() > deadline:
                raise SlurmError("munged did not answer within 10 s; last lines of its log:\n"
                                 + self._tail("munged"))
            time.sleep(0.05)

    def _write_config(self) -> None:
        CONTROLLER_STATE.mkdir(parents=True, exist_ok=True)
        for name in self.nodes:
            (SLURM_SPOOL / name).mkdir(parents=True, exist_ok=True)
        SLURM_CONF.write_text(slurm_conf(self.cluster.hosts,
                                         controller=socket.gethostname().split(".")[0],
                                         logs=self.logs_dir, hardware=node_hardware(),
                                         partition=self.partition))

    def _start(self, name: str, argv: list[str]) -> None:
        # munged -F logs to stderr. A Slurm daemon run with -D copies what it logs to stderr,
        # which also has what comes before its log file is open (a bad config, say).
        slurm = name != "munged"
        err = open(self.logs_dir / f"{name}.{'stderr' if slurm else 'log'}", "ab")
        try:
            self._daemons[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": DAEMON_PATH, "SLURM_CONF": self.conf, DAEMON_MARK: str(SLURM_ROOT)})
        finally:
            err.close()

    def _check_alive(self, name: str) -> None:
        proc = self._daemons[name]
        if proc.poll() is not None:
            raise SlurmError(f"{name} exited with {proc.returncode}; last lines of its log:\n"
                             + self._tail(name))

    def _tail(self, name: str, lines: int = 15) -> str:
        """The last lines of a daemon's log file, or of its stderr while there is none."""
        for suffix in (".log", ".stderr"):
            path = self.logs_dir / f"{name}{suffix}"
            if path.exists() and path.stat().st_size:
                return f"--- {path}\n" + "\n".join(
                    path.read_text(errors="replace").splitlines()[-lines:])
        return f"--- {name}: nothing logged"

    # ---- for the tests

    def run(self, argv: Sequence[str], *, check: bool = False, timeout: float = 60,
            **kw: Any) -> subprocess.CompletedProcess:
        """Run a Slurm client command (squeue, scontrol, sbatch, ...) on this machine."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        env = {**self.env(), **kw.pop("env", {})}
        proc = subprocess.run(list(argv), env=env, timeout=timeout, **kw)
        if check and proc.returncode != 0:
            raise SlurmCommandError(proc.returncode, list(argv), proc.stdout, proc.stderr)
        return proc

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo prints it (idle, alloc, mix, down*, drain, ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=True, timeout=30).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm still runs or holds (pending, running, completing, ...)."""
        return self.run(["squeue", "-h", "-o", "%i"], check=True, timeout=30).stdout.split()

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is idle in sinfo; SlurmError with the states and the daemons' logs."""
        deadline = time.monotonic() + timeout
        states = "sinfo never answered"
        while True:
            for name in self._daemons:
                self._check_alive(name)
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], timeout=30)
            if r.returncode == 0:
                seen = {f[0]: f[1] for f in map(str.split, r.stdout.splitlines()) if len(f) > 1}
                if all(seen.get(n) == "idle" for n in self.nodes):
                    return
                states = r.stdout.strip()  # node, state, why (e.g. "inval Low CPUs")
            else:
                states = f"sinfo: {r.stderr.strip()}"
            if time.monotonic() > deadline:
                daemons = ["slurmctld", *(f"slurmd-{n}" for n in self.nodes)]
                raise SlurmError(f"Slurm nodes not all idle after {timeout:.0f} s:\n{states}\n"
                                 + "\n".join(self._tail(d) for d in daemons))
            time.sleep(0.2)

    def clear(self, timeout: float = KILL_WAIT_S + 30) -> None:
        """Cancel every job and wait until none is left and every node is idle again (a node a
        test left down or drained is resumed first)."""
        deadline = time.monotonic() + timeout
        jobs = self.jobs()
        if jobs:
            self.run(["scancel", *jobs], timeout=30)
        while (jobs := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if jobs:
            raise SlurmError(f"jobs {' '.join(jobs)} still in Slurm {timeout:.0f} s after "
                             "scancel:\n" + self.run(["squeue", "-l"], timeout=30).stdout)
        states = self.node_states()
        unusable = [n for n in self.nodes
                    if any(word in states.get(n, "") for word in ("down", "drain", "fail"))]
        if unusable:
            self.run(["scontrol", "update", f"NodeName={','.join(unusable)}", "State=RESUME"],
                     timeout=30)
        self.wait_idle(max(5.0, deadline - time.monotonic()))

    def describe(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "partition": self.partition, "conf": self.conf,
                "login": self.login, "controller": f"{self.controller_address}:{CONTROLLER_PORT}",
                "timings_s": self.timings.steps}


def marked_processes() -> list[int]:
    """Slurm's and munge's daemons of ours and what they forked (step daemons, the jobs' processes),
    found by their DAEMON_MARK, so also those of a run that was killed (not the registry's, marked too)."""
    return _marked_processes(str(SLURM_ROOT))


def stop_daemons(procs: Sequence[subprocess.Popen] = ()) -> None:
    """End every process of :func:`marked_processes` and remove their files."""
    pids = marked_processes() + [p.pid for p in procs if p.poll() is None]
    if pids:  # the daemons end at once on SIGTERM; slurmstepd ignores it: SIGKILL after 1 s
        _kill_and_wait(pids, grace=1)
    for p in procs:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
    _reap()
    shutil.rmtree(SLURM_ROOT, ignore_errors=True)
    shutil.rmtree(SLURM_SPOOL, ignore_errors=True)
