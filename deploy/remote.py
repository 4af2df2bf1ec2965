"""The only module that talks to nodes (and the only one that imports fabric).

Commands arrive as argv lists; ``command_line`` (``shlex.join``) is the single place where a
list becomes a shell string. A node with ``connection: local`` runs its argv with
``subprocess`` (no shell, no SSH). Every call runs on all nodes in parallel, returns a
:class:`Result` per node, and with ``check=True`` raises one :class:`RemoteFailure` that
carries every node's outcome.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paramiko
from fabric import Config, Connection
from invoke.exceptions import CommandTimedOut

from .errors import RemoteFailure
from .inventory import Inventory, Node

log = logging.getLogger(__name__)


def command_line(argv: Sequence[str]) -> str:
    """The exact string a remote shell receives for ``argv``."""
    return shlex.join(argv)


@dataclass(frozen=True)
class Result:
    node: str
    exit_code: int | None
    """None when the command never ran (connection failure, timeout), or, in the middle of
    :meth:`Remote.converse`, when it is still running."""
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    """Why the command did not run: 'unreachable: ...', 'auth refused: ...', 'host key ...'."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def connected(self) -> bool:
        return self.error is None

    def summary(self) -> str:
        if self.error:
            return self.error
        last = (self.stderr.strip() or self.stdout.strip()).splitlines()
        tail = last[-1] if last else "no output"
        return f"exit {self.exit_code}: {tail}"


class _ConnectError(Exception):
    pass


