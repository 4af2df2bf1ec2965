"""The SSH transport: the only module that imports fabric and paramiko, and only when it is used
(they take a tenth of a second to import: a command that reaches no node over SSH never pays it).

Where a node is reached: its ``ssh.host`` (else its ``address``) looked up in ``ssh.config``
(the operator's ``~/.ssh/config``: HostName, User, Port, IdentityFile, ProxyJump, ProxyCommand,
ConnectTimeout, ServerAliveInterval/CountMax). hosts.yaml's own user, port, key and
connect_timeout, where written, win over that file; hosts.yaml's defaults lose to it. Fabric is
never let to read SSH configs itself: it would read the system-wide file too, add the file's
keys to the ones hosts.yaml names, and open jump hosts with its own accept-any-key policy; here
every hop is checked against ``known_hosts`` with the same policy as the node.

A node that stops answering costs ``connect_timeout`` seconds (default 10), not a command's
whole timeout: the TCP connect, the SSH banner, auth and each channel open are bounded by it,
and an open connection sends a keepalive every third of it and is closed when a reply has not
come for the whole of it (OpenSSH's ServerAliveInterval and ServerAliveCountMax, which the
config file may set).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..inventory import Inventory, Node, Ssh
from .transport import NodeError, Result, Session, TimedOut, Transport, command_line, each_line

if TYPE_CHECKING:
    import paramiko
    from fabric import Connection

log = logging.getLogger(__name__)

MAX_HOPS = 8
KEEPALIVES_MISSED = 3
"""Unanswered keepalives after which a connection is given up (OpenSSH's ServerAliveCountMax)."""


@dataclass(frozen=True)
class Endpoint:
    """One SSH hop, resolved: what paramiko connects to and how."""

    host: str
    port: int
    user: str
    keys: tuple[str, ...]
    timeout: int
    alive_interval: float
    alive_count: int
    via: "Endpoint | str | None" = None
    """The jump host this hop is reached through, a ProxyCommand, or None (direct)."""

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def silence(self) -> float:
        return self.alive_interval * self.alive_count


def read_config(path: str | None) -> paramiko.SSHConfig:
    import paramiko

    p = Path(os.path.expanduser(path)) if path else None
    if p is None or not p.is_file():
        return paramiko.SSHConfig()
    return paramiko.SSHConfig.from_path(str(p))


def endpoint(inv: Inventory, node: Node, config: paramiko.SSHConfig) -> Endpoint:
    """Where and how ``node`` is reached over SSH, after ``ssh.config``."""
    s = inv.ssh_for(node)
    explicit = set(inv.ssh.model_fields_set)
    if node.ssh is not None:
        explicit |= node.ssh.model_dump(exclude_none=True).keys()
    name = node.ssh.host if node.ssh is not None and node.ssh.host else node.address
    return _resolve(name, s, explicit, config, 0)


def _resolve(name: str, s: Ssh, explicit: set[str], config: paramiko.SSHConfig, depth: int) -> Endpoint:
    if depth > MAX_HOPS:
        raise NodeError(f"unreachable: more than {MAX_HOPS} ProxyJump hops to {name} (a loop in {s.config}?)")
    c = config.lookup(name)

    def pick(field: str, key: str):
        if field in explicit or key not in c:
            return getattr(s, field)
        return int(c[key]) if field in ("port", "connect_timeout") else c[key]

    timeout = pick("connect_timeout", "connecttimeout")
    if "key" in explicit or "identityfile" not in c:
        keys = (s.key,) if s.key else ()
    else:
        keys = tuple(c["identityfile"])
    interval = float(c.get("serveraliveinterval", 0)) or timeout / KEEPALIVES_MISSED
    ep = Endpoint(host=c.get("hostname", name), port=pick("port", "port"), user=pick("user", "user"),
                  keys=tuple(os.path.expanduser(k) for k in keys), timeout=timeout, alive_interval=interval,
                  alive_count=int(c.get("serveralivecountmax", KEEPALIVES_MISSED)))
    jump = c.get("proxyjump", "none")
    if jump.lower() != "none":
        via = None
        for hop in jump.split(","):
            user, host, port = _hop(hop)
            if config.lookup(host).get("hostname", host) == ep.host:  # a wildcard Host matched the jump host
                return ep
            # A jump host is reached with the nodes' settings, unless the config names its own.
            h = _resolve(host, s, set(), config, depth + 1)
            h = replace(h, user=user or h.user, port=port or h.port)
            via = h if via is None else replace(h, via=via)
        return replace(ep, via=via)
    if c.get("proxycommand", "none").lower() != "none":
        return replace(ep, via=c["proxycommand"])
    return ep


def _hop(spec: str) -> tuple[str | None, str, int | None]:
    """``[ssh://][user@]host[:port]`` of a ProxyJump entry."""
    spec = spec.strip().removeprefix("ssh://")
    user, _, hostport = spec.rpartition("@")
    host, port = hostport, None
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else None
    elif hostport.count(":") == 1:
        host, p = hostport.split(":")
        port = int(p)
    return user or None, host, port


class SshTransport(Transport):
    """One connection per hop (node or jump host), opened lazily, shared, kept alive."""

    def __init__(self, inv: Inventory) -> None:
        self.inv = inv
        self.config = read_config(inv.ssh.config)
        self._conns: dict[Endpoint, Connection] = {}
        self._opening: dict[Endpoint, threading.Lock] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ commands

    def run(self, node, argv, timeout):
        conn = self._connect(node)
        with _talking(conn, "connection lost", timeout):
            r = conn.run(command_line(argv), hide=True, warn=True, in_stream=False, timeout=timeout)
        _still_there(conn)
        return Result(node.name, r.exited, r.stdout, r.stderr)

    def stream(self, node, argv, on_line):
        # A channel of its own, not fabric's run: invoke keeps every byte of the output for its
        # result, which is the whole log for `logs`.
        conn = self._connect(node)
        with _talking(conn, "connection lost", None):
            chan = conn.transport.open_session()
            try:
                chan.set_combine_stderr(True)
                chan.exec_command(command_line(argv))
                last = each_line(chan.makefile("rb").readline, node.name, on_line)
                code = chan.recv_exit_status()
            finally:
                chan.close()
        _still_there(conn)
        return Result(node.name, code, last)

    def send(self, node, source, argv, on_bytes, timeout):
        conn = self._connect(node)
        with _talking(conn, "transfer broke", timeout):
            chan = conn.transport.open_session()
            chan.settimeout(timeout)
            chan.exec_command(command_line(argv))
            for chunk in source:
                chan.sendall(chunk)
                on_bytes(len(chunk))
            chan.shutdown_write()
            out = chan.makefile("rb").read().decode(errors="replace")
            err = chan.makefile_stderr("rb").read().decode(errors="replace")
            code = chan.recv_exit_status()
        _still_there(conn)
        return Result(node.name, code, out, err)

    def start(self, node, argv, timeout):
        conn = self._connect(node)
        with _talking(conn, "connection lost", timeout):
            return _SshSession(conn, argv, timeout)

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for c in reversed(conns):  # nodes before the jump hosts they go through
            try:
                c.close()
            except Exception:  # closing is best effort
                log.debug("close failed", exc_info=True)

    # ------------------------------------------------------------------ connections

    def _connect(self, node: Node) -> Connection:
        return self._open(endpoint(self.inv, node, self.config), self.inv.ssh_for(node))

    def _open(self, ep: Endpoint, s: Ssh) -> Connection:
        with self._lock:
            opening = self._opening.setdefault(ep, threading.Lock())
        with opening:  # a jump host shared by several nodes is opened once
            conn = self._conns.get(ep)
            if conn is not None and conn.is_connected:
                return conn
            if conn is not None:
                conn.close()
            gateway = ep.via or False
            if isinstance(ep.via, Endpoint):
                try:
                    gateway = self._open(ep.via, s)
                except NodeError as e:
                    raise NodeError(f"{e} (the jump host to {ep.where})") from e
            conn = _connection(ep, s, gateway)
            _login(conn, ep, s)
            with self._lock:
                self._conns[ep] = conn
            _Keepalive(conn.transport, ep).start()
            return conn


def _connection(ep: Endpoint, s: Ssh, gateway) -> Connection:
    import paramiko
    from fabric import Config, Connection

    connect_kwargs: dict = {"allow_agent": True, "look_for_keys": False, "banner_timeout": ep.timeout,
                            "auth_timeout": ep.timeout, "channel_timeout": ep.timeout}
    if ep.keys:
        connect_kwargs["key_filename"] = list(ep.keys)
    conn = Connection(ep.host, user=ep.user, port=ep.port, config=Config(overrides={"load_ssh_configs": False}),
                      gateway=gateway, connect_timeout=ep.timeout, connect_kwargs=connect_kwargs)
    known = Path(os.path.expanduser(s.known_hosts))
    if s.host_key_policy == "accept-new":
        known.parent.mkdir(parents=True, exist_ok=True)
        known.touch(mode=0o600, exist_ok=True)
        # A *changed* key still raises BadHostKeyException whatever the policy.
        conn.client.set_missing_host_key_policy(_accept_new()(known))
    else:
        conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    if known.exists():
        conn.client.load_host_keys(str(known))
    return conn


def _login(conn: Connection, ep: Endpoint, s: Ssh) -> None:
    import paramiko

    where = ep.where
    started = time.monotonic()
    try:
        conn.open()
    except paramiko.BadHostKeyException as e:
        raise NodeError(
            f"host key mismatch for {where} (got {e.key.get_name()}; check {s.known_hosts}: "
            "the host was reinstalled or this is not the host you think)") from e
    except paramiko.AuthenticationException as e:
        if "timeout" in str(e).lower():
            raise NodeError(f"unreachable: {where} did not finish logging in within {ep.timeout} s") from e
        raise NodeError(f"auth refused for {where} (key {', '.join(ep.keys) or 'from agent'}: {e})") from e
    except paramiko.SSHException as e:
        if "not found in known_hosts" in str(e):
            raise NodeError(
                f"host key unknown for {where} (add it to {s.known_hosts}, e.g. ssh-keyscan, "
                "or set ssh.host_key_policy: accept-new)") from e
        if "banner" in str(e) or time.monotonic() - started >= ep.timeout - 0.5:  # "No existing session"
            raise NodeError(f"unreachable: {where} did not answer within {ep.timeout} s") from e
        raise NodeError(f"ssh failed for {where}: {e}") from e
    except FileNotFoundError as e:
        raise NodeError(f"ssh key not found: {e.filename}") from e
    except (socket.timeout, TimeoutError) as e:
        raise NodeError(f"unreachable: {where} timed out after {ep.timeout} s") from e
    except OSError as e:
        raise NodeError(f"unreachable: {where} ({e.strerror or e})") from e


_KNOWN_HOSTS_LOCK = threading.Lock()
"""Held while a host key is appended to a known_hosts file."""


@functools.cache
def _accept_new() -> type[paramiko.MissingHostKeyPolicy]:
    """The accept-new policy's class, made when first needed (it is a paramiko class)."""
    import paramiko

    class _AcceptNew(paramiko.MissingHostKeyPolicy):
        """Records an unknown host key by appending its line to known_hosts under a lock.

        paramiko's AutoAddPolicy rewrites the whole file from each connection's own copy, so nodes
        met for the first time in parallel overwrite one another's keys.
        """

        def __init__(self, path: Path) -> None:
            self.path = path

        def missing_host_key(self, client, hostname, key) -> None:
            client.get_host_keys().add(hostname, key.get_name(), key)
            line = paramiko.hostkeys.HostKeyEntry([hostname], key).to_line()
            with _KNOWN_HOSTS_LOCK, open(self.path, "a") as fh:
                fh.write(line)

    return _AcceptNew


class _Keepalive(threading.Thread):
    """Asks the server for a reply every ``alive_interval`` seconds and closes the connection
    when one has not come for ``silence`` seconds, which ends every wait on it at once.

    (paramiko's own ``set_keepalive`` asks for no reply, so it never notices a silent node.)
    """

    def __init__(self, transport: paramiko.Transport, ep: Endpoint) -> None:
        super().__init__(daemon=True, name=f"keepalive {ep.where}")
        self.transport, self.ep = transport, ep

    def run(self) -> None:
        t = self.transport
        while t.is_active():
            answered = threading.Event()
            threading.Thread(target=self._ask, args=(answered,), daemon=True).start()
            if not answered.wait(self.ep.silence):
                _give_up(t, f"{self.ep.where} stopped answering (no reply to keepalives for {self.ep.silence:g} s)")
                return
            time.sleep(self.ep.alive_interval)

    def _ask(self, answered: threading.Event) -> None:
        try:
            self.transport.global_request("keepalive@openssh.com", wait=True)
        except Exception:  # a closed transport: the loop sees it
            pass
        answered.set()


@contextlib.contextmanager
def _talking(conn: Connection, lost: str, timeout: float | None) -> Iterator[None]:
    """paramiko's and invoke's exceptions, as the transport's own."""
    import paramiko
    from invoke.exceptions import CommandTimedOut

    try:
        yield
    except CommandTimedOut:
        raise TimedOut(timeout) from None
    except (socket.timeout, TimeoutError):
        raise TimedOut(timeout) from None
    except (OSError, EOFError, paramiko.SSHException) as e:
        if "Timeout opening channel" in str(e):  # the next call connects again
            _give_up(conn.transport, f"{conn.user}@{conn.host}:{conn.port} did not open a channel "
                                     f"within {conn.transport.channel_timeout:g} s")
        raise NodeError(f"{lost}: {_silence(conn) or str(e) or type(e).__name__}") from e


def _give_up(t: paramiko.Transport, why: str) -> None:
    """Close a connection to a silent node, which ends every wait on it, and say why."""
    t.ddp_silent = why
    log.debug("closing: %s", why)
    t.close()


def _silence(conn: Connection) -> str | None:
    return getattr(conn.transport, "ddp_silent", None)


def _still_there(conn: Connection) -> None:
    """A connection closed under a command reads as exit status -1: say why instead."""
    why = _silence(conn)
    if why:
        raise NodeError(f"connection lost: {why}")


class _SshSession(Session):
    def __init__(self, conn: Connection, argv, timeout: float | None) -> None:
        self.conn, self.timeout = conn, timeout
        self.chan = conn.transport.open_session()
        self.chan.settimeout(timeout)
        self.chan.exec_command(command_line(argv))
        self.out = self.chan.makefile("rb")

    def readline(self) -> bytes:
        with _talking(self.conn, "connection lost", self.timeout):
            return self.out.readline()

    def write(self, data: bytes) -> None:
        with _talking(self.conn, "connection lost", self.timeout):
            self.chan.sendall(data)

    def finish(self, data: bytes) -> tuple[int, bytes, bytes]:
        try:
            with _talking(self.conn, "connection lost", self.timeout):
                if data:
                    self.chan.sendall(data)
                self.chan.shutdown_write()
                rest = self.out.read()
                err = self.chan.makefile_stderr("rb").read()
                code = self.chan.recv_exit_status()
            _still_there(self.conn)
            return code, rest, err
        finally:
            self.chan.close()

    def close(self) -> None:
        self.chan.close()
