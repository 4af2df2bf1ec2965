"""The fleet lock: one operator at a time on a fleet.

``launch`` and ``deploy`` take a lock on every node of the inventory, one node after the other
in one canonical order (node address, then ssh port: two inventories naming the same machines
in another order or under other names agree), stopping at the first node that refuses and
releasing, in reverse, the nodes already taken. Two operators racing for the same (or
overlapping) fleets meet first on the lowest node they share, so exactly one of them proceeds.

On a node the lock is the directory ``LOCK_PATH``, made atomically by ``mkdir``, holding
``owner`` (JSON: who, which command and job, a random token; only the holder of the token
releases it) and ``heartbeat``, touched every ``HEARTBEAT_EVERY`` seconds while it is held.
/tmp because every ssh user can create it there, it is per machine (nodes sharing the lock
directory, as local nodes of one machine do, are one node for the lock), and a reboot clears it.

A lock is stale when its heartbeat is older than ``STALE_AFTER`` (measured with the node's own
clock), or its holder ran on this machine and that process has ended. A stale lock is refused
like a live one, never taken over: ``ddp-deploy unlock`` clears it.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone

from .errors import RuntimeFailure
from .inventory import Inventory, Node
from .remote import Remote, Result

log = logging.getLogger(__name__)

LOCK_PATH = "/tmp/ddp-deploy.lock"
PATH_ENV = "DDP_DEPLOY_LOCK_PATH"
"""Another lock directory (the tests' own); ``{address}`` in it becomes each node's address."""
HEARTBEAT_EVERY = 10
STALE_AFTER = 60
UNLOCK = "`ddp-deploy unlock`"

# $1 = lock directory. Prints "held TAKEN QUIET" (seconds since the lock was taken and since its
# last heartbeat, on this node's clock) and then the owner file; fails when there is no lock.
_HELD = r"""held() {
  taken=$(stat -c %Y "$1/owner" 2>/dev/null || stat -c %Y "$1" 2>/dev/null) || return 1
  beat=$(stat -c %Y "$1/heartbeat" 2>/dev/null || echo "$taken")
  now=$(date +%s)
  echo "held $((now - taken)) $((now - beat))"
  cat "$1/owner" 2>/dev/null
  return 0
}
"""

# $1 = lock directory. What `held` prints, or "free".
LOOK = _HELD + 'held "$1" || echo free\n'

# $1 = lock directory, stdin = the owner JSON. Prints "taken", or what `held` prints about the
# lock already there (a lock that vanishes meanwhile is tried again).
TAKE = _HELD + r"""umask 022
lock=$1; owner=$(cat)
for _ in 1 2 3; do
  if err=$(mkdir -m 755 "$lock" 2>&1); then
    printf '%s\n' "$owner" > "$lock/owner.tmp" && touch "$lock/heartbeat" && mv "$lock/owner.tmp" "$lock/owner" || exit 1
    echo taken; exit 0
  fi
  held "$lock" && exit 0
done
echo "$err" >&2; exit 1
"""

# $1 = lock directory, $2 = token. Refreshes the heartbeat of our own lock only.
BEAT = 'grep -qsF -e "$2" "$1/owner" && touch "$1/heartbeat"'

# $1 = lock directory, $2 = the token of the lock to remove ("" = a lock with no valid owner).
# Prints removed, gone (no lock) or kept (another lock is there now).
RELEASE = r"""lock=$1
if [ ! -d "$lock" ]; then echo gone
elif { [ -n "$2" ] && grep -qsF -e "$2" "$lock/owner"; } || { [ -z "$2" ] && ! grep -qs '"token"' "$lock/owner"; }; then
  rm -rf "$lock" && echo removed
else echo kept
fi
"""


def path(node: Node) -> str:
    return os.environ.get(PATH_ENV, LOCK_PATH).replace("{address}", node.address)


def describe() -> str:
    return f"the fleet lock ({os.environ.get(PATH_ENV, LOCK_PATH)} on every node, taken in address order)"


def canonical(inv: Inventory) -> list[Node]:
    """The order every operator takes the nodes in."""
    return sorted(inv.nodes, key=lambda n: (n.address, inv.ssh_for(n).port))


def _argv(script: str, *args: str) -> tuple[str, ...]:
    return ("sh", "-c", script, "sh", *args)


@dataclass(frozen=True)
class Owner:
    """Who holds a lock: the ``owner`` file."""

    user: str
    host: str
    pid: int
    command: str
    job: str
    hosts: str
    """The holder's hosts.yaml."""
    started: str
    """UTC, ISO 8601, the holder's clock."""
    token: str

    @classmethod
    def here(cls, command: str, job: str, hosts: str) -> "Owner":
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry for this uid (containers)
            user = f"uid{os.getuid()}"
        return cls(user=user, host=socket.gethostname(), pid=os.getpid(), command=command, job=job,
                   hosts=os.path.abspath(hosts), started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   token=uuid.uuid4().hex)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, text: str) -> "Owner | None":
        try:
            data = json.loads(text)
            values = {f.name: data[f.name] for f in fields(cls)}  # fields a later version adds are ignored
            return cls(**{**values, "pid": int(values["pid"])})
        except (ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class Seen:
    """A lock found on a node."""

    node: str
    owner: Owner | None
    """None while it is being taken (no owner file yet), or when the owner file is unreadable."""
    age: int
    """Seconds since it was taken (the node's clock)."""
    quiet: int
    """Seconds since its last heartbeat (the node's clock)."""

    def stale(self) -> str | None:
        """Why nobody holds this lock any more, or None while its holder may still run."""
        if self.quiet > STALE_AFTER:
            return f"no heartbeat for {self.quiet} s"
        o = self.owner
        if o is not None and o.host == socket.gethostname() and not _alive(o.pid):
            return f"process {o.pid} on this machine has ended"
        return None

    def holder(self) -> str:
        o = self.owner
        who = (f"{o.command} of job {o.job} by {o.user}@{o.host} (pid {o.pid})" if o is not None
               else "a ddp-deploy that has written no owner file (yet)")
        return f"{who}, started {_ago(self.age)} ago"

    def describe(self) -> str:
        return f"{self.node} is locked by {self.holder()}"


def parse(node: str, stdout: str) -> Seen | None:
    """The output of LOOK / TAKE: None for no lock (or one just taken), else what holds it."""
    head, _, rest = stdout.partition("\n")
    words = head.split()
    if words[:1] != ["held"] or len(words) != 3:
        return None
    return Seen(node, Owner.decode(rest), int(words[1]), int(words[2]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        pass
    return True


def _ago(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h"


def refusal(command: str, seen: Seen) -> RuntimeFailure:
    why = seen.stale()
    if why is None:
        return RuntimeFailure(f"{command} refused, nothing started: {seen.describe()}",
                              hint=f"wait for it to finish, or if that command no longer runs: {UNLOCK}")
    return RuntimeFailure(f"{command} refused, nothing started: {seen.describe()}; the lock is stale: {why}",
                          hint=f"clear it with {UNLOCK}, then run {command} again")


@dataclass(frozen=True)
class Survey:
    """Every node's lock, as LOOK found it."""

    locks: dict[str, Seen | None]
    """Per node that answered: its lock, or None."""
    failed: dict[str, Result]
    """The nodes that did not answer (or whose LOOK failed)."""


def survey(inv: Inventory, remote: Remote) -> Survey:
    """Every node at once (which also opens every connection in parallel)."""
    res = remote.run({n.name: _argv(LOOK, path(n)) for n in inv.nodes}, check=False, timeout=60)
    return Survey({n: parse(n, r.stdout) for n, r in res.items() if r.ok},
                  {n: r for n, r in res.items() if not r.ok})


class FleetLock:
    """The lock held on ``nodes``, refreshed by a heartbeat thread until :meth:`release`."""

    def __init__(self, inv: Inventory, remote: Remote, owner: Owner, nodes: list[str]) -> None:
        self.inv, self.remote, self.owner, self.nodes = inv, remote, owner, nodes
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="fleet-lock-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        # A Remote of its own: Remote opens a connection lazily and is not shared across threads.
        with Remote(self.inv) as remote:
            while not self._stop.wait(HEARTBEAT_EVERY):
                beats = {n: _argv(BEAT, path(self.inv.node(n)), self.owner.token) for n in self.nodes}
                for n, r in remote.run(beats, check=False, timeout=HEARTBEAT_EVERY).items():
                    if not r.ok:
                        log.warning("fleet lock heartbeat on %s: %s", n, r.summary())

    def release(self) -> list[str]:
        """Stops the heartbeat and removes the lock, last node first; returns the nodes where it stays."""
        self._stop.set()
        self._beat.join()
        return _release(self.inv, self.remote, self.owner.token, self.nodes)


def _release(inv: Inventory, remote: Remote, token: str, nodes: list[str]) -> list[str]:
    left = []
    for n in reversed(nodes):
        r = remote.run({n: _argv(RELEASE, path(inv.node(n)), token)}, check=False, timeout=60)[n]
        if not r.ok:
            log.warning("fleet lock not released on %s: %s", n, r.summary())
            left.append(n)
    return left


def acquire(inv: Inventory, remote: Remote, command: str, hosts: str) -> FleetLock:
    """Takes the lock on every node that answers, in canonical order, or raises naming the holder.

    Nodes that do not answer are skipped: the command's own checks name them.
    """
    owner = Owner.here(command, inv.job.name, hosts)
    seen = survey(inv, remote)
    order = [n for n in canonical(inv) if n.name not in seen.failed or seen.failed[n.name].connected]
    for n in order:  # a lock already there: refused before taking anything
        if seen.locks.get(n.name) is not None:
            raise refusal(command, seen.locks[n.name])
    taken: list[str] = []
    try:
        for n in order:
            r = remote.run({n.name: _argv(TAKE, path(n))}, stdin={n.name: owner.encode()}, check=False,
                           timeout=60)[n.name]
            if not r.connected:
                continue
            if not r.ok:
                raise RuntimeFailure(f"{command} refused, nothing started: {n.name}: cannot take the fleet lock "
                                     f"{path(n)}: {r.summary()}")
            other = parse(n.name, r.stdout)
            if other is not None and (other.owner is None or other.owner.token != owner.token):
                raise refusal(command, other)
            taken.append(n.name)  # taken, or already ours: a lock directory this node shares with another
    except BaseException:
        _release(inv, remote, owner.token, taken)
        raise
    return FleetLock(inv, remote, owner, taken)


@contextlib.contextmanager
def held(inv: Inventory, remote: Remote, command: str, hosts: str,
         warn: Callable[[str], None] = log.warning) -> Iterator[FleetLock]:
    """The fleet lock for the duration of the block (released however it ends)."""
    lock = acquire(inv, remote, command, hosts)
    try:
        yield lock
    finally:
        left = lock.release()
        if left:
            warn(f"the fleet lock stays on {', '.join(left)} (not reachable now): it turns stale within "
                 f"{STALE_AFTER} s; clear it with {UNLOCK}")


def remove(inv: Inventory, remote: Remote, locks: dict[str, Seen]) -> dict[str, Result]:
    """Removes each node's lock, if it is still the one seen; stdout says removed, gone or kept."""
    def token(s: Seen) -> str:
        return s.owner.token if s.owner else ""

    return remote.run({n: _argv(RELEASE, path(inv.node(n)), token(s)) for n, s in locks.items()},
                      check=False, timeout=60)
