"""Links of the test cluster shaped with tc, and what crossed them, for the image bench and tests.

Where the traffic goes (see netcluster.py for the layout):

- **The operator's uplink.** The operator is the root namespace: what it sends to the nodes
  leaves through the bridge device ``ddpbr0`` itself and is then switched to the nodes' veths.
  A token bucket on the bridge device is therefore one uplink shared by every node the operator
  sends to, and the bridge device's ``tx_bytes`` counts the bytes that crossed it (nothing that
  nodes send each other passes the bridge device: the bridge switches it port to port).
- **A node's link.** Its veth pair: a token bucket on ``eth0`` inside the node (what it sends)
  and on the veth's bridge end (what it receives), so a node-to-node transfer is held to the
  node rate at both ends. The veth's bridge end counts in ``tx_bytes`` what the node received.

``link_down``/``link_up`` take a node off the bridge and put it back, keeping its shaping (unlike
``NetCluster.bring_link_up``, which also removes it). ``measure_mbit`` times a plain socket
transfer between two ends, to check that the configured rates hold before measuring anything.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

from .netcluster import BRIDGE, NODE_INTERFACE, ClusterError, NetCluster

OPERATOR = "operator"
"""The name ``measure_mbit`` gives the root namespace's end."""

LATENCY_MS = 50


def tbf(rate_mbit: float) -> list[str]:
    """A token bucket of ``rate_mbit``: the bucket holds 4 ms of the rate (at least 64 KiB) so
    that timer granularity does not cap fast links below their rate."""
    if not rate_mbit > 0:
        raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))
    return ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{LATENCY_MS}ms"]


