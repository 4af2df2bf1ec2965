"""The image chain's wire: what a node's relay (node_relay.py) says and proves, and its parts that
read and prove it.

Standard library only, Python 3.6+, no import of this package: this file's text and then
node_relay.py's are sent as one string and run by the node's interpreter (deploy/images/chain.py
is the operator's side).

stdin, from the operator over SSH (the only channel that carries the secret and the digests):
    PLAN <json>\\n           {secret, transfer, size, chunk, digests, index, name, stall, downstream:
                             [[name, address, port, index], ...] in chain order}
    DATA <offset> <n>\\n<n bytes>   the stream itself, for the node the operator feeds
    STOP <reason>\\n         give up now (the operator saw this node passed over)
stdout, to the operator: ``LISTEN <port>``, then every half second ``AT <received> <forwarded>
<loaded> <next node or ->``, ``LOST <node> <why>`` when the next node is passed over, ``OUT``/``ERR``
lines of the load command and ``EXIT <code>``, or ``REFUSED <why>`` and exit status 3.

Between nodes (TCP, opened for this transfer only), every proof an HMAC-SHA256 keyed with the
transfer's secret over its role, the transfer's id, the hops and both nonces (see ``mac``):
    sender   -> receiver   ``CHAIN <nonce S> <mac("hello", receiver's index, S)>``
    receiver -> sender     ``<nonce R> <mac("down", receiver's index, S, R)>``
    sender   -> receiver   ``<name> <index> <mac("up", sender's index, receiver's index, name, S, R)>``
    receiver -> sender     ``AT <offset>`` (or ``BUSY``: a node nearer the source feeds it)
The receiver proves itself first, and only for the hop the sender meant: a program that is not this
transfer's relay at that hop gets no proof from the sender, and a proof made for one hop, transfer
or role is worth nothing at another. Then the sender streams raw bytes from that offset while the
receiver sends ``AT <received>`` every half second and ``DONE`` once it and every node after it
have everything. A receiver takes a new sender only if it is nearer the source than the current
one, and tells the one it drops ``TAKEN``: that node was passed over and gives up.

The hello's proof only keeps the sender's place while it connects: a hello without it, or with one
that is wrong or seen before, is answered all the same (the sender then finds out whom it reached),
but is one of the unproven. Connections are taken from the start, one thread handshaking them all
at once; at most ``WAITING_MAX`` unproven ones are held, and one more ends the oldest of them, never
a connection whose hello was proven (of those, only the transfer's own nodes can make any). So
however many connections anyone opens, a sender's stays until its handshake ends, and a sender
whose connection was ended before any answer (a flood ended it before its hello was read; the
receiver had no plan yet) connects again until its ``stall`` seconds are up.

Whatever a peer sends (nothing, non-ASCII, garbage, a byte at a time) ends that connection only,
within ``stall`` seconds of its arrival (of the plan's, for one that came before it). A hop that
fails in any way, an unexpected error included, is reported ``LOST`` and the next node is tried; a forwarding thread that ends otherwise fails its node, so no
node goes on reporting progress with nothing forwarding (the operator also passes over a node that
holds verified bytes it does not send on: deploy/images/chain.py).
"""


import hashlib
import hmac
import json
import re
import socket
import sys
import threading
import time

PIECE = 1 << 20
DROPPED_DRAIN = 5.0  # seconds a dropped sender's connection is read on, for it to read TAKEN and close
TICK = 0.5
REFUSED_EXIT = 3
OPERATOR = -1
"""The index of the operator, which feeds the first node over SSH (nearer the source than any node)."""
WAITING_MAX = 16
"""Unproven connections held at once (before the plan, every connection is unproven)."""
BACKLOG = 128
"""The listen queue: connections the kernel holds until the handshake thread takes them."""
AGAIN = 0.1
"""Seconds a sender waits before it connects again to a receiver that ended it without a word."""
CONNECT_TRY = 0.5
"""Seconds one connection attempt waits for the receiver's answer: where a flood fills its listen
queue, a new attempt is heard as soon as there is room, not at the kernel's next retransmission."""
HANDSHAKE_LINE = 512
"""The longest line a peer may send outside the stream (a handshake line is under 150 bytes)."""
NONCE = re.compile(r"[0-9a-f]{32}")
PROOF = re.compile(r"[0-9a-f]{64}")
NAME = re.compile(r"[A-Za-z0-9_.-]{1,253}")
NUMBER = re.compile(r"[0-9]{1,15}")

