"""Spares (hosts.yaml's ``spares:``): checked and made ready as the nodes are, never started by
launch; ``--with SPARE`` puts one in the place of a node left out with ``--without``."""

from __future__ import annotations

import json

import pytest

from deploy.errors import InventoryError
from local_job import inventory, local_hosts, local_nodes, on_paper
from waiting import wait_until


def _fleet(**fields):
    nodes = [{"name": n, "address": f"198.18.0.{11 + i}"} for i, n in enumerate(("a", "b", "c"))]
    return on_paper(nodes, job="demo", spares=[{"name": "s", "address": "198.18.0.19"}], **fields)


def _hosts(tmp_path):
    nodes = [{"name": n, "address": f"198.18.0.{11 + i}"} for i, n in enumerate(("a", "b", "c"))]
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(json.dumps(inventory(nodes, job="demo", rendezvous={"node": "b"},
                                          spares=[{"name": "s", "address": "198.18.0.19"}])))
    return hosts


def test_a_spare_takes_a_lost_node_s_place_and_the_rendezvous_moves_off_it():
    inv = _fleet(rendezvous={"node": "b"})
    healed = inv.without(["b"]).with_spares(["s"])
    assert [n.name for n in healed.nodes] == ["a", "c", "s"] and healed.spares == ()
    assert healed.rendezvous.node == "a" and healed.listed == 3
    assert healed.node("s").address == "198.18.0.19"


def test_a_spare_beyond_the_nodes_left_out_or_not_a_spare_is_refused():
    inv = _fleet()
    with pytest.raises(InventoryError, match=r"1 spare\(s\) for 0 node\(s\) left out"):
        inv.with_spares(["s"])
    with pytest.raises(InventoryError, match=r"c: not in spares\[\]\.name \(s\)"):
        inv.without(["b"]).with_spares(["c"])


def test_check_and_deploy_reach_the_spares_and_launch_leaves_them_alone(ddp, tmp_path):
    hosts = _hosts(tmp_path)
    deploy = ddp(hosts, "deploy", "--dry-run")
    assert deploy.exit_code == 0, deploy.output
    assert {line.split("]")[0][1:] for line in deploy.stdout.splitlines() if line.startswith("[")} >= {"a", "b", "c", "s"}
    launch = ddp(hosts, "launch", "--dry-run")
    assert launch.exit_code == 0, launch.output
    assert not any(line.startswith("[s]") for line in launch.stdout.splitlines())
    assert "3 nodes and 1 spare" in ddp(hosts, "validate").stdout


def test_the_cli_with_a_spare_plans_it_in_the_lost_node_s_place(ddp, tmp_path):
    hosts = _hosts(tmp_path)
    r = ddp(hosts, "--without", "b", "--with", "s", "launch", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "note: with s in place of what is left out: 3 nodes" in r.stderr
    started = {line.split("]")[0][1:] for line in r.stdout.splitlines() if line.startswith("[")}
    assert started >= {"a", "c", "s"} and "b" not in started
    bad = ddp(hosts, "--with", "s", "launch", "--dry-run")
    assert bad.exit_code == 2 and "a spare takes the place of a node left out with --without" in bad.stderr


@pytest.mark.e2e
def test_a_spare_is_checked_as_a_node_is(ddp, tmp_path):
    hosts = local_hosts(tmp_path, job="spares", nodes=local_nodes("here"), spares=local_nodes("spare1", "spare2")[1:])
    r = ddp(hosts, "check")
    rows = [line for line in r.stdout.splitlines() if " spare2 " in f" {line} " or line.startswith("spare2")]
    assert r.exit_code == 0, r.output
    assert any("torch" in line for line in rows) and any("storage" in line for line in rows), r.stdout


@pytest.mark.e2e
def test_a_job_trains_to_its_end_with_a_spare_in_a_lost_node_s_place(ddp, tmp_path):
    nodes = local_nodes("a", "b")
    spare = {"name": "s", "address": "127.0.0.3", "connection": "local", "procs": 1}
    hosts = local_hosts(tmp_path, job="healed", nodes=nodes, spares=[spare],
                        train={"args": ["--dataset", "synthetic", "--synthetic-size", "64", "--batch-size", "8",
                                        "--epochs", "1"]})
    r = ddp(hosts, "--without", "a", "--with", "s", "launch", "--wait", "--timeout", "240")
    assert r.exit_code == 0, r.output
    shown = json.loads(ddp(hosts, "--without", "a", "--with", "s", "status", "--json").stdout)
    assert sorted(n["node"] for n in shown) == ["b", "s"], shown
    assert ddp(hosts, "--without", "a", "--with", "s", "stop").exit_code == 0


@pytest.mark.e2e
def test_status_and_stop_without_with_still_see_and_stop_the_job_on_a_spare(ddp, tmp_path):
    """An operator who leaves out --with after the launch that used it still sees the job on the
    spare, and stops it there."""
    spare = {"name": "s", "address": "127.0.0.3", "connection": "local", "procs": 1}
    hosts = local_hosts(tmp_path, job="spared", nodes=local_nodes("a", "b"), spares=[spare],
                        train={"args": ["--dataset", "synthetic", "--synthetic-size", "256", "--batch-size", "8",
                                        "--epochs", "1000"]})
    assert ddp(hosts, "--without", "a", "--with", "s", "launch").exit_code == 0
    try:
        shown = wait_until(lambda: (lambda s: s if s.get("s", {}).get("state") == "running" else None)(
            {n["node"]: n for n in json.loads(ddp(hosts, "status", "--json").stdout)}), 120, "the spare running")
        assert shown["a"]["state"] == "absent" and shown["b"]["state"] == "running"
    finally:
        stopped = ddp(hosts, "stop")
    assert stopped.exit_code == 0, stopped.output
    assert any(line.startswith("s: ") for line in stopped.stdout.splitlines()), stopped.stdout
    after = {n["node"]: n["state"] for n in json.loads(ddp(hosts, "status", "--json").stdout)}
    assert not any(state in ("running", "restarting") for state in after.values()), after
