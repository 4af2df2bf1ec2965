"""The image chain on the real cluster: three hosts with their own sshd and Docker daemon; the
operator's uplink is the bridge device (deploy/images/chain.py, deploy/programs/node_relay.py).

The tool is driven through its CLI; the assertions read the nodes' own daemons and the bridge's
byte counters. A tampered stream is made by a real man in the middle: an iptables REDIRECT in
node2's namespace sends node1's connection to a proxy that flips a byte on the way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .netcluster import _ns_path
from .operator_cli import ddp, image_id_on, ok, start_ddp
from .shaping import node_rx_bytes, operator_tx_bytes, shape_operator_uplink, unshape_operator_uplink

pytestmark = pytest.mark.cluster

IMAGE = "ddp-chain:test"
BLOB_MB = 24


def _build(cluster, ctx: Path) -> str:
    subprocess.run(["docker", "-H", cluster.operator_docker_host, "build", "-q", "-t", IMAGE, str(ctx)],
                   check=True, capture_output=True, timeout=300)
    return subprocess.run(["docker", "-H", cluster.operator_docker_host, "image", "inspect", "--format", "{{.Id}}",
                           IMAGE], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def chain_image(cluster, tmp_path_factory):
    """An image of two layers of incompressible bytes (it is shipped, never run); its ID."""
    ctx = tmp_path_factory.mktemp("chain-image")
    (ctx / "deps").write_bytes(os.urandom((BLOB_MB - 4) << 20))
    (ctx / "code").write_bytes(os.urandom(4 << 20))
    (ctx / "Dockerfile").write_text("FROM scratch\nCOPY deps /deps\nCOPY code /code\n")
    yield ctx, _build(cluster, ctx)
    subprocess.run(["docker", "-H", cluster.operator_docker_host, "image", "rm", "-f", IMAGE], capture_output=True)


@pytest.fixture
def hosts(cluster, chain_image, tmp_path):
    ctx, _ = chain_image
    _forget(cluster)
    path = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", image={
        "name": IMAGE, "dockerfile": str(ctx / "Dockerfile"), "context": str(ctx), "build_args": {},
        "transfer": "chain", "stall_seconds": 3})
    yield path
    _forget(cluster)


def _forget(cluster) -> None:
    """No node holds the test image or an earlier build of it (whose layers it would not get again)."""
    for h in cluster.hosts:
        cluster.run_on(h.name, ["docker", "image", "rm", "-f", IMAGE])
        cluster.run_on(h.name, ["docker", "image", "prune", "-f"])


def test_the_chain_gives_every_node_the_exact_image_and_the_uplink_carries_one_copy(cluster, chain_image, hosts):
    built = _build(cluster, chain_image[0])
    nodes = [h.name for h in cluster.hosts]
    dry = ok(ddp(cluster, hosts, "deploy", "--no-build", "--dry-run"))
    assert f"chain: local -> {' -> '.join(nodes)}" in dry.stdout
    before = operator_tx_bytes()
    received = {n: node_rx_bytes(cluster, n) for n in nodes}
    first = ok(ddp(cluster, hosts, "deploy", "--no-build"))
    uplink = operator_tx_bytes() - before
    for n in nodes:
        assert image_id_on(cluster, n, IMAGE) == built
        assert node_rx_bytes(cluster, n) - received[n] > BLOB_MB << 20  # each node got a whole copy...
    assert uplink < 1.3 * (BLOB_MB << 20), first.stdout  # ...while the operator sent about one (a star: three)

    cluster.run_on(nodes[1], ["docker", "image", "rm", "-f", IMAGE], check=True)
    again = ok(ddp(cluster, hosts, "deploy", "--no-build"))
    assert f"{nodes[0]}: up to date" in again.stdout and f"{nodes[2]}: up to date" in again.stdout
    assert image_id_on(cluster, nodes[1], IMAGE) == built


def test_after_a_code_only_change_the_chain_carries_only_the_new_layer(cluster, chain_image, hosts):
    ctx, _ = chain_image
    ok(ddp(cluster, hosts, "deploy", "--no-build"))
    (ctx / "code").write_bytes(os.urandom(4 << 20))
    rebuilt = _build(cluster, ctx)
    before = operator_tx_bytes()
    second = ok(ddp(cluster, hosts, "deploy", "--no-build"))
    assert operator_tx_bytes() - before < 6 << 20, second.stdout  # the 20 MB layer every node holds stays home
    for h in cluster.hosts:
        assert image_id_on(cluster, h.name, IMAGE) == rebuilt
        assert f"{h.name}: shipped 4." in second.stdout and "(1 of 2 layers were there)" in second.stdout


PROXY = r"""
import socket, struct, sys, threading
flip_at = int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1]))); srv.listen(4)
print("ready", flush=True)
def pipe(a, b, flip):
    seen = 0
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            if flip and seen <= flip_at < seen + len(data):
                data = bytearray(data); data[flip_at - seen] ^= 0x01; data = bytes(data)
            seen += len(data)
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try: s.shutdown(socket.SHUT_RDWR)
        except OSError: pass
