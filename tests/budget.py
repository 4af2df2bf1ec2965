"""The suite's time budget, as a report (never a failure: these machines are noisy).

At the end of every run: where the time went (cluster, e2e and unit tests, each with its share),
the slowest tests, and every test over its own limit or the whole run over the suite's. A test's
limit is its kind's (``LIMITS``) unless it says otherwise with ``@pytest.mark.budget(seconds)``;
the suite's is ``$DDP_TEST_BUDGET_S`` (default ``SUITE_LIMIT_S``: CI's 30 minutes less its installs).
``$DDP_TEST_TIMES=FILE`` also writes every test's seconds there as JSON (docs/testing.md).

The report also says how busy the machine's cores were over the run (``/proc/stat``, every
process of the machine: the cluster's containers too): near all of them, and only less CPU work
makes the suite faster; far from it, the run mostly waits, and running more side by side would.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest

SUITE_LIMIT_S = 25 * 60
LIMITS = {"cluster": 120.0, "e2e": 45.0, "unit": 10.0}
SLOWEST = 15


def busy_core_seconds() -> float | None:
    """Core-seconds the machine's CPUs have spent on anything but idling since boot, or None where
    /proc/stat cannot be read."""
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user's


def _kind(item: pytest.Item) -> str:
    return next((k for k in ("cluster", "e2e") if item.get_closest_marker(k)), "unit")


def _limit(item: pytest.Item) -> float:
    mark = item.get_closest_marker("budget")
    return float(mark.args[0]) if mark else LIMITS[_kind(item)]


class Budget:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.busy_at_start = busy_core_seconds()
        self.kinds: dict[str, str] = {}
        self.limits: dict[str, float] = {}
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration  # setup, call and teardown together
        said = dict(report.user_properties)  # set where the test ran: here, or in an xdist worker
        if "budget_kind" in said:
            self.kinds[report.nodeid], self.limits[report.nodeid] = said["budget_kind"], said["budget_limit"]

    def lines(self, wall: float, suite_limit: float, busy: float | None = None,
              cores: int | None = None) -> list[str]:
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
        out.append(f"slowest {SLOWEST}:")
        slowest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SLOWEST]
        out += [f"  {s:7.1f} s  {nodeid}" for nodeid, s in slowest]
        over = [(nodeid, s, self.limits[nodeid]) for nodeid, s in self.seconds.items()
                if nodeid in self.limits and s > self.limits[nodeid]]
        if over:
            out.append(f"over their own limit ({len(over)}):")
            out += [f"  {s:7.1f} s > {limit:.0f} s  {nodeid}" for nodeid, s, limit in sorted(over, key=lambda o: -o[1])]
        if wall > suite_limit:
            out.append(f"the suite is over its limit: {wall / 60:.1f} min > {suite_limit / 60:.1f} min "
                       "($DDP_TEST_BUDGET_S); see the slowest tests above")
        else:
            out.append(f"within the suite's limit: {wall / 60:.1f} min of {suite_limit / 60:.1f} min")
        return out

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seconds:
            return
        wall = time.monotonic() - self.started
        suite_limit = float(os.environ.get("DDP_TEST_BUDGET_S") or SUITE_LIMIT_S)
        now = busy_core_seconds()
        busy = now - self.busy_at_start if now is not None and self.busy_at_start is not None else None
        cores = os.cpu_count()
        terminalreporter.section("time budget")
        for line in self.lines(wall, suite_limit, busy, cores):
            terminalreporter.write_line(line)
        target = os.environ.get("DDP_TEST_TIMES")
        if target:
            with open(target, "w") as fh:
                json.dump({"wall_s": round(wall, 1), "busy_core_s": busy and round(busy, 1), "cores": cores, "tests": {n: {"s": round(s, 2), "kind": self.kinds.get(n, "unit")}
                                                               for n, s in self.seconds.items()}}, fh, indent=1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test carries its kind and limit in its reports, which reach the controller from any worker."""
    for item in items:
        item.user_properties += [("budget_kind", _kind(item)), ("budget_limit", _limit(item))]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "budget(seconds): this test's own time limit in the budget report")
    if not hasattr(config, "workerinput"):  # the controller alone reports, where tests run in workers
        config.pluginmanager.register(Budget(), "ddp-budget")
