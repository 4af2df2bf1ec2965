"""Runs on a node (``python3 -c <relay_wire.py's text, then this file's> SPOOL_DIR -- LOAD_ARGV...``):
one link of the image chain, as relay_wire.py describes it.

The node stores the stream in a spool file, checks every chunk against the digest the operator
sent over SSH, forwards verified chunks to the next node and feeds them to ``LOAD_ARGV`` (``docker
load``), each from the spool file in its own thread, so a slow load never slows forwarding.
"""

import hashlib
import hmac
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time

try:  # imported as a module (the tests); on the node, relay_wire.py's text came before this one's
    from .relay_wire import (
        AGAIN, BACKLOG, CONNECT_TRY, Closed, DROPPED_DRAIN, HANDSHAKE_LINE, Handshake, Lines, NAME,
        NONCE, NUMBER, OPERATOR, OUTPUT, PIECE, PROOF, REFUSED_EXIT, Refused, SpoolError, TICK,
        Taken, Unanswered, WAITING_MAX, control, mac, same, say, send_by, why)
except ImportError:
    pass


class Relay:
    def __init__(self, spool_dir, load_argv):
        self.cond = threading.Condition()
        self.spool_dir = spool_dir
        self.load_argv = load_argv
        self.plan = None
        self.received = 0
        self.verified = 0
        self.forwarded = 0
        self.loaded = 0
        self.next_name = "-"
        self.forward_done = False
        self.load_exit = None
        self.failure = None
        self.last_data = time.time()
        self.hasher = hashlib.sha256()
        self.up_sock = None
        self.up_index = None
        self.up_name = None
        self.fd = None
        self.path = None
        self.loader = None
        self.echoes = []
        self.hellos = set()
        """The nonces of the proven hellos taken: one replayed is not proven again."""
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("0.0.0.0", 0))
        self.listener.listen(BACKLOG)

    # ---------------------------------------------------------------- the plan

    def start(self, plan):
        size = plan["size"]
        os.makedirs(self.spool_dir, exist_ok=True)
        st = os.statvfs(self.spool_dir)
        free = st.f_bavail * st.f_frsize
        if free < size:
            raise Refused("{} has {:.1f} GB free, the image stream needs {:.1f} GB: free space there"
                          .format(self.spool_dir, free / 1e9, size / 1e9))
        self.fd, self.path = tempfile.mkstemp(prefix="ddp-deploy-chain-", dir=self.spool_dir)
        with self.cond:
            self.plan = plan
            self.last_data = time.time()
            self.cond.notify_all()
        self.loader = subprocess.Popen(self.load_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE)
        for target in (self._load, self._forward, self._beat):
            threading.Thread(target=target, daemon=True).start()
        self.echoes = [threading.Thread(target=self._echo, args=(stream, tag), daemon=True)
                       for stream, tag in ((self.loader.stdout, "OUT"), (self.loader.stderr, "ERR"))]
        for t in self.echoes:
            t.start()

    # ---------------------------------------------------------------- receiving

    def take(self, offset, data, source):
        """Bytes of the stream at ``offset``; what is already here is skipped; every completed
        chunk is checked against its digest before anything may read it."""
        with self.cond:
            if self.failure is not None or self.plan is None:
                return
            size, chunk, digests = self.plan["size"], self.plan["chunk"], self.plan["digests"]
            if offset > self.received:
                return
            data = data[self.received - offset:]
            data = data[:size - self.received]
            if not data:
                return
            start = self.received
            try:
                written = 0
                while written < len(data):  # a short write (the file size limit, a full disk) ends in the error
                    written += os.pwrite(self.fd, data[written:], start + written)
            except OSError as e:
                self._fail_locked("cannot write the spool file {}: {}: it must hold the whole stream, free space "
                                  "there".format(self.path, e.strerror or why(e)))
                return
            self.received = start + len(data)
            self.last_data = time.time()
            i = 0
            while i < len(data):
                pos = start + i
                end = min((pos // chunk + 1) * chunk, size)
                n = min(end - pos, len(data) - i)
                self.hasher.update(data[i:i + n])
                i += n
                if pos + n == end:
                    k = (end - 1) // chunk
                    if not hmac.compare_digest(self.hasher.hexdigest(), digests[k]):
                        self._fail_locked("chunk {} (bytes {}-{}) from {} does not match the digest the "
                                          "operator sent: tampered or corrupted on the way, refused"
                                          .format(k, k * chunk, end, source))
                        return
                    self.hasher = hashlib.sha256()
                    self.verified = end
            self.cond.notify_all()

    def from_operator(self, offset, data):
        with self.cond:
            if self.up_index is not None and self.up_index != OPERATOR:
                self._drop_upstream_locked(OPERATOR, "the operator")
            self.up_index, self.up_name = OPERATOR, "the operator"
        self.take(offset, data, "the operator")

    def _drop_upstream_locked(self, by_index, by_name):
        if self.up_sock is not None:
            try:
                self.up_sock.sendall("TAKEN {}\n".format(by_name).encode())
                # Not closed here: a close with the sender's bytes unread would reset the
                # connection, and the sender could take the reset for this node's loss (LOST).
                # Its reader (_receive) throws away what still comes until the sender, having
                # read TAKEN, closes, or DROPPED_DRAIN seconds pass without a byte.
                self.up_sock.shutdown(socket.SHUT_WR)
                self.up_sock.settimeout(DROPPED_DRAIN)
            except OSError:
                pass
        self.up_sock = None

    def serve(self):
        """Takes every connection as it comes and handshakes all of them in this one thread (each
        with ``stall`` seconds from its arrival, or from the plan's), so that no number of them
        holds up a sender's; a sender proven hands its connection to a thread of its own."""
        sel = selectors.DefaultSelector()
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ)
        pending = []
        """Connections in their handshake, oldest first."""
        planned = False
        try:
            while self.failure is None:
                for key, _ in sel.select(TICK / 5):
                    if key.fileobj is self.listener:
                        self._accept(sel, pending)
                    else:
                        self._advance(sel, pending, key.data)
                if self.plan is not None:
                    now = time.time()
                    if not planned:  # the plan came: those that waited for it are read now
                        planned = True
                        for hs in list(pending):
                            hs.deadline = now + self.plan["stall"]
                            self._advance(sel, pending, hs, read=False)
                    for hs in [hs for hs in pending if hs.deadline < now]:
                        self._drop(sel, pending, hs)
        except (OSError, ValueError):
            pass  # the listener closed: the relay ends
        finally:
            for hs in pending:
                hs.sock.close()

    def _accept(self, sel, pending):
        for _ in range(WAITING_MAX):  # then the handshakes are read again, however fast connections come
            unproven = [hs for hs in pending if not hs.proven]
            if len(unproven) >= WAITING_MAX:
                self._drop(sel, pending, unproven[0])
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            hs = Handshake(sock, time.time() + self.plan["stall"] if self.plan is not None else float("inf"))
            pending.append(hs)
            sel.register(sock, selectors.EVENT_READ, hs)
            self._advance(sel, pending, hs)  # a sender's hello has mostly come with its connection

    def _drop(self, sel, pending, hs):
        if hs in pending:  # else already handed to its own thread, which failed to start
            pending.remove(hs)
            sel.unregister(hs.sock)
        hs.sock.close()

    def _advance(self, sel, pending, hs, read=True):
        """What ``hs`` has sent, as far as it goes; it ends at the first fault, or goes to its own
        thread once proven."""
        try:
            if read:
                try:
                    data = hs.sock.recv(4096)
                except (BlockingIOError, InterruptedError):
                    data = None
                if data == b"":
                    raise Closed("closed")
                if data:
                    hs.lines.buf += data
                    if len(hs.lines.buf) > 2 * (HANDSHAKE_LINE + 1):  # a sender sends a line, then waits
                        raise ConnectionError("more than a handshake before its answer")
            while self.plan is not None:
                line = hs.lines.buffered()
                if line is None:
                    return
                if hs.theirs is None:
                    self._answer(hs, line)
                else:
                    name, index = self._check(hs, line)
                    pending.remove(hs)
                    sel.unregister(hs.sock)
                    hs.sock.setblocking(True)
                    threading.Thread(target=self._upstream, args=(hs, name, index), daemon=True).start()
                    return
        except Exception:  # whatever the peer did ends this connection and nothing else
            self._drop(sel, pending, hs)

    def _answer(self, hs, line):
        """The sender's hello; this node's proof in answer."""
        plan = self.plan
        words = line.split()
        if len(words) not in (2, 3) or words[0] != "CHAIN" or not NONCE.fullmatch(words[1]):
            raise ConnectionError("not a chain sender's hello")
        hs.theirs, hs.mine = words[1], os.urandom(16).hex()
        if len(words) == 3 and words[1] not in self.hellos \
                and same(words[2], mac(plan, "hello", plan["index"], words[1])):
            self.hellos.add(words[1])
            hs.proven = True
        answer = "{} {}\n".format(hs.mine, mac(plan, "down", plan["index"], hs.theirs, hs.mine)).encode()
        if hs.sock.send(answer) != len(answer):  # a fresh connection's buffer takes a line whole
            raise ConnectionError("the answer did not fit")

    def _check(self, hs, line):
        """The sender's proof: its name and index once it holds the secret for this hop."""
        plan = self.plan
        words = line.split()
        if len(words) != 3 or not NAME.fullmatch(words[0]) or not NUMBER.fullmatch(words[1]) \
                or not PROOF.fullmatch(words[2]):
            raise ConnectionError("a malformed proof")
        name, index = words[0], int(words[1])
        if not same(words[2], mac(plan, "up", index, plan["index"], name, hs.theirs, hs.mine)):
            raise ConnectionError("a sender without this transfer's secret, or its proof was for another hop")
        if index >= plan["index"]:
            raise ConnectionError("a sender that is not before this node in the row")
        return name, index

    def _upstream(self, hs, name, index):
        sock = hs.sock
        try:
            self._receive(sock, hs.deadline, name, index, hs.lines)
        except Exception:
            pass  # whatever the peer did ends this connection and nothing else; the chain's own senders report theirs
        finally:
            with self.cond:
                if self.up_sock is sock:
                    self.up_sock = None
            try:
                sock.close()
            except OSError:
                pass

    def _receive(self, sock, deadline, name, index, lines):
        with self.cond:
            if self.failure is not None:
                return
            if self.up_index is not None and index > self.up_index and self._upstream_alive():
                send_by(sock, deadline, "BUSY\n")
                return
            self._drop_upstream_locked(index, name)
            self.up_sock, self.up_index, self.up_name = sock, index, name
            offset = self.received
            send_by(sock, deadline, "AT {}\n".format(offset))
        sock.settimeout(None)
        data = lines.buf
        while True:
            if data and self.up_sock is sock:  # else dropped for another sender: thrown away
                self.take(offset, data, name)
            offset += len(data)
            data = sock.recv(PIECE)
            if not data:
                break

    def _upstream_alive(self):
        return self.up_index == OPERATOR or (self.up_sock is not None
                                             and time.time() - self.last_data < self.plan["stall"])

    # ---------------------------------------------------------------- forwarding

    def _forward(self):
        try:
            self._forward_each()
        except Exception as e:  # a fault of this node's own: it fails, and its sender passes over it
            self.fail("forwarding stopped: {}".format(why(e)))
        finally:
            with self.cond:
                if not self.forward_done:
                    self._fail_locked("forwarding stopped before the last node got the stream")

    def _forward_each(self):
        plan = self.plan
        for name, address, port, index in plan["downstream"]:
            if self.failure is not None:
                return
            with self.cond:
                self.next_name, self.forwarded = name, 0
            try:
                self._send_to(plan, address, int(port), int(index))
            except Taken as e:
                self.fail("passed over: {} now takes the stream from {}".format(name, e))
                return
            except SpoolError as e:
                self.fail(str(e))
                return
            except Exception as e:  # any fault of this hop, the unforeseen too: the next node is tried
                say("LOST", name, why(e))
                continue
            break
        with self.cond:
            self.forward_done = True
            self.next_name = "-"
            self.cond.notify_all()

    def _connect(self, plan, address, port, index):
        """A connection to node ``index`` at ``address:port`` once both have proven themselves, its
        lines and the offset it wants; connected again while it ends the connection unanswered."""
        stall = plan["stall"]
        deadline = time.time() + stall
        where = "{}:{}".format(address, port)
        while True:
            try:
                sock = socket.create_connection((address, port), timeout=min(max(deadline - time.time(), 0.001),
                                                                             CONNECT_TRY))
            except socket.timeout as e:
                if time.time() + AGAIN >= deadline:
                    raise ConnectionError("cannot connect to {}:{} ({}): the nodes must reach each other's ports "
                                          "during a chain, else use image.transfer: star".format(address, port, e))
                continue
            except OSError as e:
                raise ConnectionError("cannot connect to {}:{} ({}): the nodes must reach each other's ports during "
                                      "a chain, else use image.transfer: star".format(address, port, e))
            lines = Lines(sock)
            try:
                return sock, lines, self._hello(sock, lines, plan, where, index, deadline)
            except Unanswered as e:
                sock.close()
                if time.time() + AGAIN >= deadline:
                    raise ConnectionError(str(e))
                time.sleep(AGAIN)
            except BaseException:
                sock.close()
                raise

    def _send_to(self, plan, address, port, index):
        stall, size = plan["stall"], plan["size"]
        sock, lines, pos = self._connect(plan, address, port, index)
        state = {"heard": time.time(), "done": False, "taken": None, "at": pos}
        try:

            def listen():
                try:
                    while True:
                        words = lines.line().split()
                        state["heard"] = time.time()
                        if words[:1] == ["AT"] and len(words) == 2 and NUMBER.fullmatch(words[1]):
                            state["at"] = int(words[1])
                        elif words[:1] == ["DONE"]:
                            state["done"] = True
                            return
                        elif words[:1] == ["TAKEN"]:
                            state["taken"] = " ".join(words[1:]) or "another node"
                            return
                except Exception:  # the connection's end, in whatever form: silence, which the loop below bounds
                    return

            sock.settimeout(stall)  # before the listener's first recv, which takes the timeout it finds
            threading.Thread(target=listen, daemon=True).start()
            try:
                spool = open(self.path, "rb")
            except OSError as e:
                raise SpoolError("cannot read the spool file {}: {}".format(self.path, why(e)))
            with spool:
                while not state["done"]:
                    if state["taken"]:
                        raise Taken(state["taken"])
                    if time.time() - state["heard"] > stall:
                        raise ConnectionError("no word from it for {:g} s".format(stall))
                    with self.cond:
                        if self.failure is not None:
                            return
                        if self.verified <= pos:
                            self.cond.wait(TICK)
                        upto = self.verified
                    if pos < upto:
                        try:
                            spool.seek(pos)
                            data = spool.read(min(PIECE, upto - pos))
                        except OSError as e:
                            raise SpoolError("cannot read the spool file {}: {}".format(self.path, why(e)))
                        sock.sendall(data)
                        pos += len(data)
                        with self.cond:
                            self.forwarded = pos
                    elif pos >= size:
                        time.sleep(0.05)  # everything sent: wait for its DONE
        except socket.timeout:
            raise ConnectionError("it took no data for {:g} s".format(stall))
        finally:
            try:
                sock.close()
            except OSError:
                pass

    def _hello(self, sock, lines, plan, where, index, deadline):
        """The sender's half of the handshake; the offset the receiver wants the stream from."""
        mine = os.urandom(16).hex()
        try:
            send_by(sock, deadline, "CHAIN {} {}\n".format(mine, mac(plan, "hello", index, mine)))
            words = lines.line(deadline).split()
        except (Closed, ConnectionResetError, BrokenPipeError) as e:
            raise Unanswered("{} gave no proof that it is this transfer's node {} ({})".format(where, index, why(e)))
        except (OSError, ConnectionError) as e:
            raise ConnectionError("{} gave no proof that it is this transfer's node {} ({})"
                                  .format(where, index, why(e)))
        if len(words) != 2 or not NONCE.fullmatch(words[0]) \
                or not same(words[1], mac(plan, "down", index, mine, words[0])):
            raise ConnectionError("{} did not prove that it is this transfer's node {}: another program holds that "
                                  "port, or that node is not the one planned".format(where, index))
        try:
            send_by(sock, deadline, "{} {} {}\n".format(
                plan["name"], plan["index"], mac(plan, "up", plan["index"], index, plan["name"], mine, words[0])))
            first = lines.line(deadline).split()
        except (Closed, ConnectionResetError, BrokenPipeError) as e:
            raise Unanswered("{} ended the handshake ({})".format(where, why(e)))
        except (OSError, ConnectionError) as e:
            raise ConnectionError("{} ended the handshake ({})".format(where, why(e)))
        if first == ["BUSY"]:  # a node nearer the source feeds it: this one was passed over
            raise Taken("a node nearer the source")
        if len(first) != 2 or first[0] != "AT" or not NUMBER.fullmatch(first[1]) or int(first[1]) > plan["size"]:
            raise ConnectionError("{} named no offset to send from".format(where))
        return int(first[1])

    # ---------------------------------------------------------------- loading

    def _load(self):
        size = self.plan["size"]
        try:
            with open(self.path, "rb") as f:
                while self.loaded < size:
                    with self.cond:
                        while self.verified <= self.loaded and self.failure is None:
                            self.cond.wait(TICK)
                        if self.failure is not None:
                            return
                        upto = self.verified
                    f.seek(self.loaded)
                    while self.loaded < upto:
                        data = f.read(min(PIECE, upto - self.loaded))
                        self.loader.stdin.write(data)
                        self.loaded += len(data)
            self.loader.stdin.close()
        except (OSError, ValueError):
            pass  # the load command ended early: its exit status and output say why
        code = self.loader.wait()
        for t in self.echoes:
            t.join()
        with self.cond:
            self.load_exit = code
            self.cond.notify_all()

    def _echo(self, stream, tag):
        for line in stream:
            say(tag, line.decode(errors="replace").rstrip("\n"))

    # ---------------------------------------------------------------- the end

    def _beat(self):
        while True:
            with self.cond:
                if self.failure is not None:
                    return
                msg = "AT {}\n".format(self.received)
                if self.verified == self.plan["size"] and self.forward_done:
                    msg += "DONE\n"
                sock = self.up_sock
            if sock is not None:
                try:
                    sock.sendall(msg.encode())
                except OSError:
                    pass
            say("AT", self.received, self.forwarded, self.loaded, self.next_name)
            time.sleep(TICK)

    def fail(self, why):
        with self.cond:
            self._fail_locked(why)

    def _fail_locked(self, why):
        if self.failure is None:
            self.failure = why
            self.cond.notify_all()

    def finished(self):
        with self.cond:
            if self.failure is not None:
                return True
            if self.plan is not None and time.time() - self.last_data > 6 * self.plan["stall"] \
                    and self.received < self.plan["size"]:
                self._fail_locked("no data for {:g} s: the stream stopped at byte {} of {}".format(
                    6 * self.plan["stall"], self.received, self.plan["size"]))
                return True
            return self.load_exit is not None and self.forward_done

    def done(self):
        """Everything here and after here: tell the sender before the connection closes."""
        sock = self.up_sock
        if sock is not None:
            try:
                sock.sendall("AT {}\nDONE\n".format(self.received).encode())
            except OSError:
                pass
        say("AT", self.received, self.forwarded, self.loaded, "-")

    def cleanup(self):
        for closing in (self.listener, self.up_sock):
            try:
                if closing is not None:
                    closing.close()
            except OSError:
                pass
        if self.loader is not None and self.loader.poll() is None:
            self.loader.kill()  # a load cut off mid-stream registers no image
            self.loader.wait()
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def main(argv):
    spool_dir, load_argv = argv[0], argv[2:]
    relay = Relay(spool_dir, load_argv)
    say("LISTEN", relay.listener.getsockname()[1])
    threading.Thread(target=relay.serve, daemon=True).start()
    threading.Thread(target=control, args=(relay,), daemon=True).start()
    try:
        while not relay.finished():
            time.sleep(TICK / 5)
    finally:
        failure = relay.failure
        if failure is None:
            relay.done()
        relay.cleanup()
    if failure is not None:
        say("REFUSED", failure)
        return REFUSED_EXIT
    say("EXIT", relay.load_exit)
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    with OUTPUT:  # no daemon thread writes while the interpreter goes away
        sys.stdout.flush()
        os._exit(status)
