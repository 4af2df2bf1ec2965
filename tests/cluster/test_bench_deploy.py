"""bench/bench_deploy.py in its smoke mode on the session's cluster: every part once, on 1 node
against 2 (check, deploy of a missing image, a repeated deploy, launch to the first step, deploy
after a code-only change), so that the deploy benchmark cannot rot. The nodes hold the base
(cold_one=False, cold_all=False): the layers above it travel, never the whole image (its whole
ship is the image tests'). No time is asserted; what is asserted is that each part was timed, and
the bytes the benchmark exists to watch: the same layers to one node as to each of two, nothing
shipped again for an unchanged image, a code-only change far smaller than the image.
"""

from __future__ import annotations

import math

import pytest

import bench_module

pytestmark = pytest.mark.cluster

PREVIOUS = "ddp-trainer:previous"


def _image_id(docker, name: str) -> str | None:
    r = docker("image", "inspect", "--format", "{{.Id}}", name)
    return r.stdout.strip() if r.returncode == 0 else None


def test_the_deploy_benchmark_times_each_part_on_one_node_and_two(cluster, fresh_nas, tmp_path):
    bench = bench_module.load("bench_deploy")
    try:
        record = bench.measure(cluster, tmp_path, rounds=1, nodes=2, cold_all=False, cold_one=False)
    finally:
        _as_found(cluster, bench)
    assert record["nodes"] == 2 and record["rounds"] == 1
    assert set(record["seconds"]) == {"check_1", "check_all", "deploy_1", "deploy_all", "redeploy_all",
                                      "launch_to_first_step", "code_change_1", "code_change_all"}
    assert all(len(v) == 1 and math.isfinite(v[0]) and v[0] > 0 for v in record["seconds"].values()), record
    assert set(record["busy_cpu_median"]) == {"check_1", "check_all", "deploy_1", "deploy_all", "code_change_1",
                                              "code_change_all"}
    # to one node and to two, holding the base: the layers above it, far less than the 1.2 GB image, the
    # same to each node (the figure for two is both nodes' together)
    (one,), (both,) = record["deploy_image_mb"]["1"], record["deploy_image_mb"]["all"]
    assert 0 < one < 300 and abs(both - 2 * one) <= 0.1 * one, record["deploy_image_mb"]
    assert record["cold_all"] is False and record["cold_one"] is False
    assert record["redeploy_image_mb"] == [0.0]  # an image every node holds is not sent again
    assert max(record["code_change_image_mb"]["all"]) < 50, record["code_change_image_mb"]  # of a 1.2 GB image


def _as_found(cluster, bench) -> None:
    """The operator's image tagged as before the benchmark (it retags it to its code-only change);
    the images it left on the nodes removed: the session's other tests deploy for themselves. The
    nodes hold the base (its deploy to two nodes put it back where the cold one took it)."""
    import subprocess

    def operator(*argv):
        return subprocess.run(["docker", "-H", cluster.operator_docker_host, *argv], capture_output=True,
                              text=True, timeout=300)

    changed, previous = _image_id(operator, bench.IMAGE), _image_id(operator, PREVIOUS)
    if previous is not None:
        operator("tag", PREVIOUS, bench.IMAGE)
        operator("image", "rm", PREVIOUS)
        if changed is not None and changed != previous:
            operator("image", "rm", changed)
    for h in cluster.hosts[:2]:
        ids = [i for i in (changed, previous) if i]
        cluster.run_on(h.name, ["docker", "image", "rm", "-f", bench.IMAGE, *ids])
    cluster.hold_base([h.name for h in cluster.hosts[:2]])  # a no-op unless the benchmark failed midway
