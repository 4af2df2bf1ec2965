"""The image chain with real relays (deploy/programs/node_relay.py run by local nodes' python3, real
sockets between them, real spool files); only ``docker load`` is replaced, by a command that keeps
what it was fed, so the bytes each node would load can be compared. The chain with real Docker
daemons on real hosts is tests/cluster/test_image_chain.py."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from deploy.images import chain, image, oci
from deploy.nodes.remote import Remote
from local_job import local_nodes, on_paper



def _inv(tmp_path: Path, names=("a", "b", "c", "d")):
    return on_paper(local_nodes(*names), job="chain", nas=tmp_path, image={"stall_seconds": 2}, base_dir=tmp_path)


def _saved(tmp_path: Path, layer_mb: int = 24) -> image.SavedImage:
    """A docker-save-shaped tar: one layer of incompressible bytes, its config and manifest."""
    layer = os.urandom(layer_mb << 20)
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}})
    cfg_name = hashlib.sha256(config.encode()).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cfg_name, "RepoTags": ["t:1"], "Layers": ["l1/layer.tar"]}])
    path = tmp_path / "saved.tar"
    with tarfile.open(path, "w") as tf:
        for name, data in (("l1/layer.tar", layer), (cfg_name, config.encode()), ("manifest.json", manifest.encode())):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return image.index_saved(path)


def _whole(saved: image.SavedImage) -> oci.Layout:
    """docker save's tar as it is (what a row of classic-store nodes that need every layer gets)."""
    return oci.Layout(saved.path, ((0, saved.size),))


class Throttled(oci.Layout):
    """A slower uplink than loopback, so that a test can act while the stream is on its way."""

    def pieces(self, offset, piece=chain.PIECE):
        for item in super().pieces(offset, piece):
            time.sleep(0.05)
            yield item


def _keeper(out: Path) -> list[str]:
    """The load command: keep the stream in a file of its own, print its sha256 as the ID."""
    return ["sh", "-c", f'f=$(mktemp -p {out}) && cat > "$f" && echo "ID $(sha256sum < "$f" | cut -d" " -f1)"']


def _run(tmp_path, inv, stream, report=lambda *a: None):
    out = tmp_path / "loaded"
    out.mkdir(exist_ok=True)
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    with Remote(inv) as remote:
        run = chain._Run(inv, remote, stream, [n.name for n in inv.nodes], report,
                         chain.relay_argv(_keeper(out), str(spool)))
        run.go()
    return run


def _sha(stream: oci.Layout) -> str:
    h = hashlib.sha256()
    for _, data in stream.pieces(0):
        h.update(data)
    return h.hexdigest()


def test_every_node_loads_the_exact_stream_and_this_machine_sends_it_once(tmp_path):
    inv = _inv(tmp_path)
    stream = _whole(_saved(tmp_path))
    stages: dict[str, set] = {}
    run = _run(tmp_path, inv, stream, lambda n, stage, done, total: stages.setdefault(n, set()).add(stage))
    assert [(link.name, link.failure, link.load_exit) for link in run.links] == [(n, None, 0) for n in "abcd"]
    assert {link.out[-1] for link in run.links} == {f"ID {_sha(stream)}"}
    assert run.sent_bytes == stream.size  # one copy over the uplink, for four nodes
    assert "forwarding" in stages["a"] or "receiving" in stages["a"]
    assert not list((tmp_path / "spool").iterdir())  # no spool file left behind


def test_a_stream_without_held_layers_is_a_valid_tar_and_resumes_mid_piece(tmp_path):
    """A stream without the layers every node holds is a valid tar, and resumes mid-piece."""
    saved = _saved(tmp_path, 2)
    stream = oci.layout(saved, 1, "t:1")
    data = b"".join(d for _, d in stream.pieces(0))
    assert len(data) == stream.size < 1 << 20  # the 2 MB layer stays home
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert {"manifest.json", "index.json"} <= set(tf.getnames())
    assert b"".join(d for _, d in stream.pieces(5000)) == data[5000:]


