"""bench/bench_image.py in its smoke mode on the session's cluster and registry: every way the tool
has, to 1 node and to 2, and the chain's repair on all 3 (the middle node's link down
mid-transfer), so that the image delivery benchmark cannot rot. Small: a base of a few
kilobytes (FROM scratch) instead of the torch base, 12 MB of random bytes on top, links shaped
slow enough that the repair happens mid-transfer. No time is asserted; what is asserted is what
the table stands on: each row timed, verified on its nodes and its bytes counted on the uplink,
and the repair measured and finished by a second deploy.
"""

from __future__ import annotations

import math

import pytest

import bench_module

pytestmark = pytest.mark.cluster

TINY_BASE = "ddp-bench-tiny-base:latest"


def test_the_image_benchmark_ships_every_way_to_one_and_two_nodes_and_times_a_repair(
        cluster, image_registry, fresh_nas, tmp_path):
    """The image benchmark ships every way to one node and to two, and measures the chain's repair."""
    bench = bench_module.load("bench_image")
    args = bench.parser().parse_args(["--nodes", "3", "--sizes", "1,2", "--mb", "12", "--operator-mbit", "40",
                                      "--node-mbit", "80", "--stall-seconds", "2", "--out", str(tmp_path / "x")])
    context = tmp_path / "tiny"
    context.mkdir()
    (context / "hello").write_text("the smoke's base layer\n")
    (context / "Dockerfile").write_text("FROM scratch\nCOPY hello /hello\n")
    work = tmp_path / "work"
    work.mkdir()
    try:
        _operator(cluster, "build", "-q", "-t", TINY_BASE, str(context))
        record = bench.measure(cluster, work, args, image_registry, base=TINY_BASE)
    finally:
        _as_found(cluster, bench, image_registry)

    ways = record["ways"]
    assert {"star", "chain", "registry"} <= set(ways), ways
    assert 12e6 < record["image_layer_bytes"] < 13e6 and record["failed"] == [], record["failed"]
    assert [(r["way"], r["nodes"]) for r in record["rows"]] == [(w, n) for n in (1, 2) for w in ways]
    for r in record["rows"]:
        assert r["exit"] == 0 and r["verified_nodes"] == r["nodes"], r
        assert math.isfinite(r["wall_s"]) and r["nothing_to_ship_wall_s"] > 0, r
        assert r["operator_bytes"] > 0.9 * record["image_layer_bytes"], r  # the layer crossed the uplink
    for way in ways:
        assert set(record["table"][way]) == {"1", "2"} and record["table"][way]["1"]["ratio"] == 1.0
    assert all(v > 0 for v in record["measured_mbit"].values()), record["measured_mbit"]

    repair = record["repair"]
    assert repair is not None and repair["link_down_after_s"] is not None, repair
    assert repair["never_resumed"] == [] and repair["repair_s"] is not None, repair
    assert repair["deploy_exit"] != 0 and repair["middle"] not in repair["holding_the_image"], repair
    assert repair["second_deploy"]["exit"] == 0, repair["second_deploy"]
    assert sorted(repair["second_deploy"]["holding_the_image"]) == [h.name for h in cluster.hosts], repair


def _operator(cluster, *argv):
    import subprocess

    r = subprocess.run(["docker", "-H", cluster.operator_docker_host, *argv], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def _as_found(cluster, bench, registry) -> None:
    """The bench's images gone from the operator's daemon and the nodes: the session's other tests
    deploy their own."""
    import subprocess

    names = [bench.IMAGE, TINY_BASE, f"{registry.host}/ddp-bench-base:cpu"]
    listed = subprocess.run(["docker", "-H", cluster.operator_docker_host, "image", "ls", "--format",
                             "{{.Repository}}:{{.Tag}}"], capture_output=True, text=True, timeout=60).stdout.split()
    names += [n for n in listed if n.startswith(f"{registry.host}/ddp-bench-image:")]
    subprocess.run(["docker", "-H", cluster.operator_docker_host, "image", "rm", "-f", *names],
                   capture_output=True, timeout=120)
    for h in cluster.hosts:
        cluster.run_on(h.name, ["docker", "image", "rm", "-f", *names])
