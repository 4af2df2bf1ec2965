"""The image chain's relays under hostile or broken peers (deploy/programs/node_relay.py, deploy/images/chain.py):
real relays as local processes, real sockets and spool files; only ``docker load`` is replaced
(tests/test_deploy_chain.py's keeper). Where a fault cannot be made from outside (a forwarder that
fails or sticks mid-stream), the relay program sent to the nodes carries a few injected lines that
break its socket to one port."""

from __future__ import annotations

import errno
import os
import re
import resource
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from test_deploy_chain import (SECRET, STALL, Relay, _closed_port, _connect_as_sender, _inv, _keeper, _saved, _sha,
                               _whole)

from deploy.images import chain
from deploy.programs import node_relay
from deploy.nodes.remote import Remote

MARGIN = 1.5
"""Seconds past a relay's bound that a test allows for a loaded machine."""


def _go_within(run: chain._Run, seconds: float) -> None:
    """``run.go()``, which must return within ``seconds``; else the run is aborted and the test fails."""
    done = threading.Event()
    errors: list[BaseException] = []

    def go():
        try:
            run.go()
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=go, daemon=True).start()
    if not done.wait(seconds):
        run.abort()
        done.wait(30)
        pytest.fail(f"the chain did not end within {seconds:g} s: " +
                    ", ".join(f"{link.name}: {link.failure}" for link in run.links))
    if errors:
        raise errors[0]


def _chain(tmp_path: Path, names, argv=None, on_start=lambda link: None):
    """A ``_Run`` over local nodes; ``on_start(link)`` runs once a node's relay listens, before any
    plan; ``run.said`` keeps every line but the AT ones that a relay said, as (node, line)."""
    inv = _inv(tmp_path, names)
    (tmp_path / "loaded").mkdir(exist_ok=True)
    (tmp_path / "spool").mkdir(exist_ok=True)
    remote = Remote(inv)
    saved = _saved(tmp_path, 12)
    stream = _whole(saved)
    run = chain._Run(inv, remote, stream, list(names), lambda *a: None,
                     argv or chain.relay_argv(_keeper(tmp_path / "loaded"), str(tmp_path / "spool")))
    start = run._start

    def started(link):
        start(link)
        on_start(link)

    run._start = started
    run.said = []
    hear = run._hear

    def heard(link, line):
        if not line.startswith("AT "):
            run.said.append((link.name, line))
        hear(link, line)

    run._hear = heard
    return run, remote, stream


def _loaded_everywhere_but(run: chain._Run, stream, failed: set[str]) -> None:
    for link in run.links:
        if link.name in failed:
            assert link.failure, link.name
        else:
            assert (link.failure, link.load_exit, link.out[-1:]) == (None, 0, [f"ID {_sha(stream)}"]), link.name


