"""The pipelined chain: this machine's uplink carries one copy of the image whatever N is.

The nodes that lack the image are put in a row (inventory order). Each runs
``deploy/programs/node_relay.py`` (after ``relay_wire.py``) over SSH; this machine streams the saved image (without the leading
layers every node in the row holds) to the first over that SSH session, and every node stores
what it gets, checks each chunk against the digest sent to it over SSH, forwards verified chunks
to the next node over the nodes' own network and feeds them to ``docker load`` in its own thread.
Time: about ``(size + (N-1) x chunk) / bandwidth`` (MPI's pipelined chain broadcast).

Trust: the node-to-node connections are opened for this transfer only. The receiver proves first
that it holds this transfer's secret (an HMAC over the sender's fresh nonce, its own and its place in
the row), then the sender proves it the same way for that hop; a program that is not the planned
receiver gets no proof from a sender. The secret and the digests travel only over SSH. Whatever a
peer sends ends its own connection only (node_relay.py).

A node that takes no data for ``image.stall_seconds`` (killed, link down, full disk) is passed
over: the node before it forwards to the one after it, from what that one already has, and the
failed node is named at the end (a later ``deploy`` gives it the image). If the first node
fails, this machine feeds the next one itself. A relay that still reports but has forwarded nothing
of what it holds while the whole row stood still for ``max(3 x stall, STUCK_FLOOR)`` is passed over the
same way, so a stuck relay thread never makes ``deploy`` wait for ever; and a relay passed over (told
to stop) or refusing that has not ended within the silence bound is killed and its part ended, whatever
still holds its output.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import RemoteFailure
from ..programs import HERE
from ..nodes.remote import Remote, Result, command_line
from . import image, oci
from .delivery import Delivery, saved_line

RELAY = (HERE / "relay_wire.py", HERE / "node_relay.py")
"""The node's program: the two files' texts, one after the other (relay_wire.py first)."""
PASSED_OVER = "passed over: "  # a relay's own word that a node nearer the source took its receiver
CHUNK = 4 << 20
"""Verification and pipelining unit: each hop adds one chunk's time."""
SPOOL_DIR = "/var/tmp"
"""Where each node keeps its copy of the stream while it forwards and loads it."""
PIECE = 1 << 20
SILENCE_FLOOR = 10.0
STUCK_FLOOR = 30.0
"""The least time the row may stand still before a relay holding unforwarded bytes is passed over
(a pass-over itself takes about two stall periods)."""


def relay_argv(load: Sequence[str], spool_dir: str = SPOOL_DIR) -> tuple[str, ...]:
    """The node's side: ``load`` gets the verified stream on its stdin."""
    return ("python3", "-c", "".join(p.read_text() for p in RELAY), spool_dir, "--", *load)


def digests(stream, chunk: int = CHUNK) -> list[str]:
    """The sha256 of every ``chunk`` bytes of ``stream`` (anything with ``pieces`` and ``size``)."""
    out, h, filled = [], hashlib.sha256(), 0
    for _, data in stream.pieces(0, chunk):
        view = memoryview(data)
        while view:
            n = min(chunk - filled, len(view))
            h.update(view[:n])
            view, filled = view[n:], filled + n
            if filled == chunk:
                out.append(h.hexdigest())
                h, filled = hashlib.sha256(), 0
    if filled:
        out.append(h.hexdigest())
    return out


@dataclass
class Link:
    """What this machine knows of one node of the row."""

    name: str
    index: int
    session: object = None
    port: int = 0
    received: int = 0
    forwarded: int = 0
    next_node: str = "-"
    heard: float = field(default_factory=time.time)
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    load_exit: int | None = None
    failure: str | None = None
    failed_at: float | None = None
    """When this machine first saw ``failure`` while the relay's session was still open."""
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def alive(self) -> bool:
        return self.failure is None and not self.ended.is_set()

    @property
    def cause_known(self) -> bool:
        """It failed, and more is known than the node's own word that it was passed over (its
        sender's LOST, which may come after that word, names why)."""
        return self.failure is not None and not self.failure.startswith(PASSED_OVER)


