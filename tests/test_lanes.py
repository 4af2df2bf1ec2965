"""tools/suite/lanes.py: under ``pytest -n 3`` the cluster's tests run in two workers, each lane in order
and on a cluster site of its own, and the others in whichever worker has run out of work, reniced."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lanes

HERE = Path(__file__).resolve().parent.parent / "tools" / "suite"  # the plugins under test

TESTS = '''
import json, os, time
import pytest
import lanes

@pytest.mark.parametrize("i", range({n}))
def test_{kind}(i, request):
    time.sleep({pause})
    with open({seen!r}, "a") as fh:
        fh.write(json.dumps([{kind!r}, i, os.environ["PYTEST_XDIST_WORKER"], os.nice(0),
                             lanes.cluster_site(request.config), time.monotonic(), __file__]) + "\\n")
'''


def _run_lanes(tmp_path: Path, workers: int, env: dict | None = None) -> tuple[list[list], str]:
    seen = tmp_path / "seen.jsonl"
    (tmp_path / "tests" / "cluster").mkdir(parents=True)
    (tmp_path / "tests" / "cluster" / "test_c.py").write_text(TESTS.format(n=6, kind="cluster", seen=str(seen), pause=0.05))
    second = tmp_path / lanes.SECOND_CLUSTER_TESTS[0]
    second.write_text(TESTS.format(n=6, kind="second", seen=str(seen), pause=0.05))
    # the other tests: more than one worker's share of the time
    (tmp_path / "tests" / "test_l.py").write_text(TESTS.format(n=24, kind="local", seen=str(seen), pause=0.1))
    # modules whose tests share a module-scoped fixture, each with more tests than a cluster lane
    for name in ("test_m.py", "test_n.py"):
        (tmp_path / "tests" / name).write_text(TESTS.format(n=8, kind="together", seen=str(seen), pause=0.1)
                                               + '\n@pytest.fixture(scope="module")\ndef shared():\n    return 1\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(HERE), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "lanes", "-p", "no:cacheprovider", "-n", str(workers),
                           "tests"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in seen.read_text().splitlines()], proc.stdout


def _by_kind(runs: list[list], field: int) -> dict[str, set]:
    return {kind: {r[field] for r in runs if r[0] == kind} for kind in ("cluster", "second", "local", "together")}


def _after_their_lane(runs: list[list], worker: str) -> bool:
    """A cluster worker ran other tests only once its own lane was done."""
    lane = [r[5] for r in runs if r[2] == worker and r[0] in ("cluster", "second")]
    return all(r[5] > max(lane, default=0) for r in runs if r[2] == worker and r[0] in ("local", "together"))


def test_cluster_lanes_get_a_worker_and_site_each_and_the_rest_run_where_one_is_free(tmp_path):
    """Each cluster lane runs in a worker of its own, in order, on its own site; the others run where a worker
    is free."""
    runs, out = _run_lanes(tmp_path, 3, {"DDP_TEST_CLUSTER_DISK_GB": "0"})
    assert "one lane" not in out and "the cluster tests run in two lanes, on two clusters side by side" in out
    workers = _by_kind(runs, 2)
    assert len(workers["cluster"]) == 1 and len(workers["second"]) == 1 and workers["cluster"] != workers["second"]
    for kind in ("cluster", "second"):
        assert [r[1] for r in runs if r[0] == kind] == list(range(6))
    assert sorted(r[1] for r in runs if r[0] == "local") == list(range(24))
    for module in ("test_m.py", "test_n.py"):  # a module whose tests share a module-scoped fixture: one worker
        assert len({r[2] for r in runs if r[6].endswith(module)}) == 1
    # the third worker takes the other tests from the start, and a cluster worker joins it once its lane is done
    third = ({r[2] for r in runs} - workers["cluster"] - workers["second"]).pop()
    assert third in workers["local"] and len(workers["local"]) >= 2, workers
    assert all(_after_their_lane(runs, w) for w in workers["cluster"] | workers["second"])
    assert _by_kind(runs, 4)["cluster"] == {0} and _by_kind(runs, 4)["second"] == {1}  # two clusters side by side
    # the other tests yield the cores to the clusters': they, and what they start, run reniced
    base = os.nice(0)
    niced = {min(base + lanes.LOCAL_NICE, 19)}
    assert _by_kind(runs, 3) == {"cluster": {base}, "second": {base}, "local": niced, "together": niced}


def _one_lane_on_the_first_site(runs: list[list]) -> None:
    assert _by_kind(runs, 4)["cluster"] == {0} and _by_kind(runs, 4)["second"] == {0}
    workers = _by_kind(runs, 2)
    assert workers["cluster"] == workers["second"] and len(workers["cluster"]) == 1
    assert [r[1] for r in runs if r[0] == "cluster"] == list(range(6))
    assert _after_their_lane(runs, next(iter(workers["cluster"])))


def test_with_two_workers_the_cluster_tests_are_one_lane_on_the_first_site(tmp_path):
    """The cluster's tests are one lane again, in one worker, on one cluster (Slurm's site)."""
    runs, _ = _run_lanes(tmp_path, 2)
    _one_lane_on_the_first_site(runs)


def test_a_disk_for_one_cluster_only_makes_the_cluster_tests_one_lane_and_says_why(tmp_path):
    """Where the disk holds one cluster only, the cluster tests are one lane, and the run says why."""
    free = shutil.disk_usage(tmp_path).free
    runs, out = _run_lanes(tmp_path, 3, {"DDP_TEST_CLUSTER_DISK_GB": str(free / 1e9)})  # one fits, two do not
    _one_lane_on_the_first_site(runs)
    said = next(line for line in out.splitlines() if "one lane" in line)
    assert said.startswith("the cluster tests run in one lane on one cluster: /var/tmp's filesystem has ")
    assert said.endswith("(tools/suite/lanes.py CLUSTER_DISK_GB); free space there for the faster run")


def test_two_clusters_need_twice_a_lane_s_disk_and_the_cache_where_it_is_not_built(monkeypatch):
    monkeypatch.setenv("DDP_TEST_CLUSTER_DISK_GB", "9")
    monkeypatch.setattr(lanes, "_cache_built", lambda: True)
    assert lanes.disk_for_two_clusters(int(18e9))[0] and not lanes.disk_for_two_clusters(int(17.9e9))[0]
    monkeypatch.setattr(lanes, "_cache_built", lambda: False)
    need = 18 + lanes.CACHE_DISK_GB
    ok, why = lanes.disk_for_two_clusters(int((need - 0.1) * 1e9))
    assert not ok and f"has {need - 0.1:.1f} GB free, two clusters side by side need {need:.0f} " in why
    assert lanes.disk_for_two_clusters(int(need * 1e9))[0]
