"""How a command reaches one node: one class per connection kind (hosts.yaml ``connection``).

A transport runs an argv list on one node and returns its :class:`Result`, or raises a
:class:`NodeError` (or ``OSError`` / ``EOFError``) that :func:`deploy.nodes.fanout.outcome` turns into
the node's failed result. :class:`LocalTransport` (``connection: local``) is here; the SSH one is
in ``ssh.py``, the only module that imports fabric and paramiko.
"""

from __future__ import annotations

import codecs
import logging
import shlex
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..inventory import Node

log = logging.getLogger(__name__)


def command_line(argv: Sequence[str]) -> str:
    """The exact string a remote shell receives for ``argv``."""
    return shlex.join(argv)


MAX_LINE = 1 << 20
"""The longest piece of a line a stream hands over (bytes): a program that prints megabytes
without a newline comes in pieces of this size, so that a stream's memory stays bounded."""


def each_line(readline: Callable[[int], bytes], node: str, on_line: Callable[[str, str], None]) -> str:
    """``on_line(node, line)`` for every line ``readline(limit)`` reads, until it returns ``b""``;
    the last non-empty line (what a failed command's summary shows)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a piece may end mid-character
    last = ""
    while piece := readline(MAX_LINE):
        line = decoder.decode(piece)
        line = line[:-1] if line.endswith("\n") else line
        on_line(node, line)
        last = line or last
    return last


@dataclass(frozen=True)
class Result:
    node: str
    exit_code: int | None
    """None when the command never ran (connection failure, timeout), or, in the middle of
    the preflight's two-phase session, when it is still running."""
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


class NodeError(Exception):
    """A command did not run, or did not finish, on a node; the text is its result's error."""


class TimedOut(NodeError):
    def __init__(self, seconds: float | None) -> None:
        super().__init__(f"timed out after {seconds:g} s" if seconds is not None else "timed out")


class Session:
    """A started command whose stdin stays open until :meth:`finish`."""

    def readline(self) -> bytes:
        raise NotImplementedError

    def write(self, data: bytes) -> None:
        """Write to the command's stdin, which stays open (another thread may read meanwhile)."""
        raise NotImplementedError

    def finish(self, data: bytes) -> tuple[int, bytes, bytes]:
        """Write ``data``, close stdin, read to the end: (exit code, rest of stdout, stderr)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class Transport:
    """Every way of talking to a node of one connection kind."""

    def run(self, node: Node, argv: Sequence[str], timeout: float | None) -> Result:
        """Run to the end with stdin closed; ``timeout`` bounds the whole command."""
        raise NotImplementedError

    def stream(self, node: Node, argv: Sequence[str], on_line: Callable[[str, str], None]) -> Result:
        """Run a long command or one with a large output (``logs``), calling ``on_line(node, line)``
        per line of its stdout and stderr as they come (:func:`each_line`), holding none of it; the
        result's stdout is the last line."""
        raise NotImplementedError

    def send(self, node: Node, source: Iterable[bytes], argv: Sequence[str],
             on_bytes: Callable[[int], None], timeout: float | None) -> Result:
        """Feed ``source`` to the command's stdin; ``timeout`` bounds each wait."""
        raise NotImplementedError

    def start(self, node: Node, argv: Sequence[str], timeout: float | None) -> Session:
        """Start a command whose stdin stays open; ``timeout`` bounds each wait for output."""
        raise NotImplementedError

    def close(self) -> None:
        """End everything still running or open (also from another thread, on Ctrl-C)."""


class LocalTransport(Transport):
    """``connection: local``: the argv runs on this machine with ``subprocess`` (no shell)."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()

    def run(self, node, argv, timeout):
        return _run_process(node.name, argv, timeout)

    def stream(self, node, argv, on_line):
        p = _popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._procs.add(p)
        try:
            last = each_line(p.stdout.readline, node.name, on_line)
            return Result(node.name, p.wait(), last)
        finally:
            self._procs.discard(p)

    def send(self, node, source, argv, on_bytes, timeout):
        try:
            p = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as e:
            return Result(node.name, 127, "", f"cannot run {argv[0]}: {e.strerror}")
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
            _close(p.stdin)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill(p)
            p.wait()
            raise TimedOut(timeout) from None
        for t in readers:
            t.join()
        return Result(node.name, code, b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace"))

    def start(self, node, argv, timeout):
        return _LocalSession(argv, timeout)

    def close(self) -> None:
        for p in list(self._procs):
            _kill(p)


def _popen(argv: Sequence[str], **kw) -> subprocess.Popen:
    try:
        return subprocess.Popen(list(argv), **kw)
    except OSError as e:
        raise NodeError(f"cannot run {argv[0]}: {e.strerror}") from e


class _LocalSession(Session):
    def __init__(self, argv: Sequence[str], timeout: float | None) -> None:
        self.p = _popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.timeout = timeout
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
            raise TimedOut(self.timeout)
        return line

    def write(self, data: bytes) -> None:
        self.p.stdin.write(data)
        self.p.stdin.flush()

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
            raise TimedOut(self.timeout)
        return code, rest, b"".join(self.err)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.p.poll() is None:
            _kill(self.p)
            self.p.wait()


def _run_process(name: str, argv: Sequence[str], timeout: float | None) -> Result:
    try:
        # bytes, decoded as the SSH transport decodes them: a node's output (a job's log) may hold a
        # \r (data, not a line's end: universal newlines would make it one) or invalid UTF-8
        p = subprocess.run(list(argv), capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except OSError as e:
        return Result(name, 127, "", f"cannot run {argv[0]}: {e.strerror}")
    except subprocess.TimeoutExpired:
        return Result(name, None, error=str(TimedOut(timeout)))
    return Result(name, p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))


def run_here(argv: Sequence[str], *, timeout: float | None = None) -> Result:
    """Run on the operator's machine (docker build, image inspect)."""
    log.debug("local: %s", command_line(argv))
    return _run_process("local", argv, timeout)


def _close(stream) -> None:
    """Closes a pipe to a command that may have ended without reading it (a refusal before its
    stdin): the unread rest is nobody's, and the command's exit code says what happened."""
    try:
        stream.close()
    except BrokenPipeError:
        pass


def _kill(p: subprocess.Popen) -> None:
    try:
        p.kill()
    except OSError:
        pass
