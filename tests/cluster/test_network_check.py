"""`ddp-deploy check --network` on the real cluster, its links shaped with tc to known rates.

Every node's link is shaped (both directions) to FAST, node3's to a tenth of it. The check runs
through the CLI with the docker runtime (the job's image, gloo on the nodes' eth0); each figure
it reports must be the shaped rate, at most 25 % above it (tc caps the link) and at most 40 % below
(the measurement's own CPU: on 2 cores loaded by the rest of the suite, a 200 Mbit/s link can
read 150), and node3 alone must be named as slow.
"""

from __future__ import annotations

import re

import pytest

from .operator_cli import ddp, ok

pytestmark = pytest.mark.cluster

FAST_MBIT, SLOW_MBIT = 200, 20


def _mbit(figure: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+) (Mbit|Gbit)/s", figure).groups()
    return float(value) * (1000 if unit == "Gbit" else 1)


def test_network_check_reports_each_node_s_shaped_rate_and_names_the_slow_one(cluster, fresh_nas, tmp_path,
                                                                             record_fault):
    hosts = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="docker", procs=2, interface="eth0",
                                     storage={"min_free_gb": 0})
    ok(ddp(cluster, hosts, "deploy", timeout=600))
    for h in cluster.hosts:
        cluster.shape_link(h.name, SLOW_MBIT if h.name == "node3" else FAST_MBIT)
    try:
        r = ddp(cluster, hosts, "check", "--network", "--network-mb", "4", timeout=600)
    finally:
        for h in cluster.hosts:
            cluster.unshape_link(h.name)
    assert r.returncode == 1, r.stdout + r.stderr
    first = r.stderr.strip().splitlines()[0]
    assert first.startswith("error: network: node3 much slower than the other nodes"), first
    rows = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if cells and re.fullmatch(r"node\d", cells[0]) and len(cells) >= 4:
            rows[cells[0]] = cells
    assert set(rows) == {h.name for h in cluster.hosts}, r.stdout
    for name, cells in rows.items():
        interface, transport, figure = cells[1], cells[2], _mbit(cells[3])
        shaped = SLOW_MBIT if name == "node3" else FAST_MBIT
        assert interface == "eth0" and transport == "tcp"
        assert 0.6 * shaped <= figure <= 1.25 * shaped, f"{name}: {figure} Mbit/s reported, shaped {shaped}"
    figures = ", ".join(f"{n} {c[3]}" for n, c in sorted(rows.items()))
    record_fault(fault="network check on links shaped with tc (node3 at 1/10)",
                 finished=f"node3 named as slow; reported {figures} (shaped {FAST_MBIT}, {FAST_MBIT}, {SLOW_MBIT})",
                 redone_steps=None, ckpt_every=None, detect_s=None, detect_what=None,
                 left_running="nothing", bit_identical=None)
