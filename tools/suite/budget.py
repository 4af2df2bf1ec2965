"""The suite's time budget, as a report (never a failure: these machines are noisy).

At the end of every run: where the time went (cluster, e2e and unit tests, each with its share),
the slowest tests, and every test over its own limit or the whole run over the suite's. A test's
limit is its kind's (``LIMITS``) unless it says otherwise with ``@pytest.mark.budget(seconds)``;
the suite's is ``$DDP_TEST_BUDGET_S`` (default ``SUITE_LIMIT_S``: the tests' share of CI's 35 minutes, its installs left out).
``$DDP_TEST_TIMES=FILE`` also writes every test's seconds there as JSON (docs/testing.md).

Each test's CPU is measured too, where it ran: what its worker process and every process it
started used meanwhile (a cgroup of the worker's own; where none can be made, ``getrusage`` of the
worker and of the children it waited for, which counts a long-lived child where it is reaped), and
for a cluster test what its site's containers used (the nodes' launchers, zygotes and workers; not
the shared dockerd). Listed as the tests that took most CPU, and in
``$DDP_TEST_TIMES`` as ``cpu_s``: where less work would shorten a run whose cores are busy.
pytest tears the session's fixtures down (a test cluster and its daemons) in the teardown of a
process's last test: that teardown's seconds and CPU are the session's, in a line of their own and
in ``$DDP_TEST_TIMES`` as ``session_teardown``, not the test's (a unit test that took no time was
once reported at 18 s and 148 core-s).

The report also says how busy the machine's cores were over the run (``/proc/stat``, every
process of the machine: the cluster's containers too): near all of them, and only less CPU work
makes the suite faster; far from it, the run mostly waits, and running more side by side would.

And how full the disk got: the most used on the filesystem of ``$DDP_TEST_DISK`` (default
/var/tmp, where the clusters keep their nodes' image stores and the image chain its spool files)
beyond what it held at the start, its least free space, and the tests running at that moment; in
``$DDP_TEST_TIMES``, each test's ``disk_gb``: the most used while it ran beyond its start (with
whatever ran beside it), and ``start_s``, when it started, in seconds into the run.
Every test that ships an image writes gigabytes: this is where two clusters side by side can run
a machine out of space (``No space left on device`` in a failure is then the machine's, not the
code's).

And how fast the machine was, at the start and at the end: the CPU seconds a fresh process takes
to ``import torch`` (:func:`reference_core_seconds`; in ``$DDP_TEST_TIMES``, ``reference_core_s``),
the one piece of work nearly every process of the suite does (the launchers, probes and workers:
about 40% of its CPU). The same tests took from 40 to 110 core-minutes on machines of one kind,
from one run to another; dividing by this figure tells the machine's share from the code's.
``$DDP_TEST_REFERENCE`` replaces the command (empty: none measured).
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

SUITE_LIMIT_S = 32 * 60
DISK_PATH, DISK_EVERY_S = "/var/tmp", 0.5
LIMITS = {"cluster": 120.0, "e2e": 45.0, "unit": 10.0}
SLOWEST = 15


REFERENCE = (sys.executable, "-c", "import torch")
REFERENCE_TRIES = 2


def reference_command() -> list[str]:
    said = os.environ.get("DDP_TEST_REFERENCE")
    return list(REFERENCE) if said is None else shlex.split(said)


def reference_core_seconds(command: list[str] | None = None, tries: int = REFERENCE_TRIES) -> float | None:
    """CPU seconds (user and system) of ``command`` (:func:`reference_command`) in a fresh process,
    the best of ``tries`` so that a first read of its files from disk does not count: lower is a
    faster machine. None where there is no command or it fails. The child's own figure
    (``wait4``), not the whole of this process's children's."""
    command = reference_command() if command is None else command
    if not command:
        return None
    best = None
    for _ in range(tries):
        try:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        except OSError:
            return None
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            return None
        took = usage.ru_utime + usage.ru_stime
        best = took if best is None else min(best, took)
    return best


def busy_core_seconds() -> float | None:
    """Core-seconds the machine's CPUs have spent on anything but idling since boot, or None where
    /proc/stat cannot be read."""
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user's


def process_cpu_seconds() -> float:
    """This process's CPU, and that of every child it has waited for (theirs include their own):
    where no cgroup of its own can be made, which counts a long-lived child when it is reaped."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