def _until_closed(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer ends the connection (reads whatever it sends), or None after ``seconds``."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            sock.settimeout(max(seconds - (time.monotonic() - start), 0.01))
    except socket.timeout:
        return None
    except OSError:
        pass
    return time.monotonic() - start


def _read_for(sock: socket.socket, seconds: float) -> bytes:
    """What the peer sends within ``seconds`` or until it closes."""
    data, deadline = b"", time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            got = sock.recv(4096)
            if not got:
                break
            data += got
    except OSError:
        pass
    return data


# ---------------------------------------------------------------------- hostile senders


def _hostile(kind: str, port: int, address: str = "127.0.0.1") -> socket.socket:
    """A connection that is not a sender of this transfer, doing ``kind`` (what follows is its own)."""
    s = socket.create_connection((address, port), timeout=5)
    try:
        if kind == "garbage":
            s.sendall(bytes(range(256)) * 3)
        elif kind == "non-ASCII hello":
            s.sendall(("CHAIN " + "é" * 16 + "\n").encode())
        elif kind == "non-ASCII proof":  # a whole line of the right shape, its proof not ASCII
            s.sendall(("a " + "n" * 32 + " 0 " + "é" * 64 + "\n").encode())
        elif kind == "too long":
            s.sendall(b"CHAIN " + b"0" * 100_000)
        elif kind == "slow":  # a valid start, then a byte every quarter second: never a whole line
            def drip():
                try:
                    s.sendall(b"CHAIN ")
                    for _ in range(200):
                        s.sendall(b"0")
                        time.sleep(0.25)
                except OSError:
                    return
            threading.Thread(target=drip, daemon=True).start()
    except OSError:
        pass  # the relay may already have ended it
    return s


HOSTILE = ("silent", "garbage", "non-ASCII hello", "non-ASCII proof", "too long", "slow")


def test_malformed_silent_and_slow_handshakes_end_only_their_own_connection_in_time(tmp_path):
    """Malformed, silent and slow handshakes end only their own connection, within the stall."""
    stream = _whole(_saved(tmp_path, 6))
    relay = Relay(tmp_path, stream)
    took: dict[str, float | None] = {}

    def one(kind):
        took[kind] = _until_closed(_hostile(kind, relay.port), STALL + 8)

    peers = [threading.Thread(target=one, args=(kind,)) for kind in HOSTILE]
    for t in peers:
        t.start()
    for t in peers:
        t.join()
    assert {k: v is not None and v < STALL + MARGIN for k, v in took.items()} == {k: True for k in HOSTILE}, took
    sock, answer = _connect_as_sender(relay.port, SECRET)  # the real sender, after all of them
    assert answer == "AT 0"
    sock.sendall(b"".join(d for _, d in stream.pieces(0)))
    code, lines = relay.end()
    assert (code, lines[-1], f"OUT ID {_sha(stream)}" in lines) == (0, "EXIT 0", True), lines
    assert b"Traceback" not in relay.p.stderr.read()  # nothing escaped a thread


def _sockets_held(pid: int) -> int:
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            held += os.readlink(fd).startswith("socket:")
        except OSError:
            pass  # closed meanwhile
    return held


def test_connections_before_the_plan_are_bounded_and_end_within_the_stall_after_it(tmp_path):
    """Connections before the plan are bounded in number, and end within the stall after it."""
    stream = _whole(_saved(tmp_path, 2))
    relay = Relay(tmp_path, stream, plan=False)
    connected = []
    for _ in range(3 * node_relay.WAITING_MAX):
        try:  # a connection the listen queue has no room for is not answered: given up at once
            connected.append(socket.create_connection(("127.0.0.1", relay.port), timeout=0.05))
        except OSError:
            pass
    assert connected  # the listen queue took some
    held, deadline = 0, time.monotonic() + 0.5
    while time.monotonic() < deadline and held <= node_relay.WAITING_MAX + 1:
        held = max(held, _sockets_held(relay.p.pid))
        time.sleep(0.05)
    assert held <= node_relay.WAITING_MAX + 1  # its listener and at most WAITING_MAX connections
    relay.send_plan()
    planned = time.monotonic()
    sock, answer = _connect_as_sender(relay.port, SECRET)
    assert answer == "AT 0"
    for s in connected:
        _until_closed(s, STALL + 8)
    assert time.monotonic() - planned < STALL + MARGIN  # every early one ended within the stall of the plan
    sock.sendall(b"".join(d for _, d in stream.pieces(0)))
    code, lines = relay.end()
    assert (code, lines[-1]) == (0, "EXIT 0"), lines


def test_the_chain_reaches_every_node_despite_early_hostile_connections_to_relays(tmp_path):
    """Hostile connections to every relay before the plan leave the chain reaching every node."""
    names = ("a", "b", "c")
    held: list[socket.socket] = []

    def hostile(link):  # one of each, and silent ones up to one less than a relay takes at once
        address = f"127.0.0.{names.index(link.name) + 1}"
        kinds = HOSTILE + ("silent",) * (node_relay.WAITING_MAX - 1 - len(HOSTILE))
        held.extend(_hostile(kind, link.port, address) for kind in kinds)

    run, remote, stream = _chain(tmp_path, names, on_start=hostile)
    try:
        with remote:
            _go_within(run, 60)
    finally:
        for s in held:
            s.close()
    _loaded_everywhere_but(run, stream, set())


# ---------------------------------------------------------------------- broken or false receivers


class FakeReceiver:
    """A program holding a node's address and port, answering any sender with ``answer`` lines."""

    def __init__(self, address: str, answers: list[bytes]) -> None:
        self.server = socket.create_server((address, 0))
        self.port = self.server.getsockname()[1]
        self.answers = answers
        self.heard = b""
        """Everything the sender sent it."""
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.server.settimeout(30)
        try:
            conn, _ = self.server.accept()
            with conn:
                for answer in self.answers:
                    conn.sendall(answer)
                    self.heard += _read_for(conn, 1)
                self.heard += _read_for(conn, 5)
        except OSError:
            pass  # the sender ended it
        finally:
            self.done.set()


def test_a_receiver_answering_in_non_ascii_is_passed_over_and_the_chain_returns(tmp_path):
    """A receiver answering the handshake in non-ASCII is passed over, and the chain returns."""
    fakes = []

    def c_is_fake(link):  # c's port, as the others are told it, is held by a program answering in non-ASCII
        if link.name == "c":
            fakes.append(FakeReceiver("127.0.0.3", [("é" * 32 + "\n").encode(), ("é" * 64 + "\n").encode()]))
            link.port = fakes[0].port

    run, remote, stream = _chain(tmp_path, ("a", "b", "c", "d"), on_start=c_is_fake)
    with remote:
        _go_within(run, 30)
    _loaded_everywhere_but(run, stream, {"c"})
    assert run.by_name["c"].failure.startswith("passed over by b: 127.0.0.3:"), run.by_name["c"].failure
    assert "not ASCII" in run.by_name["c"].failure


INJECT = '''
import socket as _socket


class _Doomed(object):
    """The socket to the doomed port: once {after} bytes went through it, sendall {what}s."""

    def __init__(self, sock):
        self._sock, self._sent = sock, 0

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def sendall(self, data):
        if self._sent >= {after}:
            if "{what}" == "fail":
                raise RuntimeError("injected fault")
            time.sleep(3600)
        self._sent += len(data)
        return self._sock.sendall(data)


_create = _socket.create_connection


def _create_doomed(address, *args, **kwargs):
    sock = _create(address, *args, **kwargs)
    try:
        with open({doomed!r}) as f:
            doomed = int(f.read() or 0)
        if address[1] == doomed:
            os.unlink({doomed!r})  # the first connection to that port only
            return _Doomed(sock)
    except OSError:
        pass
    return sock


_socket.create_connection = _create_doomed
'''


def _relay_doomed(tmp_path: Path, what: str) -> tuple[tuple[str, ...], Path]:
    """The relay program, with the first socket a relay opens to the port written in the returned
    file failing (``fail``) or sticking (``stick``) once 4 MiB went through it."""
    doomed = tmp_path / "doomed-port"
    doomed.write_text("")
    argv = chain.relay_argv(_keeper(tmp_path / "loaded"), str(tmp_path / "spool"))
    anchor = '\nif __name__ == "__main__":'
    assert argv[1] == "-c" and anchor in argv[2]
    source = argv[2].replace(anchor, INJECT.format(after=4 << 20, what=what, doomed=str(doomed)) + anchor)
    return (argv[0], argv[1], source, *argv[3:]), doomed


def _chain_a_to_d_dooming_c(tmp_path: Path, what: str):
    """A chain a -> b -> c -> d whose relays' first socket to c fails or sticks (``_relay_doomed``)."""
    argv, doomed = _relay_doomed(tmp_path, what)

    def doom_c(link):
        if link.name == "c":
            doomed.write_text(str(link.port))

    return _chain(tmp_path, ("a", "b", "c", "d"), argv, doom_c)


def test_a_forwarder_lost_mid_stream_is_reported_and_the_next_node_gets_the_stream(tmp_path):
    """A forwarder that fails mid-stream is reported, and the node after the lost one gets the stream."""
    run, remote, stream = _chain_a_to_d_dooming_c(tmp_path, "fail")
    with remote:
        _go_within(run, 30)
    _loaded_everywhere_but(run, stream, {"c"})
    assert ("b", "LOST c RuntimeError: injected fault") in run.said
    # b's report, or c's own words when d's TAKEN reaches it before this machine's STOP
    assert run.by_name["c"].failure in ("passed over by b: RuntimeError: injected fault",
                                        "passed over: d now takes the stream from b"), run.by_name["c"].failure


def test_a_relay_stuck_mid_forward_yet_reporting_is_passed_over_within_the_bound(tmp_path, monkeypatch):
    """A relay stuck mid-forward while it still reports is passed over within the bound."""
    monkeypatch.setattr(chain, "STUCK_FLOOR", 0.0)  # the bound is then 3 x stall_seconds
    run, remote, stream = _chain_a_to_d_dooming_c(tmp_path, "stick")
    with remote:
        _go_within(run, 40)
    _loaded_everywhere_but(run, stream, {"b"})
    assert re.fullmatch(rf"forwarded nothing to c for {3 * STALL:g} s while holding verified bytes \d+-\d+ "
                        r"\(a stuck relay\): passed over", run.by_name["b"].failure), run.by_name["b"].failure



@pytest.mark.parametrize("keeps_output", [False, True], ids=["ignores-its-stop", "a-child-holds-its-output"])
def test_a_node_told_to_stop_whose_relay_never_ends_is_ended_within_the_bound(tmp_path, monkeypatch, keeps_output):
    """b's port refuses a (a firewall), so a passes over it and this machine tells b's relay to stop;
    b runs a program that ignores that (and, in the second case, leaves a process holding its output
    when it is killed). The row still ends within the silence bound, b's program killed, b named."""
    monkeypatch.setattr(chain, "SILENCE_FLOOR", 0.0)  # the bound is then stall_seconds
    held = tmp_path / "held.pid"
    keep = f"sleep 600 & echo $! > {held}; " if keeps_output else ""
    killed = []

    def b_ignores_its_stop(link):
        if link.name == "b":
            link.session.close()
            link.session = run.remote.start("b", ("sh", "-c", f"{keep}echo LISTEN 1; exec sleep 600"), None)
            assert link.session.readline() == b"LISTEN 1\n"
            link.port = _closed_port()
            killed.append(link.session)

    run, remote, stream = _chain(tmp_path, ("a", "b", "c"), on_start=b_ignores_its_stop)
    try:
        with remote:
            _go_within(run, 20 + MARGIN)
    finally:
        if held.exists():
            os.kill(int(held.read_text()), signal.SIGKILL)
    _loaded_everywhere_but(run, stream, {"b"})
    assert "cannot connect to 127.0.0.2:" in run.by_name["b"].failure, run.by_name["b"].failure
    assert killed[0].p.poll() is not None


# ---------------------------------------------------------------------- proofs bound to their hop


@pytest.mark.parametrize("wrong, kw", [
    (None, {}),
    ("made for another receiver's place in the row", {"to": 3, "receiver": 2}),
    ("naming another sender index than the one proven", {"claim": 0}),
    ("made for another transfer", {"transfer": "u" * 32}),
    ("from a node after the receiver", {"index": 3, "name": "d"}),
])
def test_a_senders_proof_is_good_only_for_the_hop_and_transfer_it_was_made_for(tmp_path, wrong, kw):
    relay = Relay(tmp_path, _whole(_saved(tmp_path, 1)), index=2, name="c")
    sock, answer = _connect_as_sender(relay.port, SECRET, **{"name": "b", "index": 1, "to": 2, **kw})
    assert answer == ("" if wrong else "AT 0"), wrong
    sock.close()
    code, lines = relay.stop()
    assert code == 3


def _line_starting(relay: Relay, prefix: str, seconds: float) -> str:
    """The relay's first stdout line starting with ``prefix`` (it says ``AT`` every half second)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = relay.p.stdout.readline().decode()
        if line.startswith(prefix) or not line:
            return line
    return ""


def test_a_receiver_at_an_unplanned_place_in_the_row_is_refused_by_the_sender(tmp_path):
    """A receiver at another place in the row than planned is refused by the sender."""
    stream = _whole(_saved(tmp_path, 1))
    real = Relay(tmp_path, stream, index=2, name="c")  # a relay of this transfer, but node 2, not 3
    sender = Relay(tmp_path, stream, index=1, name="b", downstream=[["d", "127.0.0.1", real.port, 3]])
    line = _line_starting(sender, "LOST", STALL + 5)
    assert line.startswith(f"LOST d 127.0.0.1:{real.port} did not prove that it is this transfer's node 3"), line
    assert sender.stop()[0] == real.stop()[0] == 3


def test_an_impostor_receiver_gets_nothing_from_the_sender_the_real_one_accepts(tmp_path):
    """An impostor receiver gets nothing from the sender that the real receiver accepts."""
    stream = _whole(_saved(tmp_path, 1))
    real = Relay(tmp_path, stream, index=2, name="c", stall=10)  # time for the impostor's replay
    to_real = socket.create_connection(("127.0.0.1", real.port), timeout=5)
    unasked = _read_for(to_real, 0.5)  # what the real receiver says before anyone proved anything
    impostor = FakeReceiver("127.0.0.1", [unasked or (os.urandom(16).hex() + "\n").encode(),
                                          f"{os.urandom(16).hex()} {'0' * 64}\n".encode()])
    sender = Relay(tmp_path, stream, index=1, name="b", downstream=[["c", "127.0.0.1", impostor.port, 2]])
    assert _line_starting(sender, "LOST", STALL + 5).startswith("LOST c ")
    assert impostor.done.wait(10)
    to_real.sendall(impostor.heard)  # everything the sender told the impostor, replayed to the real one
    answer = _read_for(to_real, STALL).decode(errors="replace").splitlines()
    assert answer  # the real receiver was still listening
    assert not any(a.startswith("AT") for a in answer), answer  # and never took the impostor as a sender
    assert sender.stop()[0] == real.stop()[0] == 3


# ---------------------------------------------------------------------- this node's own faults


def _file_size_limit(n: int):
    def limit():  # the spool file may not grow past n bytes: writes past it fail (EFBIG), as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return limit


@pytest.mark.parametrize("via", ["a sender", "the operator"])
def test_a_spool_file_that_cannot_be_written_fails_the_node_naming_it(tmp_path, via):
    stream = _whole(_saved(tmp_path, 6))
    relay = Relay(tmp_path, stream, preexec_fn=_file_size_limit((1 << 20) + 123))
    data = b"".join(d for _, d in stream.pieces(0))
    if via == "a sender":
        sock, answer = _connect_as_sender(relay.port, SECRET)
        assert answer == "AT 0"
        try:
            sock.sendall(data)
        except OSError:
            pass  # the relay ended the connection
    else:
        def feed():
            try:
                relay.p.stdin.write(b"DATA 0 %d\n" % len(data) + data)
                relay.p.stdin.flush()
            except OSError:
                pass  # the relay ended
        threading.Thread(target=feed, daemon=True).start()
    line = _line_starting(relay, "REFUSED", STALL + 5).rstrip("\n")  # not the AT lines of a node that lost bytes
    assert re.fullmatch(rf"REFUSED cannot write the spool file {tmp_path}/spool/ddp-deploy-chain-\S+: File too large: "
                        r"it must hold the whole stream, free space there", line), line
    assert relay.p.wait(10) == 3


# ---------------------------------------------------------------------- a flood of connections


class Flood:
    """Connections to ``port`` begun in bursts, as fast as this process can, each kept open (half
    silent, half with a sender's hello of their own) until the relay ends it or the flood ends."""

    def __init__(self, port: int) -> None:
        self.port, self.stop, self.opened = port, threading.Event(), 0
        self.worker = threading.Thread(target=self._open, daemon=True)
        self.worker.start()

    def _open(self) -> None:
        held: list[socket.socket] = []
        while not self.stop.is_set():
            for i in range(32):
                s = socket.socket()
                s.setblocking(False)
                if s.connect_ex(("127.0.0.1", self.port)) not in (0, errno.EINPROGRESS):
                    s.close()
                    continue
                held.append(s)
                self.opened += 1
            for s in held[-32::2]:
                try:
                    s.send(f"CHAIN {os.urandom(16).hex()}\n".encode())
                except OSError:
                    pass  # not connected yet (the listen queue was full), or ended by the relay
            if len(held) > 600:  # stay under this process's open files: the oldest go
                for old in held[:300]:
                    old.close()
                del held[:300]
            time.sleep(0.001)
        for s in held:
            s.close()

    def end(self) -> None:
        self.stop.set()
        self.worker.join(10)


def test_a_flood_of_unproven_connections_never_pushes_a_real_sender_out(tmp_path):
    """A flood of unproven connections does not push a real sender out of the receiver."""
    stream = _whole(_saved(tmp_path, 6))
    receiver = Relay(tmp_path, stream, index=2, name="c")
    flood = Flood(receiver.port)
    try:
        deadline = time.monotonic() + 10
        while flood.opened < 4 * node_relay.WAITING_MAX and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flood.opened >= 4 * node_relay.WAITING_MAX  # more than the relay holds, and still coming
        sender = Relay(tmp_path, stream, index=1, name="b", downstream=[["c", "127.0.0.1", receiver.port, 2]])
        data = b"".join(d for _, d in stream.pieces(0))
        sender.p.stdin.write(b"DATA 0 %d\n" % len(data) + data)
        sender.p.stdin.flush()
        code, lines = receiver.end()
        before = flood.opened
    finally:
        flood.end()
    assert (code, lines[-1], f"OUT ID {_sha(stream)}" in lines) == (0, "EXIT 0", True), lines
    assert before > 8 * node_relay.WAITING_MAX  # the flood went on while the stream went through
    sender_code, sender_lines = sender.end()
    assert sender_code == 0 and not any(line.startswith("LOST") for line in sender_lines), sender_lines
