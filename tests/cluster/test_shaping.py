"""The tc shaping helpers the image bench relies on (shaping.py): the configured rates hold, the
operator's byte counter counts what the operator sends and nothing the nodes send each other, and
a node taken off the bridge comes back with its shaping. A behaviour test of the helpers, with
tolerant bounds: unshaped, these links run several times faster than the rates below."""

from __future__ import annotations

import socket

import pytest

from . import shaping

pytestmark = pytest.mark.cluster

OPERATOR_MBIT = 200
NODE_MBIT = 1000
SECONDS = 1.5  # per transfer, at the shaped rate


def _nbytes(mbit: float) -> int:
    return int(mbit * 1e6 / 8 * SECONDS)


def test_shaped_links_hold_their_rates_and_the_operator_counts_only_its_uplink(cluster):
    """Shaped links hold their rates, and the operator counter counts only its uplink."""
    with shaping.shaped(cluster, OPERATOR_MBIT, NODE_MBIT):
        before = shaping.operator_tx_bytes()
        uplink = shaping.measure_mbit(cluster, shaping.OPERATOR, "node1", _nbytes(OPERATOR_MBIT))
        sent_by_operator = shaping.operator_tx_bytes() - before
        before = shaping.operator_tx_bytes()
        across = shaping.measure_mbit(cluster, "node1", "node2", _nbytes(NODE_MBIT))
        sent_between_nodes = shaping.operator_tx_bytes() - before
    assert 0.7 * OPERATOR_MBIT <= uplink <= 1.15 * OPERATOR_MBIT
    assert 0.6 * NODE_MBIT <= across <= 1.15 * NODE_MBIT
    assert _nbytes(OPERATOR_MBIT) <= sent_by_operator <= 1.1 * _nbytes(OPERATOR_MBIT)
    assert sent_between_nodes < 0.01 * _nbytes(NODE_MBIT)  # node-to-node traffic bypasses the uplink
    assert all("tbf" not in shown for shown in shaping.qdiscs(cluster).values())  # plain links again


def test_a_node_taken_off_the_bridge_is_unreachable_and_comes_back_shaped(cluster):
    node = cluster.hosts[-1]
    shaping.shape_node_link(cluster, node.name, NODE_MBIT)
    try:
        shaping.link_down(cluster, node.name)
        try:
            with pytest.raises(OSError):
                socket.create_connection((node.address, 22), timeout=1).close()
        finally:
            shaping.link_up(cluster, node.name)
        socket.create_connection((node.address, 22), timeout=5).close()
        shown = shaping.qdiscs(cluster)
        assert "tbf" in shown[f"{node.name} sends (eth0)"] and "tbf" in shown[f"{node.name} receives ({node.veth})"]
    finally:
        shaping.unshape_node_link(cluster, node.name)