OUTPUT = threading.Lock()
"""Held while a line goes out on stdout (several threads say things)."""


def say(*words):
    with OUTPUT:
        sys.stdout.write(" ".join(str(w) for w in words).replace("\n", " ") + "\n")
        sys.stdout.flush()


def mac(plan, role, *fields):
    """The proof of ``role`` (``up``: a sender, ``down``: a receiver) for this transfer and ``fields``."""
    message = "\n".join([role, plan["transfer"]] + [str(f) for f in fields])
    return hmac.new(plan["secret"].encode(), message.encode(), hashlib.sha256).hexdigest()


def same(given, expected):
    return hmac.compare_digest(given.encode(), expected.encode())


def why(e):
    """An exception as words for a ``LOST`` or ``REFUSED`` line."""
    text = str(e)
    if isinstance(e, OSError) and text:
        return text
    return "{}: {}".format(type(e).__name__, text) if text else type(e).__name__


def shut(sock):
    """End a connection another thread may be blocked on (its recv returns at once)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Refused(Exception):
    pass


class SpoolError(Exception):
    """This node cannot read its own spool file: its fault, not the next node's."""


class Closed(ConnectionError):
    """The peer ended the connection."""


class Lines:
    """Line reading on a socket that also carries raw bytes after the handshake."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = b""

    def line(self, deadline=None):
        """One ASCII line; ``deadline`` (a time.time()) bounds the whole line, not each recv, so
        a peer sending a byte at a time cannot hold the connection."""
        while True:
            whole = self.buffered()
            if whole is not None:
                return whole
            if deadline is not None:
                left = deadline - time.time()
                if left <= 0:
                    raise ConnectionError("no complete line in time")
                self.sock.settimeout(left)
            data = self.sock.recv(4096)
            if not data:
                raise Closed("closed")
            self.buf += data

    def buffered(self):
        """The next line if all of it has arrived, else None."""
        if b"\n" not in self.buf:
            if len(self.buf) > HANDSHAKE_LINE:
                raise ConnectionError("a line longer than {} bytes".format(HANDSHAKE_LINE))
            return None
        line, _, self.buf = self.buf.partition(b"\n")
        if len(line) > HANDSHAKE_LINE:
            raise ConnectionError("a line longer than {} bytes".format(HANDSHAKE_LINE))
        try:
            return line.decode("ascii")
        except UnicodeDecodeError:
            raise ConnectionError("a line that is not ASCII")


def send_by(sock, deadline, text):
    sock.settimeout(max(deadline - time.time(), 0.001))
    sock.sendall(text.encode())


class Taken(Exception):
    pass


class Unanswered(ConnectionError):
    """The receiver ended the connection without a word: it may have had no plan yet, or have ended
    the connection among a flood of others before it read the hello."""


class Handshake(object):
    """A connection in its handshake, as the receiver's thread for them all sees it."""

    def __init__(self, sock, deadline):
        self.sock = sock
        self.deadline = deadline
        self.lines = Lines(sock)
        self.theirs = None
        """The sender's nonce, once its hello is read."""
        self.mine = None
        self.proven = False
        """Its hello carried a proof made with the transfer's secret."""


def control(relay):
    """The operator's messages on stdin; its end before the job is done is an abort."""
    stdin = sys.stdin.buffer
    while True:
        header = stdin.readline()
        if not header:
            relay.fail("the operator's connection ended")
            return
        words = header.decode(errors="replace").split(" ", 1)
        kind = words[0].strip()
        if kind == "PLAN":
            try:
                relay.start(json.loads(words[1]))
            except Refused as e:
                relay.fail(str(e))
            except (OSError, ValueError, KeyError) as e:
                relay.fail("cannot start: {}".format(e))
        elif kind == "DATA":
            offset, n = (int(x) for x in words[1].split())
            data = stdin.read(n)
            if len(data) < n:
                relay.fail("the operator's connection ended")
                return
            relay.from_operator(offset, data)
        elif kind == "STOP":
            relay.fail(words[1].strip() if len(words) > 1 else "stopped by the operator")