while True:
    c, _ = srv.accept()
    port, ip = struct.unpack_from("!2xH4s", c.getsockopt(socket.SOL_IP, 80, 16))  # SO_ORIGINAL_DST
    u = socket.create_connection((socket.inet_ntoa(ip), port))
    threading.Thread(target=pipe, args=(c, u, True), daemon=True).start()
    threading.Thread(target=pipe, args=(u, c, False), daemon=True).start()
"""


def test_a_stream_tampered_between_two_nodes_is_refused_there_and_the_rest_finish(cluster, chain_image, hosts):
    built = _build(cluster, chain_image[0])
    first, middle, last = (h.name for h in cluster.hosts)
    ns = ["nsenter", f"--net={_ns_path(cluster.host(middle).ns)}"]
    rule = ["PREROUTING", "-p", "tcp", "-s", cluster.host(first).address, "-d", cluster.host(middle).address,
            "!", "--dport", "22", "-j", "REDIRECT", "--to-ports", "7999"]
    proxy = subprocess.Popen([*ns, sys.executable, "-c", PROXY, "7999", str(5 << 20)], stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout.readline().strip() == "ready"
        subprocess.run([*ns, "iptables", "-t", "nat", "-A", *rule], check=True)
        try:
            r = ddp(cluster, hosts, "deploy", "--no-build")
        finally:
            subprocess.run([*ns, "iptables", "-t", "nat", "-D", *rule], check=True)
    finally:
        proxy.kill()
        proxy.wait()
    assert r.returncode == 1, r.stdout + r.stderr
    assert (f"{middle}: image chain: chunk 1 (bytes 4194304-8388608) from {first} does not match the digest"
            in r.stderr), r.stderr
    assert image_id_on(cluster, middle, IMAGE) is None  # nothing of the tampered stream became an image
    assert image_id_on(cluster, first, IMAGE) == built and image_id_on(cluster, last, IMAGE) == built
    ok(ddp(cluster, hosts, "deploy", "--no-build"))  # a later deploy finishes it
    assert image_id_on(cluster, middle, IMAGE) == built


def test_a_middle_node_whose_link_goes_down_is_passed_over_and_named(cluster, chain_image, hosts):
    built = _build(cluster, chain_image[0])
    first, middle, last = (h.name for h in cluster.hosts)
    shape_operator_uplink(20)  # a slow uplink, so that the link goes down mid-stream
    try:
        start = node_rx_bytes(cluster, middle)
        proc = start_ddp(cluster, hosts, "deploy", "--no-build")
        deadline = time.monotonic() + 60
        while node_rx_bytes(cluster, middle) - start < 4 << 20:
            assert proc.poll() is None and time.monotonic() < deadline, "the middle node got nothing"
            time.sleep(0.05)
        cluster.take_link_down(middle)
        down_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - down_at
    finally:
        cluster.bring_link_up(middle)
        unshape_operator_uplink()
    assert proc.returncode == 1, out + err
    assert f"{middle}: image chain: " in err and "the others have the verified image" in err
    assert image_id_on(cluster, first, IMAGE) == built and image_id_on(cluster, last, IMAGE) == built
    assert took < 60  # bounded: the stall limit, then the operator's own silence limit
    ok(ddp(cluster, hosts, "deploy", "--no-build"))
    assert image_id_on(cluster, middle, IMAGE) == built


def test_a_chain_across_both_image_stores_leaves_the_exact_image_on_each(cluster, chain_image, hosts, containerd_node):
    """node1 and node2 on Docker's classic store, node9 between them on the containerd store:
    one stream that both load; each daemon then names exactly the image (node9 by a manifest
    whose config is the image, read with containerd's own client)."""
    import json

    import yaml

    built = _build(cluster, chain_image[0])
    node9 = containerd_node
    config = yaml.safe_load(hosts.read_text())
    config["nodes"] = [config["nodes"][0], node9.inventory_node(), config["nodes"][1]]
    hosts.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        dry = ok(ddp(cluster, hosts, "deploy", "--no-build", "--dry-run"))
        assert f"chain: local -> node1 -> {node9.name} -> node2" in dry.stdout
        out = ok(ddp(cluster, hosts, "deploy", "--no-build")).stdout
        assert image_id_on(cluster, "node1", IMAGE) == built and image_id_on(cluster, "node2", IMAGE) == built
        line = next(x for x in out.splitlines() if x.startswith(f"{node9.name}: "))
        assert "shipped" in line and "containerd image store" in line, out
        manifest = node9.docker("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
        got = node9.ctr("content", "get", manifest)
        assert got.returncode == 0 and json.loads(got.stdout)["config"]["digest"] == built, got.stderr
        again = ok(ddp(cluster, hosts, "deploy", "--no-build")).stdout
        assert all(f"{n}: up to date" in again for n in ("node1", node9.name, "node2")), again
    finally:
        node9.reset()
