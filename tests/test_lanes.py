"""tests/lanes.py: under ``pytest -n 4`` the cluster's tests run in two workers, each lane in order
and on a cluster site of its own, and the others in the other two workers, reniced; with fewer
workers the second lanes join the first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    (tmp_path / "tests" / "test_trainer_l.py").write_text(TESTS.format(n=6, kind="local2", seen=str(seen)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "lanes", "-p", "no:cacheprovider", "-n", str(workers),
                           "tests"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in seen.read_text().splitlines()]


KINDS = ("cluster", "second", "local", "local2")


def _by_kind(runs: list[list], field: int) -> dict[str, set]:
    return {kind: {r[field] for r in runs if r[0] == kind} for kind in KINDS}


def test_each_lane_runs_in_a_worker_of_its_own_each_cluster_lane_in_order_on_its_own_site_the_others_reniced(
        tmp_path):
    runs = _run_lanes(tmp_path, 4)
    workers = _by_kind(runs, 2)
    assert all(len(w) == 1 for w in workers.values()), workers
    assert len(set.union(*workers.values())) == 4, workers
    for kind in ("cluster", "second"):
        assert [r[1] for r in runs if r[0] == kind] == list(range(6))
    assert _by_kind(runs, 4) == {"cluster": {0}, "second": {1}, "local": {0}, "local2": {0}}  # two clusters
    # the other lanes yield the cores to the clusters': their tests, and what they start, run reniced
    base, niced = os.nice(0), min(os.nice(0) + lanes.LOCAL_NICE, 19)
    assert _by_kind(runs, 3) == {"cluster": {base}, "second": {base}, "local": {niced}, "local2": {niced}}


@pytest.mark.parametrize("workers, together", [
    (3, [{"cluster"}, {"second"}, {"local", "local2"}]),
    (2, [{"cluster", "second"}, {"local", "local2"}]),
])
def test_with_fewer_workers_the_second_lanes_join_the_first(tmp_path, workers, together):
    """``-n 3``: the other tests in one worker; ``-n 2``: the cluster's tests too, on one cluster."""
    runs = _run_lanes(tmp_path, workers)
    by_worker = _by_kind(runs, 2)
    assert sorted(({k for k in KINDS if w in by_worker[k]} for w in set.union(*by_worker.values())),
                  key=sorted) == sorted(together, key=sorted)
    assert _by_kind(runs, 4) == {"cluster": {0}, "second": {int(workers >= 3)}, "local": {0}, "local2": {0}}
