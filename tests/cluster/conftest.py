"""The ``cluster`` fixture: a real 3-node cluster (see netcluster.py), built once per session.

Without root or the system tools it needs, every test that uses it is skipped with the reason;
with ``DDP_CLUSTER_REQUIRED=1`` (set it in CI) a missing prerequisite fails the tests instead,
so a CI run can never go green without having run them.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from .netcluster import NetCluster, missing_prerequisites
from .operator_cli import empty_nas

CLUSTER_NODES = 3


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


@pytest.fixture(scope="session")
def cluster():
    problems = missing_prerequisites()
    if problems:
        reason = "test cluster unavailable: " + "; ".join(problems)
        if os.environ.get("DDP_CLUSTER_REQUIRED") == "1":
            pytest.fail(reason + " (DDP_CLUSTER_REQUIRED=1)", pytrace=False)
        pytest.skip(reason)
    # SIGTERM (a CI timeout) must still run the teardown below, as Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    c = NetCluster(nodes=CLUSTER_NODES)
    try:
        c.up()
        yield c
    finally:
        c.down()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def fresh_nas(cluster):
    """An empty NAS for each test (the cluster itself is shared by the session), and after it."""
    nas = Path(cluster.nas_dir)
    empty_nas(nas)
    yield nas
    empty_nas(nas)


@pytest.fixture
def record_fault(request):
    """Appends one fault's measured figures to $DDP_FAULTS_RECORD, if set (tests/FAULTS.md)."""
    def write(**figures) -> None:
        target = os.environ.get("DDP_FAULTS_RECORD")
        if target:
            with open(target, "a") as fh:
                fh.write(json.dumps({"test": request.node.name, **figures}) + "\n")
    return write
