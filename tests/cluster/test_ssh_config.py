"""The operator's ~/.ssh/config on real hosts: a node reached only through a jump host, and a
node whose link goes down costing seconds per call, not a command's timeout."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from deploy.inventory import loads
from deploy.nodes.remote import Remote

from .operator_cli import ddp, ok

pytestmark = pytest.mark.cluster


@pytest.fixture
def operator_blocked_from_node2(cluster):
    """node2 drops SSH from the operator's address only: node1 still reaches it."""
    ns = cluster.host("node2").ns
    rule = ["INPUT", "-s", cluster.operator_address, "-p", "tcp", "--dport", "22", "-j", "DROP"]
    subprocess.run(["ip", "netns", "exec", ns, "iptables", "-I", *rule], check=True)
    yield
    subprocess.run(["ip", "netns", "exec", ns, "iptables", "-D", *rule], check=True)


def _hosts(cluster, tmp_path, *, config, node2_ssh=None):
    hosts = cluster.hosts_config(runtime="host", ssh={"connect_timeout": 3, "config": config})
    if node2_ssh:
        hosts["nodes"][1]["ssh"] = node2_ssh
    path = tmp_path / "hosts.yaml"
    path.write_text(json.dumps(hosts))
    return path


def _states(proc) -> dict[str, dict]:
    return {s["node"]: s for s in json.loads(ok(proc).stdout)}


def test_a_node_only_a_jump_host_reaches_is_reached_through_the_operators_ssh_config(
        cluster, tmp_path, operator_blocked_from_node2):
    config = tmp_path / "ssh_config"  # a test-local file, never /root/.ssh/config
    config.write_text(f"Host bastion\n  HostName {cluster.host('node1').address}\n"
                      f"Host node2-alias\n  HostName {cluster.host('node2').address}\n  ProxyJump bastion\n")

    direct = _states(ddp(cluster, _hosts(cluster, tmp_path, config=str(config)), "status", "--json", timeout=120))
    assert direct["node2"]["state"] == "unreachable"  # the block holds: no way in but the jump host
    assert direct["node1"]["state"] != "unreachable"

    jumped = _states(ddp(cluster, _hosts(cluster, tmp_path, config=str(config), node2_ssh={"host": "node2-alias"}),
                         "status", "--json", timeout=120))
    assert {n: s["state"] for n, s in jumped.items()} == {"node1": "absent", "node2": "absent", "node3": "absent"}

    hosts = _hosts(cluster, tmp_path, config=None, node2_ssh={"host": "node2-alias"})
    stopped = ddp(cluster, hosts, "stop", timeout=120)  # without the config the alias means nothing
    assert stopped.returncode == 1
    assert "node2: stop: unreachable: root@node2-alias:22" in stopped.stderr, stopped.stderr


def test_a_node_whose_link_goes_down_costs_seconds_per_call_not_the_calls_timeout(cluster, tmp_path):
    """Packets to node3 are dropped (its link is down) while the operator holds a connection to
    it: each call gives up within connect_timeout (3 s) instead of its own 60 s."""
    inv = loads(_hosts(cluster, tmp_path, config=None).read_text())
    with Remote(inv) as remote:
        assert all(r.ok for r in remote.run_all(["true"], timeout=60).values())
        cluster.take_link_down("node3")
        try:
            took = []
            for _ in range(2):
                t0 = time.monotonic()
                res = remote.run_all(["true"], timeout=60, check=False)
                took.append(time.monotonic() - t0)
                assert res["node1"].ok and res["node2"].ok
                assert res["node3"].error.startswith(("connection lost: root@198.18.0.13:22",
                                                      "unreachable: root@198.18.0.13:22")), res["node3"]
        finally:
            cluster.bring_link_up("node3")
    print("a node with its link down cost", [f"{t:.1f} s" for t in took])
    assert max(took) < 3 * 4 / 3 + 1.5, took
