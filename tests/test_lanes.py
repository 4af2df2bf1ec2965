"""tests/lanes.py: under ``pytest -n 3`` the cluster's tests run in two workers, each lane in order
and on a cluster site of its own, and the others in the third worker, reniced."""

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
import lanes

@pytest.mark.parametrize("i", range({n}))
def test_{kind}(i, request):
    time.sleep(0.05)
    with open({seen!r}, "a") as fh:
        fh.write(json.dumps([{kind!r}, i, os.environ["PYTEST_XDIST_WORKER"], os.nice(0),
                             lanes.cluster_site(request.config)]) + "\\n")
'''


def _run_lanes(tmp_path: Path, workers: int) -> list[list]:
    seen = tmp_path / "seen.jsonl"
    (tmp_path / "tests" / "cluster").mkdir(parents=True)
    (tmp_path / "tests" / "cluster" / "test_c.py").write_text(TESTS.format(n=6, kind="cluster", seen=str(seen)))
    second = tmp_path / lanes.SECOND_CLUSTER_TESTS[0]
    second.write_text(TESTS.format(n=6, kind="second", seen=str(seen)))
    (tmp_path / "tests" / "test_l.py").write_text(TESTS.format(n=6, kind="local", seen=str(seen)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "lanes", "-p", "no:cacheprovider", "-n", str(workers),
                           "tests"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in seen.read_text().splitlines()]


def _by_kind(runs: list[list], field: int) -> dict[str, set]:
    return {kind: {r[field] for r in runs if r[0] == kind} for kind in ("cluster", "second", "local")}


def test_each_cluster_lane_runs_in_a_worker_of_its_own_in_order_on_its_own_site_and_every_other_test_in_the_third(
        tmp_path):
    runs = _run_lanes(tmp_path, 3)
    workers = _by_kind(runs, 2)
    assert all(len(w) == 1 for w in workers.values()), workers
    assert len(set.union(*workers.values())) == 3, workers
    for kind in ("cluster", "second"):
        assert [r[1] for r in runs if r[0] == kind] == list(range(6))
    assert _by_kind(runs, 4) == {"cluster": {0}, "second": {1}, "local": {0}}  # two clusters side by side
    # the other lane yields the cores to the clusters': its tests, and what they start, run reniced
    base = os.nice(0)
    assert _by_kind(runs, 3) == {"cluster": {base}, "second": {base}, "local": {min(base + lanes.LOCAL_NICE, 19)}}


def test_with_two_workers_the_cluster_tests_are_one_lane_on_the_first_site(tmp_path):
    """The cluster's tests are one lane again, in one worker, on one cluster (Slurm's site)."""
    runs = _run_lanes(tmp_path, 2)
    assert _by_kind(runs, 4) == {"cluster": {0}, "second": {0}, "local": {0}}
    workers = _by_kind(runs, 2)
    assert workers["cluster"] == workers["second"] and len(workers["cluster"]) == 1
    assert workers["local"].isdisjoint(workers["cluster"])