class Remote:
    """Connections to the inventory's nodes, opened lazily, one per node, reused."""

    def __init__(self, inv: Inventory, *, max_workers: int = 32) -> None:
        self.inv = inv
        self.max_workers = max_workers
        self._conns: dict[str, Connection] = {}
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for p in list(self._procs):
            _kill(p)
        for c in self._conns.values():
            try:
                c.close()
            except Exception:  # closing is best effort
                log.debug("close failed", exc_info=True)
        self._conns.clear()

    # ------------------------------------------------------------------ public API

    def run(
        self,
        commands: Mapping[str, Sequence[str]],
        *,
        what: str = "command",
        timeout: float | None = None,
        check: bool = True,
        hint: str | None = None,
        stdin: Mapping[str, bytes] | None = None,
    ) -> dict[str, Result]:
        """Run ``commands[node] `` on each named node in parallel; ``stdin[node]``, if given, is
        that command's whole stdin (for values that must not be on a command line)."""
        def one(n: str, argv: Sequence[str]) -> Result:
            if stdin is not None and n in stdin:
                return self.send(n, [stdin[n]], argv, timeout=timeout)
            return self._run_one(n, argv, timeout)

        results = self._parallel(commands, one)
        if check and not all(r.ok for r in results.values()):
            raise RemoteFailure(what, results, hint=hint)
        return results

    def run_all(self, argv: Sequence[str], **kw) -> dict[str, Result]:
        return self.run({n.name: argv for n in self.inv.nodes}, **kw)

    def stream(
        self,
        commands: Mapping[str, Sequence[str]],
        on_line: Callable[[str, str], None],
    ) -> dict[str, Result]:
        """Run long commands (``logs --follow``), calling ``on_line(node, line)`` per line."""
        return self._parallel(commands, lambda n, argv: self._stream_one(n, argv, on_line))

    def send(
        self,
        node: str,
        source: Iterable[bytes],
        argv: Sequence[str],
        on_bytes: Callable[[int], None] = lambda n: None,
        timeout: float | None = None,
    ) -> Result:
        """Feed ``source`` to the stdin of ``argv`` on ``node`` (e.g. ``docker load``); ``timeout``
        bounds each wait on the connection (seconds)."""
        n = self.inv.node(node)
        log.debug("%s: %s < stdin", node, command_line(argv))
        try:
            if n.connection == "local":
                return _send_local(node, source, argv, on_bytes, timeout)
            conn = self._connect(n)
            chan = conn.transport.open_session()
            chan.settimeout(timeout)
            chan.exec_command(command_line(argv))
            for chunk in source:
                chan.sendall(chunk)
                on_bytes(len(chunk))
            chan.shutdown_write()
            out = chan.makefile("rb").read().decode(errors="replace")
            err = chan.makefile_stderr("rb").read().decode(errors="replace")
            return Result(node, chan.recv_exit_status(), out, err)
        except _ConnectError as e:
            return Result(node, None, error=str(e))
        except TimeoutError:
            return Result(node, None, error=f"timed out after {timeout:g} s")
        except (OSError, paramiko.SSHException) as e:
            return Result(node, None, error=f"transfer broke: {e}")

    def converse(
        self,
        commands: Mapping[str, Sequence[str]],
        *,
        marker: str,
        reply: Callable[[dict[str, Result]], Sequence[Mapping[str, str]]],
        timeout: float | None = None,
    ) -> dict[str, Result]:
        """Run commands whose stdin stays open, in two phases with one barrier between them.

        Once every node has printed the line ``marker`` (or ended, or failed to start),
        ``reply`` gets each node's output so far (``exit_code`` None while it still runs) and
        returns waves of ``{node: text}``: each wave's nodes get their text on stdin, then EOF,
        and are read to the end before the next wave starts; nodes in no wave get EOF last.
        Each node's final :class:`Result` holds its whole output except the marker line. One
        command per node however many phases: a login shell that is slow to start starts once.
        ``timeout`` bounds each wait for output.
        """
        sessions: dict[str, _Session] = {}
        first: dict[str, Result] = {}

        def start(node: str, argv: Sequence[str]) -> Result:
            log.debug("%s: %s", node, command_line(argv))
            n = self.inv.node(node)
            s = _LocalSession(argv, timeout) if n.connection == "local" else _SshSession(self._connect(n), argv, timeout)
            sessions[node] = s
            lines = []
            try:
                while raw := s.readline():
                    line = raw.decode(errors="replace")
                    if line.rstrip("\n") == marker:
                        return Result(node, None, "".join(lines))
                    lines.append(line)
            except BaseException:
                sessions.pop(node).close()
                raise
            code, _, err = sessions.pop(node).finish(b"")
            return Result(node, code, "".join(lines), err.decode(errors="replace"))

        def finish(node: str, text: str) -> Result:
            s = sessions.pop(node)
            code, rest, err = s.finish(text.encode())
            return Result(node, code, first[node].stdout + rest.decode(errors="replace"), err.decode(errors="replace"))

        try:
            first.update(self._parallel(commands, lambda n, argv: _session_call(n, timeout, start, argv)))
            final = {n: r for n, r in first.items() if n not in sessions}
            for wave in [*reply(dict(first)), {n: "" for n in commands}]:
                todo = {n: text for n, text in wave.items() if n in sessions}
                final.update(self._parallel(todo, lambda n, text: _session_call(n, timeout, finish, text)))
        finally:
            for s in sessions.values():
                s.close()
        return {n: final[n] for n in commands}

    def parallel(self, nodes: Sequence[str], fn: Callable[[str], Result]) -> dict[str, Result]:
        """Run ``fn(node)`` for each node in the thread pool (for callers composing calls)."""
        return self._parallel({n: () for n in nodes}, lambda n, _argv: fn(n))

    # ------------------------------------------------------------------ internals

    def _parallel(self, commands, fn) -> dict[str, Result]:
        if not commands:
            return {}
        workers = min(self.max_workers, len(commands))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="remote")
        try:
            futures = {node: pool.submit(self._guard, fn, node, argv) for node, argv in commands.items()}
            results = {node: f.result() for node, f in futures.items()}
        except BaseException:
            # Ctrl-C (or any end) while threads wait on nodes (a follow, a dead node): waiting
            # for them would take a second Ctrl-C. Closing the connections and processes they
            # read from ends them now.
            pool.shutdown(wait=False, cancel_futures=True)
            self.close()
            raise
        pool.shutdown()
        return results

    @staticmethod
    def _guard(fn, node, argv) -> Result:
        try:
            return fn(node, argv)
        except Exception as e:  # one node's surprise must not hide the others' results
            log.debug("unexpected error on %s", node, exc_info=True)
            return Result(node, None, error=f"{type(e).__name__}: {e}")

    def _run_one(self, node: str, argv: Sequence[str], timeout: float | None) -> Result:
        n = self.inv.node(node)
        log.debug("%s: %s", node, command_line(argv))
        if n.connection == "local":
            try:
                p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                   stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                return Result(node, None, error=f"timed out after {timeout:g} s")
            except OSError as e:
                return Result(node, 127, "", f"cannot run {argv[0]}: {e.strerror}")
            return Result(node, p.returncode, p.stdout, p.stderr)
        try:
            conn = self._connect(n)
            r = conn.run(command_line(argv), hide=True, warn=True, in_stream=False, timeout=timeout)
            return Result(node, r.exited, r.stdout, r.stderr)
        except _ConnectError as e:
            return Result(node, None, error=str(e))
        except CommandTimedOut:
            return Result(node, None, error=f"timed out after {timeout:g} s")
        except (OSError, paramiko.SSHException) as e:
            return Result(node, None, error=f"connection lost: {e}")

    def _stream_one(self, node: str, argv: Sequence[str], on_line) -> Result:
        n = self.inv.node(node)
        if n.connection == "local":
            p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, text=True, errors="replace")
            self._procs.add(p)
            try:
                for line in p.stdout:
                    on_line(node, line.rstrip("\n"))
                return Result(node, p.wait())
            finally:
                self._procs.discard(p)
        try:
            conn = self._connect(n)
            writer = _LineWriter(node, on_line)
            r = conn.run(command_line(argv), hide=False, warn=True, in_stream=False,
                         out_stream=writer, err_stream=writer)
            writer.flush_rest()
            return Result(node, r.exited)
        except _ConnectError as e:
            return Result(node, None, error=str(e))
        except (OSError, paramiko.SSHException, EOFError) as e:
            return Result(node, None, error=f"connection lost: {e}")

    def _connect(self, n: Node) -> Connection:
        with self._lock:
            conn = self._conns.get(n.name)
            if conn is None:
                conn = self._conns[n.name] = self._new_connection(n)
        if not conn.is_connected:
            _open(conn, n, self.inv)
        return conn

    def _new_connection(self, n: Node) -> Connection:
        s = self.inv.ssh_for(n)
        connect_kwargs: dict = {"allow_agent": True, "look_for_keys": False}
        if s.key:
            connect_kwargs["key_filename"] = [os.path.expanduser(s.key)]
        config = Config(overrides={"load_ssh_configs": False})
        conn = Connection(n.address, user=s.user, port=s.port, config=config,
                          connect_timeout=s.connect_timeout, connect_kwargs=connect_kwargs)
        known = Path(os.path.expanduser(s.known_hosts))
        if s.host_key_policy == "accept-new":
            known.parent.mkdir(parents=True, exist_ok=True)
            known.touch(mode=0o600, exist_ok=True)
            # A *changed* key still raises BadHostKeyException whatever the policy.
            conn.client.set_missing_host_key_policy(_AcceptNew(known))
        else:
            conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        if known.exists():
            conn.client.load_host_keys(str(known))
        return conn


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Records an unknown host key by appending its line to known_hosts under a lock.

    paramiko's AutoAddPolicy rewrites the whole file from each connection's own copy, so nodes
    met for the first time in parallel overwrite one another's keys.
    """

    _lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path

    def missing_host_key(self, client, hostname, key) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        line = paramiko.hostkeys.HostKeyEntry([hostname], key).to_line()
        with self._lock, open(self.path, "a") as fh:
            fh.write(line)


def _open(conn: Connection, n: Node, inv: Inventory) -> None:
    s = inv.ssh_for(n)
    where = f"{s.user}@{n.address}:{s.port}"
    try:
        conn.open()
    except paramiko.BadHostKeyException as e:
        raise _ConnectError(
            f"host key mismatch for {where} (got {e.key.get_name()}; check {s.known_hosts}: "
            "the host was reinstalled or this is not the host you think)") from e
    except paramiko.AuthenticationException as e:
        raise _ConnectError(f"auth refused for {where} (key {s.key or 'from agent'}: {e})") from e
    except paramiko.SSHException as e:
        if "not found in known_hosts" in str(e):
            raise _ConnectError(
                f"host key unknown for {where} (add it to {s.known_hosts}, e.g. ssh-keyscan, "
                "or set ssh.host_key_policy: accept-new)") from e
        raise _ConnectError(f"ssh failed for {where}: {e}") from e
    except FileNotFoundError as e:
        raise _ConnectError(f"ssh key not found: {e.filename}") from e
    except (socket.timeout, TimeoutError) as e:
        raise _ConnectError(f"unreachable: {where} timed out after {s.connect_timeout} s") from e
    except OSError as e:
        raise _ConnectError(f"unreachable: {where} ({e.strerror or e})") from e


class _LineWriter:
    """A file-like sink for invoke's out_stream that hands over whole lines."""

    def __init__(self, node: str, on_line) -> None:
        self.node, self.on_line, self.buf = node, on_line, ""
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            self.buf += text
            *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self.on_line(self.node, line)

    def flush(self) -> None:
        pass

    def flush_rest(self) -> None:
        if self.buf:
            self.on_line(self.node, self.buf)
            self.buf = ""