class Chain(Delivery):
    name = "chain"

    def describe(self, nodes):
        inv = self.inv
        stall = inv.image.stall_seconds
        return [
            saved_line(inv),
            f"[local] chain: local -> {' -> '.join(nodes)}; this machine sends one copy, to the first, over SSH; "
            f"each node checks every {CHUNK >> 20} MiB chunk against the digests sent to it over SSH, forwards it "
            f"to the next over a connection opened for this transfer (a per-transfer secret) and loads it; a node "
            f"that takes no data for {stall:g} s is passed over and named",
            *(f"[{n}] python3 -c \"$(cat {' '.join(map(str, RELAY))})\" {SPOOL_DIR} -- {command_line(image.load_argv(inv))}"
              for n in nodes),
        ]

    def ship(self, remote: Remote, image_id, held, report=lambda *a: None):
        inv = self.inv
        image.bound()  # a bad DDP_DEPLOY_IMAGE_CACHE_GB is refused before anything is sent
        held, _ = image.resolved(inv, held, image_id)  # saves only where a containerd node needs it
        todo = [n.name for n in inv.nodes if n.name in held and held[n.name].image_id != image_id]
        if not todo:  # nothing saved when every node is up to date
            return {n: image.ShipOutcome(n, 0) for n in held}
        saved = image.saved_image(inv, image_id)  # whole: its digests go to the nodes first
        ident = oci.identity(saved)
        held = image.resolve(held, ident)
        diff_ids = image.local_layers(inv)
        skip = min(image.layers_to_skip(held[n], diff_ids) for n in todo)
        # docker save's own tar where every node needs every layer and reads it (the classic
        # store); else the tar both stores load, without the layers every node in the row holds
        if skip == 0 and all(held[n].store == image.CLASSIC for n in todo):
            stream = oci.Layout(saved.path, ((0, saved.size),))
        else:
            stream = oci.layout(saved, skip, inv.image.name)
        for n in todo:
            report(n, "waiting", 0, stream.size)
        run = _Run(inv, remote, stream, todo, report, relay_argv(image.load_argv(inv)))
        try:
            run.go()
        except BaseException:
            run.abort()
            raise
        finally:
            image.clean_cache(saved.path)
        results: dict[str, Result] = {}
        for link in run.links:
            problem = link.failure or _load_problem(held[link.name], link, ident)
            results[link.name] = Result(link.name, 0) if problem is None else Result(link.name, 1, error=problem)
            report(link.name, "verified" if problem is None else "failed", link.received, stream.size)
        if not all(r.ok for r in results.values()):
            raise RemoteFailure("image chain", {**{n: Result(n, 0) for n in held}, **results},
                                hint="the others have the verified image; `ddp-deploy deploy` ships it to this node")
        return {n: image.ShipOutcome(n, stream.size, skip, len(diff_ids), image.how_sent(held[n], skip))
                if n in todo else image.ShipOutcome(n, 0) for n in held}


def _load_problem(node_images, link: Link, ident) -> str | None:
    if link.load_exit is None:
        return "the node's relay ended without loading the image"
    return image.load_problem(node_images, "\n".join(link.out), ident)


