"""bench/bench_launch.py in its smoke mode on the session's cluster: one round on one node (a launch
whose node probes, a relaunch taking the probe answer the node kept, and the floor: the same job's
torchrun started by hand over SSH), so that the launch benchmark cannot rot. No figure
is asserted; what is asserted is that each run was timed and split into its parts, as the
benchmark's table shows them.
"""

from __future__ import annotations

import math

import pytest

import bench_module

pytestmark = pytest.mark.cluster



def test_the_launch_benchmark_times_and_splits_launch_and_its_floor_to_first_step(cluster, fresh_nas, tmp_path):
    """The launch benchmark times launch and its floor to the first step, and splits both."""
    bench = bench_module.load("bench_launch")
    try:
        result = bench.measure(cluster, tmp_path, [1], 1)
        _check(cluster, bench, result, bench.containers(bench.inventory(cluster, tmp_path, 1)))
    finally:  # node1 as it was found: the session's other tests deploy the image themselves
        cluster.run_on("node1", ["docker", "image", "rm", "-f", bench.IMAGE])


def _check(cluster, bench, result, ours):
    assert [(r["kind"], r["nodes"]) for r in result["runs"]] == [("probed", 1), ("ours", 1), ("floor", 1)]
    for run in result["runs"]:
        # each part was found: the first step, the launcher's start, the trainer's own line
        assert math.isfinite(run["first_step_s"]) and run["first_step_s"] > run["container_s"], run
        assert run["trainer_total_s"] is not None, run
        assert {"launcher to this process", "imports", "process group", "model"} <= set(run["trainer"]), run
    for run in result["runs"][:2]:
        assert {"lock", "checks", "image check", "start"} <= set(run["operator"]), run
    (row,) = result["rows"]
    assert row["ours_overhead_s"] == round(row["ours"]["first_step_s"] - row["floor"]["first_step_s"], 2)
    table = bench.table(result)
    assert "operator: checks" in table and "trainer: imports" in table, table
    # the node kept its probe answer (the relaunch took it) under the id of the image it holds
    image = cluster.run_on("node1", ["docker", "image", "inspect", "-f", "{{.Id}}", bench.IMAGE]).stdout.strip()
    kept = [p.name for p in (cluster.node_cache_dir("node1") / "ddp-deploy" / "probe").iterdir()]
    assert [k for k in kept if k.endswith("-" + image.removeprefix("sha256:"))], (kept, image)
    # the floor's containers are gone, by their exact names; ours were stopped by `stop`
    for h, container in zip(cluster.hosts[:1], ours):
        left = cluster.run_on(h.name, ["docker", "ps", "-a", "--format", "{{.Names}}"]).stdout.split()
        assert not [n for n in left if n in (f"ddp-floor-{h.name}", container)], left