def _tc(argv: Sequence[str], *, allow_missing: bool = False) -> str:
    r = subprocess.run(["tc", *argv], capture_output=True, text=True)
    if r.returncode != 0:
        if allow_missing and ("Cannot delete qdisc with handle of zero" in r.stderr
                              or "No such file or directory" in r.stderr):
            return ""
        raise ClusterError(f"tc {' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def shape_link(ns: str, veth: str, rate_mbit: float) -> None:
    """Hold what the host in namespace ``ns`` (on the bridge through ``veth``) sends and what it
    receives to ``rate_mbit`` each."""
    _tc(["-n", ns, "qdisc", "replace", "dev", NODE_INTERFACE, *tbf(rate_mbit)])
    _tc(["qdisc", "replace", "dev", veth, *tbf(rate_mbit)])


def unshape_link(ns: str, veth: str) -> None:
    _tc(["-n", ns, "qdisc", "del", "dev", NODE_INTERFACE, "root"], allow_missing=True)
    _tc(["qdisc", "del", "dev", veth, "root"], allow_missing=True)


def shape_operator_uplink(rate_mbit: float, bridge: str = BRIDGE) -> None:
    """Hold everything the operator sends to the nodes, together, to ``rate_mbit``."""
    _tc(["qdisc", "replace", "dev", bridge, *tbf(rate_mbit)])


def unshape_operator_uplink(bridge: str = BRIDGE) -> None:
    _tc(["qdisc", "del", "dev", bridge, "root"], allow_missing=True)


def shape_node_link(cluster: NetCluster, name: str, rate_mbit: float) -> None:
    """Hold what node ``name`` sends and what it receives to ``rate_mbit`` each."""
    h = cluster.host(name)
    shape_link(h.ns, h.veth, rate_mbit)


def unshape_node_link(cluster: NetCluster, name: str) -> None:
    h = cluster.host(name)
    unshape_link(h.ns, h.veth)


def qdiscs(cluster: NetCluster) -> dict[str, str]:
    """``tc qdisc show`` of every shaped device, by a name saying which end it is."""
    shown = {f"operator ({cluster.bridge})": _tc(["qdisc", "show", "dev", cluster.bridge])}
    for h in cluster.hosts:
        shown[f"{h.name} sends ({NODE_INTERFACE})"] = _tc(["-n", h.ns, "qdisc", "show", "dev", NODE_INTERFACE])
        shown[f"{h.name} receives ({h.veth})"] = _tc(["qdisc", "show", "dev", h.veth])
    return {k: v.strip() for k, v in shown.items()}


@contextlib.contextmanager
def shaped(cluster: NetCluster, operator_mbit: float, node_mbit: float,
           others: Sequence[tuple[str, str]] = ()) -> Iterator[None]:
    """The operator's uplink at ``operator_mbit`` and every node's link at ``node_mbit`` for the
    duration of the block, and so the links of ``others`` ((namespace, veth) of more hosts on the
    bridge, e.g. a registry); plain links again afterwards."""
    links = [(h.ns, h.veth) for h in cluster.hosts] + list(others)
    try:
        shape_operator_uplink(operator_mbit, cluster.bridge)
        for ns, veth in links:
            shape_link(ns, veth, node_mbit)
        yield
    finally:
        unshape_operator_uplink(cluster.bridge)
        for ns, veth in links:
            unshape_link(ns, veth)


def _counter(device: str, which: str) -> int:
    return int(Path(f"/sys/class/net/{device}/statistics/{which}").read_text())


def operator_tx_bytes(bridge: str = BRIDGE) -> int:
    """Bytes the operator has sent to the nodes through its uplink (the bridge device)."""
    return _counter(bridge, "tx_bytes")


def node_rx_bytes(cluster: NetCluster, name: str) -> int:
    """Bytes node ``name`` has received from the bridge (from the operator and other nodes)."""
    return _counter(cluster.host(name).veth, "tx_bytes")


def link_down(cluster: NetCluster, name: str) -> None:
    """Cut node ``name`` off the bridge, like a pulled cable; its shaping stays."""
    subprocess.run(["ip", "link", "set", cluster.host(name).veth, "down"], check=True)


def link_up(cluster: NetCluster, name: str) -> None:
    """Put node ``name`` back on the bridge with the shaping it had."""
    subprocess.run(["ip", "link", "set", cluster.host(name).veth, "up"], check=True)


# --------------------------------------------------------------------------- checking the rates

_RECEIVER = """
import socket, sys, time
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
got, first = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if first is None:
        first = time.perf_counter()
    got += len(b)
print(got, time.perf_counter() - (first or time.perf_counter()), flush=True)
"""

_SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
left, block = int(sys.argv[3]), bytes(1 << 20)
while left > 0:
    left -= s.send(block[:left])
s.shutdown(socket.SHUT_WR)
s.recv(1)
"""


def _address(cluster: NetCluster, end: str) -> str:
    return cluster.operator_address if end == OPERATOR else cluster.host(end).address


def _in(cluster: NetCluster, end: str, argv: list[str]) -> list[str]:
    return argv if end == OPERATOR else ["nsenter", f"--net=/var/run/netns/{cluster.host(end).ns}", *argv]


def measure_mbit(cluster: NetCluster, src: str, dst: str, nbytes: int, timeout: float = 60) -> float:
    """Mbit/s of one TCP transfer of ``nbytes`` from ``src`` to ``dst`` (a node name or
    ``OPERATOR``), timed by the receiver from its first byte to the end of the stream."""
    receiver = subprocess.Popen(_in(cluster, dst, [sys.executable, "-c", _RECEIVER, _address(cluster, dst)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        if not port:
            raise ClusterError(f"the receiver on {dst} did not start: {receiver.stderr.read().strip()}")
        sender = subprocess.run(
            _in(cluster, src, [sys.executable, "-c", _SENDER, _address(cluster, dst), port, str(nbytes)]),
            capture_output=True, text=True, timeout=timeout)
        if sender.returncode != 0:
            raise ClusterError(f"sending {src} -> {dst} failed: {sender.stderr.strip()[-500:]}")
        out, err = receiver.communicate(timeout=timeout)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    got, seconds = out.split()
    if int(got) != nbytes:
        raise ClusterError(f"{dst} received {got} of the {nbytes} bytes {src} sent")
    return nbytes * 8 / 1e6 / max(float(seconds), 1e-9)