class _Run:
    """One transfer: the relays, this machine's feed of the first live node, the watch."""

    def __init__(self, inv, remote: Remote, stream: oci.Layout, todo: list[str], report, argv: Sequence[str]) -> None:
        self.inv, self.remote, self.stream, self.report, self.argv = inv, remote, stream, report, argv
        self.links = [Link(n, i) for i, n in enumerate(todo)]
        self.by_name = {link.name: link for link in self.links}
        self.stall = inv.image.stall_seconds
        self.lock = threading.Lock()
        self.sent_bytes = 0
        """Bytes this machine sent (the uplink's share)."""
        self.moved = time.time()
        """When a node of the row last received or forwarded a byte."""

    def go(self) -> None:
        starters = [threading.Thread(target=self._start, args=(link,), daemon=True) for link in self.links]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        row = [link for link in self.links if link.alive and link.port]
        sums = digests(self.stream)
        secret, transfer = secrets.token_hex(32), secrets.token_hex(16)
        for i, link in enumerate(row):
            plan = {"secret": secret, "transfer": transfer, "size": self.stream.size, "chunk": CHUNK, "digests": sums,
                    "index": link.index, "name": link.name, "stall": self.stall,
                    "downstream": [[d.name, self.inv.node(d.name).address, d.port, d.index] for d in row[i + 1:]]}
            self._tell(link, b"PLAN " + json.dumps(plan, separators=(",", ":")).encode() + b"\n")
        now = time.time()
        self.moved = now
        for link in row:
            link.heard = now
            threading.Thread(target=self._read, args=(link,), daemon=True).start()
        feeder = threading.Thread(target=self._feed, args=(row,), daemon=True)
        feeder.start()
        while not all(link.ended.is_set() for link in row):
            self._watch(row)
            time.sleep(0.2)
        feeder.join()

    def abort(self) -> None:
        for link in self.links:
            self._give_up(link, "interrupted")

    # ------------------------------------------------------------------ each node

    def _start(self, link: Link) -> None:
        try:
            link.session = self.remote.start(link.name, self.argv, None)
            first = link.session.readline().decode(errors="replace").split()
        except Exception as e:  # the node's own words, whatever the transport raised
            link.failure = f"cannot start the relay: {e}"
            link.ended.set()
            return
        if first[:1] == ["LISTEN"] and len(first) == 2 and first[1].isdigit():
            link.port = int(first[1])
            return
        try:
            code, rest, err = link.session.finish(b"")
            why = (err or rest).decode(errors="replace").strip().splitlines()
        except Exception as e:
            code, why = None, [str(e)]
        link.failure = (f"cannot start the relay (python3 on the node runs it): "
                        f"{why[-1] if why else f'exit {code}'}")
        link.ended.set()

    def _read(self, link: Link) -> None:
        try:
            while True:
                line = link.session.readline()
                if not line:
                    break
                link.heard = time.time()
                self._hear(link, line.decode(errors="replace").rstrip("\n"))
            code, _, err = link.session.finish(b"")
            if link.failure is None and code != 0:
                tail = err.decode(errors="replace").strip().splitlines()
                link.failure = f"the relay ended with exit {code}" + (f": {tail[-1]}" if tail else "")
        except Exception as e:
            if link.failure is None:
                link.failure = f"connection lost: {e}"
        finally:
            link.ended.set()

    def _hear(self, link: Link, line: str) -> None:
        kind, _, rest = line.partition(" ")
        size = self.stream.size
        if kind == "AT":
            words = rest.split()
            received, forwarded = int(words[0]), int(words[1])
            if (received, forwarded) != (link.received, link.forwarded):
                self.moved = time.time()
            link.received, link.forwarded, link.next_node = received, forwarded, words[3]
            stage = "receiving" if link.received < size else "forwarding" if link.next_node != "-" else "loading"
            self.report(link.name, stage, link.received, size)
        elif kind == "LOST":
            name, _, why = rest.partition(" ")
            lost = self.by_name.get(name)
            # A sender's word counts while it is one: not once it was passed over itself (its relay,
            # slow to hear so, may still try its old next node), and not of a node that holds the
            # whole stream already (its relay may have ended and closed its port)
            if lost is not None and not lost.cause_known and link.failure is None and lost.received < size:
                self._give_up(lost, f"passed over by {link.name}: {why}", tell=True, names_cause=True)
        elif kind == "OUT":
            link.out.append(rest)
        elif kind == "ERR":
            link.err.append(rest)
        elif kind == "EXIT":
            link.load_exit = int(rest) if rest.lstrip("-").isdigit() else None
        elif kind == "REFUSED":
            with self.lock:  # a node's own word that it was passed over never replaces a known cause
                if not (rest.startswith(PASSED_OVER) and link.failure is not None):
                    link.failure = rest

    def _watch(self, row: list[Link]) -> None:
        limit = max(self.stall, SILENCE_FLOOR)
        for link in row:
            if link.alive and time.time() - link.heard > limit:
                self._give_up(link, f"no word from the node for {limit:g} s (link down or node stopped)")
            elif link.failure is not None and not link.ended.is_set():
                # Told to stop, or it refused: its relay ends within a tick. One that has not within
                # the silence limit (it ignored the stop, or hangs on its way out) is killed here and
                # its part ended, whatever still holds its output, so the row's end never waits on it.
                if link.failed_at is None:
                    link.failed_at = time.time()
                elif time.time() - link.failed_at > limit:
                    self._close(link)
                    link.ended.set()
        # A relay's heartbeat says it lives, not that its forwarding does: one that holds bytes it
        # has not sent on while nothing anywhere in the row moves is stuck, and the node before it
        # (or this machine) passes over it as over a silent one.
        still = max(3 * self.stall, STUCK_FLOOR)
        if time.time() - self.moved > still:
            for link in row:
                verified = self._verified(link.received)
                if link.alive and link.next_node != "-" and link.forwarded < verified:
                    self._give_up(link, f"forwarded nothing to {link.next_node} for {still:g} s while holding verified "
                                        f"bytes {link.forwarded}-{verified} (a stuck relay): passed over")
            self.moved = time.time()

    def _verified(self, received: int) -> int:
        """What a relay that received ``received`` bytes may forward: its whole chunks, or everything."""
        return received if received >= self.stream.size else received - received % CHUNK

    def _give_up(self, link: Link, why: str, tell: bool = False, names_cause: bool = False) -> None:
        """Ends ``link``'s part (``tell``: asks its relay to stop first). ``why`` is kept if nothing
        was yet, or (``names_cause``: a sender's LOST) if only the node's own passed-over word was."""
        with self.lock:
            if link.failure is None or (names_cause and not link.cause_known):
                link.failure = why
        if link.session is None:
            return
        if tell:
            try:
                self._tell(link, f"STOP {why}\n".encode())
                return
            except Exception:
                pass
        self._close(link)

    @staticmethod
    def _close(link: Link) -> None:
        try:
            link.session.close()
        except Exception:
            pass

    def _tell(self, link: Link, data: bytes) -> None:
        try:
            link.session.write(data)
        except Exception as e:
            self._give_up(link, f"connection lost: {e}")

    # ------------------------------------------------------------------ this machine's feed

    def _feed(self, row: list[Link]) -> None:
        """Send the stream to the first live node; when it fails, to the next, from what it has."""
        size = self.stream.size
        head, sent = None, 0
        while True:
            live = [link for link in row if link.alive]
            if not live:
                return
            if live[0] is not head:
                head, sent = live[0], live[0].received
            if sent >= size:
                if all(link.received >= size or not link.alive for link in row):
                    return
                time.sleep(0.1)
                continue
            try:
                for offset, data in self.stream.pieces(sent):
                    if not head.alive:
                        break
                    head.session.write(b"DATA %d %d\n" % (offset, len(data)) + data)
                    sent = offset + len(data)
                    self.sent_bytes += len(data)
            except Exception as e:
                if head.alive:
                    self._give_up(head, f"connection lost while sending: {e}")