CPUACCT = Path("/sys/fs/cgroup/cpuacct")
OWN_GROUP_PREFIX = "ddptests-"


def own_cgroup() -> str | None:
    """A cpuacct cgroup (v1, as root) for this process alone, and for every process it starts until
    something moves it (a cluster node's container: its site's cgroup). None where none can be made."""
    for stale in CPUACCT.glob(OWN_GROUP_PREFIX + "*"):  # those of earlier runs, once empty
        try:
            stale.rmdir()
        except OSError:
            pass
    group = CPUACCT / f"{OWN_GROUP_PREFIX}{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group.name


def leave_own_cgroup(name: str) -> None:
    try:
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        (CPUACCT / name).rmdir()  # fails while a process this one started is still in it; the next run removes it
    except OSError:
        pass


def cgroup_cpu_seconds(name: str) -> float:
    """CPU that the processes of cgroup ``name`` have used (v1 cpuacct, or v2's cpu.stat), 0 where
    it does not exist (yet, or any more)."""
    try:
        return int((CPUACCT / name / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        pass
    try:
        stat = dict(line.split() for line in Path(f"/sys/fs/cgroup/{name}/cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6
    except (OSError, ValueError, KeyError):
        return 0.0


def _cluster_cgroup(item: pytest.Item) -> str | None:
    """The cgroup of the cluster this test drives, or None for a test of the other lane."""
    import lanes

    site = lanes.site_of(item)
    if site is None:
        return None
    from cluster.netcluster import Site

    return Site(site).cgroup


class CpuPerTest:
    """Where a test runs: its CPU from before its setup to the end of its teardown, in its reports:
    what this process's own cgroup (all it started) and its cluster's used meanwhile."""

    def __init__(self) -> None:
        self.group = own_cgroup()

    def cpu_seconds(self) -> float:
        return cgroup_cpu_seconds(self.group) if self.group else process_cpu_seconds()

    def pytest_unconfigure(self) -> None:
        if self.group:
            leave_own_cgroup(self.group)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        group = _cluster_cgroup(item)
        item._budget_cpu_start = group, self.cpu_seconds(), group and cgroup_cpu_seconds(group)
        yield

    def _used(self, group: str | None) -> tuple[float, float]:
        return self.cpu_seconds(), cgroup_cpu_seconds(group) if group is not None else 0.0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem):
        """The last test of a process (nextitem None) tears down the session's fixtures too (a test
        cluster, its daemons): the work before that is the test's, the rest the session's."""
        if nextitem is None and hasattr(item, "_budget_cpu_start"):
            item._budget_teardown_start = time.monotonic(), self._used(item._budget_cpu_start[0])
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        if call.when == "teardown" and hasattr(item, "_budget_cpu_start"):
            group, own, grouped = item._budget_cpu_start
            now = self._used(group)
            if hasattr(item, "_budget_teardown_start"):  # the test's own figures end where its teardown began
                began, at = item._budget_teardown_start
                shared = (now[0] - at[0]) + max(0.0, now[1] - at[1])
                item.user_properties.append(("budget_session_teardown", (round(time.monotonic() - began, 2),
                                                                         round(shared, 2))))
                now = at
            used = now[0] - own
            if group is not None:  # a cgroup made in this test counts from 0; one removed loses its count
                used += max(0.0, now[1] - grouped)
            item.user_properties.append(("budget_cpu", round(used, 2)))
        yield


def _kind(item: pytest.Item) -> str:
    return next((k for k in ("cluster", "e2e") if item.get_closest_marker(k)), "unit")


def _limit(item: pytest.Item) -> float:
    mark = item.get_closest_marker("budget")
    return float(mark.args[0]) if mark else LIMITS[_kind(item)]


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.0f} MB"


class DiskPeak:
    """The most used on one filesystem while the run goes on, sampled by a thread, and which tests
    were running then."""

    def __init__(self, path: str, every_s: float = DISK_EVERY_S) -> None:
        self.path, self.every_s = path, every_s
        self.running: dict[str, list[int]] = {}  # test: [used at its start, most used since]
        self.grew: dict[str, int] = {}  # test: the most used while it ran, beyond its start
        self.lock = threading.Lock()  # running changes in pytest's thread, is read in this one's
        self.start_used, self.least_free = self._used()
        self.peak_used = self.start_used
        self.at_peak: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddp-budget-disk", daemon=True)
        self._thread.start()

    def _used(self) -> tuple[int, int]:
        usage = shutil.disk_usage(self.path)
        return usage.used, usage.free

    def sample(self) -> None:
        used, free = self._used()
        self.least_free = min(self.least_free, free)
        with self.lock:
            for seen in self.running.values():
                seen[1] = max(seen[1], used)
            if used > self.peak_used:
                self.peak_used, self.at_peak = used, sorted(self.running)

    def started(self, nodeid: str) -> None:
        used = self._used()[0]
        with self.lock:
            self.running[nodeid] = [used, used]

    def finished(self, nodeid: str) -> None:
        self.sample()
        with self.lock:
            start, most = self.running.pop(nodeid, (0, 0))
            self.grew[nodeid] = max(self.grew.get(nodeid, 0), most - start)

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def line(self) -> str:
        line = (f"disk ({self.path}'s filesystem): at most {_size(self.peak_used - self.start_used)} more "
                f"than at the start, {_size(self.least_free)} free at the least")
        return line + (", while running: " + ", ".join(self.at_peak) if self.at_peak else "")

    def record(self) -> dict:
        return {"path": self.path, "peak_above_start_gb": round((self.peak_used - self.start_used) / 1e9, 3),
                "least_free_gb": round(self.least_free / 1e9, 3), "at_peak": self.at_peak}


class Budget:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.busy_at_start = busy_core_seconds()
        self.reference_at_start = reference_core_seconds()
        self.disk = DiskPeak(os.environ.get("DDP_TEST_DISK") or DISK_PATH,
                             float(os.environ.get("DDP_TEST_DISK_EVERY_S") or DISK_EVERY_S))
        self.kinds: dict[str, str] = {}
        self.limits: dict[str, float] = {}
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = {}
        self.start: dict[str, float] = {}  # seconds into the run, as the controller heard of it
        self.session_teardown: list[tuple[float, float]] = []  # (s, core-s): each process's, after its last test

    def pytest_runtest_logstart(self, nodeid: str) -> None:  # here, or forwarded from a worker
        self.disk.started(nodeid)
        self.start.setdefault(nodeid, time.monotonic() - self.started)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self.disk.finished(nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        said = dict(report.user_properties)  # set where the test ran: here, or in an xdist worker
        duration = report.duration
        if report.when == "teardown" and "budget_session_teardown" in said:
            # a process's last test: the session's fixtures torn down in its teardown are no test's
            seconds, cpu = said["budget_session_teardown"]
            self.session_teardown.append((seconds, cpu))
            duration = max(0.0, duration - seconds)
        self.seconds[report.nodeid] += duration  # setup, call and teardown together
        if "budget_kind" in said:
            self.kinds[report.nodeid], self.limits[report.nodeid] = said["budget_kind"], said["budget_limit"]
        if "budget_cpu" in said:
            self.cpu[report.nodeid] = said["budget_cpu"]

    def lines(self, wall: float, suite_limit: float, busy: float | None = None,
              cores: int | None = None, reference: tuple[float | None, float | None] = (None, None)) -> list[str]:
        by_kind: dict[str, float] = defaultdict(float)
        for nodeid, s in self.seconds.items():
            by_kind[self.kinds.get(nodeid, "unit")] += s
        total = sum(by_kind.values()) or 1.0
        out = [f"wall {wall / 60:.1f} min; in tests: " + ", ".join(
            f"{kind} {s / 60:.1f} min ({100 * s / total:.0f}%)" for kind, s in
            sorted(by_kind.items(), key=lambda kv: -kv[1]))]
        if busy is not None and cores:
            out.append(f"cores busy {100 * busy / (wall * cores):.0f}% of the run: {busy / 60:.1f} core-min "
                       f"of {wall * cores / 60:.1f} ({cores} cores, every process of the machine)")
        if None not in reference:
            command = reference_command()
            named = "python -c 'import torch'" if tuple(command) == REFERENCE else shlex.join(command)
            out.append(f"the machine's speed: a fresh `{named}` took {reference[0]:.2f} core-s "
                       f"at the start, {reference[1]:.2f} at the end (lower is faster; compare runs by it)")
        out.append(f"slowest {SLOWEST}:")
        slowest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SLOWEST]
        out += [f"  {s:7.1f} s  {nodeid}" for nodeid, s in slowest]
        if self.cpu:
            out.append(f"most CPU {SLOWEST} (of {sum(self.cpu.values()) / 60:.1f} core-min measured in tests):")
            out += [f"  {s:7.1f} core-s  {nodeid}" for nodeid, s in sorted(self.cpu.items(), key=lambda kv: -kv[1])[:SLOWEST]]
        over = [(nodeid, s, self.limits[nodeid]) for nodeid, s in self.seconds.items()
                if nodeid in self.limits and s > self.limits[nodeid]]
        if over:
            out.append(f"over their own limit ({len(over)}):")
            out += [f"  {s:7.1f} s > {limit:.0f} s  {nodeid}" for nodeid, s, limit in sorted(over, key=lambda o: -o[1])]
        if self.session_teardown:
            out.append(f"the session's fixtures torn down after each process's last test, in no test's figures: "
                       f"{sum(s for s, _ in self.session_teardown):.1f} s, "
                       f"{sum(c for _, c in self.session_teardown):.1f} core-s "
                       f"(the run's {len(self.session_teardown)} test processes together)")
        out.append(self.disk.line())
        if wall > suite_limit:
            out.append(f"the suite is over its limit: {wall / 60:.1f} min > {suite_limit / 60:.1f} min "
                       "($DDP_TEST_BUDGET_S); see the slowest tests above")
        else:
            out.append(f"within the suite's limit: {wall / 60:.1f} min of {suite_limit / 60:.1f} min")
        return out

    def pytest_terminal_summary(self, terminalreporter) -> None:
        self.disk.stop()
        if not self.seconds:
            return
        wall = time.monotonic() - self.started
        suite_limit = float(os.environ.get("DDP_TEST_BUDGET_S") or SUITE_LIMIT_S)
        now = busy_core_seconds()
        busy = now - self.busy_at_start if now is not None and self.busy_at_start is not None else None
        cores = os.cpu_count()
        reference = (self.reference_at_start, reference_core_seconds())
        terminalreporter.section("time budget")
        for line in self.lines(wall, suite_limit, busy, cores, reference):
            terminalreporter.write_line(line)
        target = os.environ.get("DDP_TEST_TIMES")
        if target:
            with open(target, "w") as fh:
                json.dump({"wall_s": round(wall, 1), "busy_core_s": busy and round(busy, 1), "cores": cores,
                           "reference_core_s": {"start": reference[0] and round(reference[0], 3),
                                                "end": reference[1] and round(reference[1], 3)},
                           "disk": self.disk.record(),
                           "session_teardown": [{"s": s, "cpu_s": c} for s, c in self.session_teardown],
                           "tests": {
                    n: {"s": round(s, 2), "kind": self.kinds.get(n, "unit"), "cpu_s": self.cpu.get(n),
                        "disk_gb": round(self.disk.grew.get(n, 0) / 1e9, 3),
                        "start_s": round(self.start[n], 1) if n in self.start else None}
                    for n, s in self.seconds.items()}}, fh, indent=1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test carries its kind and limit in its reports, which reach the controller from any worker."""
    for item in items:
        item.user_properties += [("budget_kind", _kind(item)), ("budget_limit", _limit(item))]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "budget(seconds): this test's own time limit in the budget report")
    config.pluginmanager.register(CpuPerTest(), "ddp-budget-cpu")  # where tests run: here, or each worker
    if not hasattr(config, "workerinput"):  # the controller alone reports, where tests run in workers
        config.pluginmanager.register(Budget(), "ddp-budget")
