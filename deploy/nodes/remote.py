"""The one way the tool talks to nodes: per-node results and one combined error.

Commands arrive as argv lists; ``command_line`` (``shlex.join``) is the single place where a
list becomes a shell string. Each node's ``connection`` picks its transport (``transport.py``:
local; ``ssh.py``: SSH); ``fanout.py`` runs every call on all nodes in parallel and returns a
:class:`Result` per node; with ``check=True`` a failure raises one :class:`RemoteFailure` that
carries every node's outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from ..errors import RemoteFailure
from ..inventory import Inventory, Node
from .fanout import fan_out, outcome
from .ssh import SshTransport
from .transport import LocalTransport, Result, Session, Transport, command_line, run_here

__all__ = ["Remote", "Result", "Session", "command_line", "run_here"]

log = logging.getLogger(__name__)


class Remote:
    """Connections to the inventory's nodes, opened lazily, one per node, reused."""

    def __init__(self, inv: Inventory, *, max_workers: int = 32) -> None:
        self.inv = inv
        self.max_workers = max_workers
        self._transports: dict[str, Transport] = {"local": LocalTransport()}
        if "ssh" in _connections(inv):  # only then: SSH's libraries take a tenth of a second to import
            self._transports["ssh"] = SshTransport(inv)

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for t in self._transports.values():
            t.close()

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
        """Run ``commands[node]`` on each named node in parallel; ``stdin[node]``, if given, is
        that command's whole stdin (for values that must not be on a command line)."""
        def one(node: str, argv: Sequence[str]) -> Result:
            if stdin is not None and node in stdin:
                return self.send(node, [stdin[node]], argv, timeout=timeout)
            log.debug("%s: %s", node, command_line(argv))
            return self._via(node).run(self.inv.node(node), argv, timeout)

        results = self._fan_out(commands, one)
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
        """Run long commands, or ones with large outputs (``logs``), calling ``on_line(node, line)``
        per line as it comes; none of the output is kept (a result's stdout is its last line)."""
        return self._fan_out(commands, lambda n, argv: self._via(n).stream(self.inv.node(n), argv, on_line))

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
        log.debug("%s: %s < stdin", node, command_line(argv))
        return outcome(node, self._via(node).send, self.inv.node(node), source, argv, on_bytes, timeout)

    def start(self, node: str, argv: Sequence[str], timeout: float | None = None) -> Session:
        """Start ``argv`` on ``node`` with its stdin kept open (preflight's two-phase session);
        raises what :func:`deploy.nodes.fanout.outcome` turns into the node's result."""
        log.debug("%s: %s", node, command_line(argv))
        return self._via(node).start(self.inv.node(node), argv, timeout)

    def parallel(self, nodes: Sequence[str], fn: Callable[[str], Result]) -> dict[str, Result]:
        """Run ``fn(node)`` for each node in the thread pool (for callers composing calls)."""
        return self._fan_out({n: () for n in nodes}, lambda n, _argv: fn(n))

    def _via(self, node: str) -> Transport:
        n: Node = self.inv.node(node)
        return self._transports[n.connection]

    def _fan_out(self, work, fn) -> dict[str, Result]:
        return fan_out(work, fn, max_workers=self.max_workers, on_abort=self.close)


def _connections(inv: Inventory) -> set[str]:
    """How the nodes a Remote can reach are reached: the nodes' and spares', and on Slurm the login
    node's."""
    kinds = {n.connection for n in (*inv.nodes, *inv.spares)}
    if inv.slurm is not None:
        kinds.add(inv.slurm.login.connection)
    return kinds