def _session_call(node: str, timeout: float | None, fn, arg) -> Result:
    try:
        return fn(node, arg)
    except _ConnectError as e:
        return Result(node, None, error=str(e))
    except (socket.timeout, TimeoutError):
        return Result(node, None, error=f"timed out after {timeout:g} s")
    except (OSError, paramiko.SSHException, EOFError) as e:
        return Result(node, None, error=f"connection lost: {e}")


class _Session:
    """A started command whose stdin stays open until :meth:`finish`."""

    def readline(self) -> bytes:
        raise NotImplementedError

    def finish(self, data: bytes) -> tuple[int, bytes, bytes]:
        """Write ``data``, close stdin, read to the end: (exit code, rest of stdout, stderr)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _SshSession(_Session):
    def __init__(self, conn: Connection, argv: Sequence[str], timeout: float | None) -> None:
        self.chan = conn.transport.open_session()
        self.chan.settimeout(timeout)
        self.chan.exec_command(command_line(argv))
        self.out = self.chan.makefile("rb")

    def readline(self) -> bytes:
        return self.out.readline()

    def finish(self, data: bytes) -> tuple[int, bytes, bytes]:
        try:
            if data:
                self.chan.sendall(data)
            self.chan.shutdown_write()
            rest = self.out.read()
            err = self.chan.makefile_stderr("rb").read()
            return self.chan.recv_exit_status(), rest, err
        finally:
            self.chan.close()

    def close(self) -> None:
        self.chan.close()


class _LocalSession(_Session):
    def __init__(self, argv: Sequence[str], timeout: float | None) -> None:
        try:
            self.p = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)
        except OSError as e:
            raise _ConnectError(f"cannot run {argv[0]}: {e.strerror}") from e
        self.expired = False
        self.err: list[bytes] = []
        self.reader = threading.Thread(target=lambda: self.err.append(self.p.stderr.read()), daemon=True)
        self.reader.start()
        self.timer = None
        if timeout is not None:
            self.timer = threading.Timer(timeout, self._expire)
            self.timer.start()

    def _expire(self) -> None:
        self.expired = True
        _kill(self.p)

    def readline(self) -> bytes:
        line = self.p.stdout.readline()
        if self.expired:
            raise TimeoutError
        return line

    def finish(self, data: bytes) -> tuple[int, bytes, bytes]:
        try:
            self.p.stdin.write(data)
            self.p.stdin.close()
        except BrokenPipeError:
            pass
        rest = self.p.stdout.read()
        code = self.p.wait()
        self.reader.join()
        self.close()
        if self.expired:
            raise TimeoutError
        return code, rest, b"".join(self.err)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.p.poll() is None:
            _kill(self.p)
            self.p.wait()


def _send_local(node: str, source: Iterable[bytes], argv: Sequence[str], on_bytes, timeout: float | None = None) -> Result:
    try:
        p = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        return Result(node, 127, "", f"cannot run {argv[0]}: {e.strerror}")
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [threading.Thread(target=lambda s=s, b=b: b.append(s.read()), daemon=True)
               for s, b in ((p.stdout, out), (p.stderr, err))]
    for t in readers:
        t.start()
    try:
        for chunk in source:
            p.stdin.write(chunk)
            on_bytes(len(chunk))
    except BrokenPipeError:
        pass
    finally:
        p.stdin.close()
    try:
        code = p.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill(p)
        p.wait()
        return Result(node, None, error=f"timed out after {timeout:g} s")
    for t in readers:
        t.join()
    return Result(node, code, b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace"))


def run_here(argv: Sequence[str], *, timeout: float | None = None) -> Result:
    """Run on the operator's machine (docker build, image inspect)."""
    log.debug("local: %s", command_line(argv))
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except OSError as e:
        return Result("local", 127, "", f"cannot run {argv[0]}: {e.strerror}")
    except subprocess.TimeoutExpired:
        return Result("local", None, error=f"timed out after {timeout:g} s")
    return Result("local", p.returncode, p.stdout, p.stderr)


def _kill(p: subprocess.Popen) -> None:
    try:
        p.kill()
    except OSError:
        pass