def test_a_node_killed_mid_chain_is_named_and_the_nodes_after_it_get_everything(tmp_path):
    """A node killed mid-chain is named, and the nodes after it still get everything."""
    inv = _inv(tmp_path)
    saved = _saved(tmp_path, 32)
    stream = Throttled(saved.path, ((0, saved.size),))
    killed = threading.Event()
    runs = []

    def report(node, stage, done, total):
        if node == "b" and 8 << 20 <= done < total and not killed.is_set() and runs:
            killed.set()
            runs[0].by_name["b"].session.p.kill()

    out = tmp_path / "loaded"
    out.mkdir()
    (tmp_path / "spool").mkdir()
    with Remote(inv) as remote:
        run = chain._Run(inv, remote, stream, ["a", "b", "c", "d"], report,
                         chain.relay_argv(_keeper(out), str(tmp_path / "spool")))
        runs.append(run)
        run.go()
    assert killed.is_set()
    by = run.by_name
    assert by["b"].failure
    for n in "acd":
        assert (by[n].failure, by[n].load_exit, by[n].out[-1:]) == (None, 0, [f"ID {_sha(stream)}"]), (n, by[n])
    assert run.sent_bytes < 1.3 * stream.size


def test_the_first_node_killed_is_replaced_by_this_machine_feeding_the_next(tmp_path):
    inv = _inv(tmp_path, ("a", "b", "c"))
    saved = _saved(tmp_path, 32)
    stream = Throttled(saved.path, ((0, saved.size),))
    runs, killed = [], threading.Event()

    def report(node, stage, done, total):
        if node == "a" and 8 << 20 <= done < total and not killed.is_set() and runs:
            killed.set()
            runs[0].by_name["a"].session.p.kill()

    (tmp_path / "loaded").mkdir()
    (tmp_path / "spool").mkdir()
    with Remote(inv) as remote:
        run = chain._Run(inv, remote, stream, ["a", "b", "c"], report,
                         chain.relay_argv(_keeper(tmp_path / "loaded"), str(tmp_path / "spool")))
        runs.append(run)
        run.go()
    assert killed.is_set() and run.by_name["a"].failure
    for n in "bc":
        assert (run.by_name[n].failure, run.by_name[n].out[-1]) == (None, f"ID {_sha(stream)}")


# ---------------------------------------------------------------------- one relay, by hand


SECRET, TRANSFER, STALL = "s" * 64, "t" * 32, 2


class Relay:
    """One relay process, this test acting as the operator on its stdin (``plan=False``: not yet)."""

    def __init__(self, tmp_path: Path, stream: oci.Layout, secret: str = SECRET, *, index: int = 1,
                 name: str = "b", downstream=(), plan: bool = True, stall: float = STALL,
                 preexec_fn=None) -> None:
        (tmp_path / "spool").mkdir(exist_ok=True)
        (tmp_path / "loaded").mkdir(exist_ok=True)
        self.p = subprocess.Popen([sys.executable, *chain.relay_argv(_keeper(tmp_path / "loaded"),
                                                                     str(tmp_path / "spool"))[1:]],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  preexec_fn=preexec_fn)
        self.port = int(self.p.stdout.readline().split()[1])
        self.plan = {"secret": secret, "transfer": TRANSFER, "size": stream.size, "chunk": chain.CHUNK,
                     "digests": chain.digests(stream), "index": index, "name": name, "stall": stall,
                     "downstream": [list(d) for d in downstream]}
        if plan:
            self.send_plan()

    def send_plan(self) -> None:
        self.p.stdin.write(b"PLAN " + json.dumps(self.plan).encode() + b"\n")
        self.p.stdin.flush()

    def stop(self) -> tuple[int, list[str]]:
        self.p.stdin.write(b"STOP test over\n")
        self.p.stdin.flush()
        return self.end()

    def end(self) -> tuple[int, list[str]]:
        """Its lines until it exits by itself (stdin stays open: its end would be an abort)."""
        lines = [line.decode().rstrip("\n") for line in iter(self.p.stdout.readline, b"")]
        self.p.stdin.close()
        return self.p.wait(60), lines


