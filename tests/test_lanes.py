"""tests/lanes.py: under ``pytest -n 2`` the cluster's tests run in one worker, in order, and the
others in the other worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lanes

HERE = Path(__file__).resolve().parent

TESTS = '''
import json, os, time
import pytest

@pytest.mark.parametrize("i", range({n}))
def test_{kind}(i):
    time.sleep(0.05)
    with open({seen!r}, "a") as fh:
        fh.write(json.dumps([{kind!r}, i, os.environ["PYTEST_XDIST_WORKER"], os.nice(0)]) + "\\n")
'''


def test_cluster_tests_run_in_one_worker_in_order_and_every_other_test_in_the_other(tmp_path):
    seen = tmp_path / "seen.jsonl"
    (tmp_path / "tests" / "cluster").mkdir(parents=True)
    (tmp_path / "tests" / "cluster" / "test_c.py").write_text(TESTS.format(n=6, kind="cluster", seen=str(seen)))
    (tmp_path / "tests" / "test_l.py").write_text(TESTS.format(n=6, kind="local", seen=str(seen)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "lanes", "-p", "no:cacheprovider", "-n", "2", "tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in seen.read_text().splitlines()]
    workers = {kind: {w for k, _, w, _ in runs if k == kind} for kind in ("cluster", "local")}
    assert len(workers["cluster"]) == 1 and len(workers["local"]) == 1, workers
    assert workers["cluster"] != workers["local"]
    assert [i for k, i, _, _ in runs if k == "cluster"] == list(range(6))
    # the other lane yields the cores to the cluster's: its tests, and what they start, run reniced
    base = os.nice(0)
    assert {n for k, _, _, n in runs if k == "cluster"} == {base}
    assert {n for k, _, _, n in runs if k == "local"} == {min(base + lanes.LOCAL_NICE, 19)}
