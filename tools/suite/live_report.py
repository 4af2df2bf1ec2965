"""Failures as they happen, and what was running if the run is killed.

pytest names failed tests only in its summary at the end, and a run that CI kills at its time
limit (SIGTERM) never gets there: its log shows ``F`` among the dots and nothing else. So each
failure is named on a line of its own as soon as its report arrives (under ``-n``, in the
controller, from either lane), and on SIGTERM the run first lists the failures so far and the
tests still running, with how long each had run. It starts by saying how much disk is free where
the tests write (a full disk once failed a dozen tests at once, each with its own symptom).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time

import pytest


class LiveReport:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.failed: list[str] = []
        self.running: dict[str, float] = {}

    def _say(self, line: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write("\n")
            reporter.write_line(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def pytest_sessionstart(self, session) -> None:
        self._say("free disk: " + free_disk())

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.running[nodeid] = time.monotonic()

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        self.running.pop(nodeid, None)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.failed:
            return
        crash = getattr(report.longrepr, "reprcrash", None)
        why = crash.message.splitlines()[0] if crash is not None and crash.message else ""
        line = f"FAILED ({report.when}, {report.duration:.0f} s) {report.nodeid}: {why}"[:400]
        self.failed.append(line)
        self._say(line)

    def on_sigterm(self, signum, frame) -> None:
        now = time.monotonic()
        lines = [f"terminated (SIGTERM), free disk: {free_disk()}; failures so far:", *(self.failed or ["(none)"]),
                 "still running:", *([f"  {nodeid} for {now - start:.0f} s" for nodeid, start in self.running.items()]
                                    or ["(none)"])]
        print("\n".join(lines), file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # then end as SIGTERM ends it


def free_disk(paths=(tempfile.gettempdir(), "/var")) -> str:
    """Free space under each of ``paths`` that lies on a filesystem of its own, in GB."""
    seen, said = set(), []
    for path in paths:
        try:
            device, usage = os.stat(path).st_dev, shutil.disk_usage(path)
        except OSError:
            continue
        if device not in seen:
            seen.add(device)
            said.append(f"{path} {usage.free / 1e9:.1f} GB")
    return ", ".join(said) or "unknown"


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    report = LiveReport(config)
    config.pluginmanager.register(report, "live_report_reporter")
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, report.on_sigterm)