def chain_mac(secret: str, role: str, *fields, transfer: str = TRANSFER) -> str:
    """The protocol's proof, written out here from its description (node_relay.py's docstring)."""
    message = "\n".join([role, transfer, *(str(f) for f in fields)])
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def _connect_as_sender(port: int, secret: str, *, name: str = "a", index: int = 0, to: int = 1,
                       receiver: int | None = None, claim: int | None = None,
                       transfer: str = TRANSFER) -> tuple[socket.socket, str]:
    """The handshake as node ``index`` of the row sending to the one it takes for node ``to``
    (``receiver``: the receiver's real index; ``claim``: the index the sender names, if not its
    own); the receiver's first line after the sender's proof ("" if it closed)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    f = s.makefile("rb")
    mine = os.urandom(16).hex()
    s.sendall(f"CHAIN {mine}\n".encode())
    theirs, proof = f.readline().decode().split()
    if secret == SECRET:  # the receiver proves itself first, for its own place in the row
        assert proof == chain_mac(secret, "down", to if receiver is None else receiver, mine, theirs)
    s.sendall(f"{name} {index if claim is None else claim} "
              f"{chain_mac(secret, 'up', index, to, name, mine, theirs, transfer=transfer)}\n".encode())
    return s, f.readline().decode().strip()


def test_a_tampered_stream_is_refused_before_it_is_loaded_and_the_chunk_is_named(tmp_path):
    stream = _whole(_saved(tmp_path, 6))
    relay = Relay(tmp_path, stream)
    sock, answer = _connect_as_sender(relay.port, SECRET)
    assert answer == "AT 0"
    data = bytearray(b"".join(d for _, d in stream.pieces(0)))
    data[chain.CHUNK + 10] ^= 0xFF  # one bit pattern flipped in the second chunk
    try:
        sock.sendall(bytes(data))
    except OSError:
        pass
    code, lines = relay.end()
    assert code == 3
    assert any(line.startswith("REFUSED chunk 1 ") and "from a does not match" in line for line in lines), lines
    loaded = [p.read_bytes() for p in (tmp_path / "loaded").iterdir()]
    assert all(len(b) <= chain.CHUNK for b in loaded)  # only the verified first chunk reached the load


def test_a_sender_without_the_transfer_secret_is_turned_away(tmp_path):
    stream = _whole(_saved(tmp_path, 1))
    relay = Relay(tmp_path, stream)
    sock, answer = _connect_as_sender(relay.port, "wrong" * 10)
    assert answer == ""  # closed without a word
    code, lines = relay.stop()
    assert code == 3 and lines[-1] == "REFUSED test over"


def test_a_truncated_stream_is_never_loaded(tmp_path):
    stream = _whole(_saved(tmp_path, 6))
    relay = Relay(tmp_path, stream)
    data = b"".join(d for _, d in stream.pieces(0))
    relay.p.stdin.write(b"DATA 0 %d\n" % (len(data) // 2) + data[:len(data) // 2])
    relay.p.stdin.close()  # the operator's connection ends with half the stream sent
    code, lines = relay.p.wait(60), relay.p.stdout.read().decode().splitlines()
    assert code == 3 and lines[-1] == "REFUSED the operator's connection ended"
    assert not any(line.startswith("EXIT") for line in lines)


@pytest.mark.parametrize("names", [("a",)])
def test_a_single_node_chain_is_a_plain_transfer(tmp_path, names):
    inv = _inv(tmp_path, names)
    stream = _whole(_saved(tmp_path, 2))
    run = _run(tmp_path, inv, stream)
    assert run.links[0].out[-1] == f"ID {_sha(stream)}" and run.sent_bytes == stream.size


def test_a_node_that_cannot_be_reached_on_its_port_is_named_with_what_to_do(tmp_path):
    inv = _inv(tmp_path, ("a", "b", "c"))
    stream = _whole(_saved(tmp_path, 1))
    (tmp_path / "loaded").mkdir()
    (tmp_path / "spool").mkdir()
    with Remote(inv) as remote:
        run = chain._Run(inv, remote, stream, ["a", "b", "c"], lambda *a: None,
                         chain.relay_argv(_keeper(tmp_path / "loaded"), str(tmp_path / "spool")))
        start = run._start

        def start_then_close_b(link):  # b's port refuses connections, as behind a firewall
            start(link)
            if link.name == "b":
                link.port = _closed_port()

        run._start = start_then_close_b
        run.go()
    assert "cannot connect to 127.0.0.2:" in run.by_name["b"].failure
    assert "else use image.transfer: star" in run.by_name["b"].failure
    c = run.by_name["c"]  # what c said, should it fail (an IndexError once under full load)
    assert c.failure is None and c.out[-1:] == [f"ID {_sha(stream)}"], (c.failure, c.out, c.err, c.load_exit)


def test_a_late_word_from_a_passed_over_node_or_about_a_complete_one_fails_nothing(tmp_path):
    """The race of the test above under full load: b, passed over by a, tried c only after c had
    the whole stream from a and its relay had ended, and its LOST of c failed c. Each of the two
    facts alone makes the word moot; a sender that is one, of a node that lacks bytes, still passes
    it over."""
    inv = _inv(tmp_path, ("a", "b", "c"))
    stream = _whole(_saved(tmp_path, 1))
    run = chain._Run(inv, None, stream, ["a", "b", "c"], lambda *a: None, ())
    _, b, c = run.links
    refused = "cannot connect to 127.0.0.3:42869 ([Errno 111] Connection refused)"
    b.failure = "passed over by a: cannot connect to 127.0.0.2:40000 ([Errno 111] Connection refused)"
    run._hear(b, f"LOST c {refused}")
    assert c.failure is None
    b.failure, c.received = None, stream.size
    run._hear(b, f"LOST c {refused}")
    assert c.failure is None
    c.received = stream.size - 1
    run._hear(b, f"LOST c {refused}")
    assert c.failure == f"passed over by b: {refused}"


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _saved_with_a_linked_layer(tmp_path: Path) -> image.SavedImage:
    """What docker save writes for an image with two identical layers (empty ones, say): the
    second layer's file is a symlink to the first's."""
    layer = os.urandom(1 << 20)
    diff = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": [diff, diff]}}).encode()
    cfg_name = hashlib.sha256(config).hexdigest() + ".json"
    path = tmp_path / "linked.tar"
    with tarfile.open(path, "w") as tf:
        for name, data in (("l1/layer.tar", layer), (cfg_name, config)):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        link = tarfile.TarInfo("l2/layer.tar")
        link.type, link.linkname = tarfile.SYMTYPE, "../l1/layer.tar"
        tf.addfile(link)
        manifest = json.dumps([{"Config": cfg_name, "RepoTags": ["t:1"], "Layers": ["l1/layer.tar", "l2/layer.tar"]}])
        ti = tarfile.TarInfo("manifest.json")
        ti.size = len(manifest)
        tf.addfile(ti, io.BytesIO(manifest.encode()))
    return image.index_saved(path)


def test_an_image_whose_saved_tar_links_a_repeated_layer_is_indexed_and_laid_out(tmp_path):
    saved = _saved_with_a_linked_layer(tmp_path)
    files = {name: (offset, size) for name, offset, size in saved.files}
    assert files["l2/layer.tar"] == files["l1/layer.tar"]  # the link reads as its target's data
    stream = oci.layout(saved, 0, "t:1")
    data = b"".join(d for _, d in stream.pieces(0))
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        blobs = [n for n in tf.getnames() if n.startswith("blobs/") and tf.getmember(n).size == 1 << 20]
        manifest = json.load(tf.extractfile("manifest.json"))
    assert len(blobs) == 1 and len(manifest[0]["Layers"]) == 2  # one blob, named twice
    assert oci.identity(saved).config == saved.image_id
