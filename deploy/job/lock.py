"""The job's lock: one command at a time changes a job, and jobs side by side never wait on each other.

``launch`` and ``join`` take the lock of their job, ``deploy`` that of its job and that of its image
(two deploys of one image would ship it twice at once), on every node of the inventory, one node
after the other in one canonical order (node address, then ssh port: two inventories naming the
same machines in another order or under other names agree), the keys in one order too, stopping at
the first node that refuses and releasing, in reverse, what was already taken. Two operators racing
for the same job meet first on the lowest node they share, so exactly one of them proceeds; another
job's launch, of any user, takes other locks and waits for nobody. ``--wait-lock SECONDS`` waits for
a live holder to finish instead of refusing.

On a node a lock is the directory ``<root>/<key>``, root being ``~/.ddp-deploy`` of the user the tool
logs in as (``lock_at`` in held.sh makes it, and refuses one that is not that user's own, is a link,
or that anyone else can write into): no other user, and no job running as another user, can plant,
rename or remove a lock there. A lock is put in place whole by one ``rename``, holding ``owner``
(JSON: who, which command and job, a random token; only the holder of the token releases it),
``heartbeat``, touched every ``HEARTBEAT_EVERY`` seconds while it is held, and ``boot``, the node's
boot id: a lock from before the node's last boot is cleared when next seen. Nodes sharing a home
directory (local nodes of one machine, a shared /home) share their locks, and are one node for them.

A lock is stale when its heartbeat is older than ``STALE_AFTER`` (measured with the node's own
clock), or its holder ran on this machine and that process has ended. "This machine" is told by
its machine id and boot id (``Owner.machine``, ``Owner.boot``), never by the hostname alone, which
another machine may share: a holder on another machine is judged by its heartbeat only, and one
from before this machine's last boot has ended. Only where the holder or this machine has no
machine id (owner files of earlier versions, systems without /etc/machine-id) does the hostname
decide, and the reason says so. A stale lock is refused like a live one, never taken over (and
never waited for): ``ddp-deploy unlock`` clears it.

A lock can still be removed under its holder (``unlock --force``, a reboot of the node): the
holder's heartbeat notices and records it, and ``FleetLock.confirm`` refuses to go on, naming the
node, before the command starts anything there.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import MISSING, asdict, dataclass, fields
from datetime import datetime, timezone

from ..errors import RuntimeFailure
from ..inventory import Inventory, Node
from ..programs import node_program
from ..nodes.remote import Remote, Result

log = logging.getLogger(__name__)

ROOT = "~/.ddp-deploy"
"""Where a node keeps its locks (held.sh's ``lock_at``): the home of the user the tool logs in as."""
ROOT_ENV = "DDP_DEPLOY_LOCK_DIR"
"""Another root for the locks (the tests' own); ``{address}`` in it becomes each node's address."""
WAIT_EVERY = 2.0
"""Seconds between looks at a live holder's lock while ``--wait-lock`` waits for it."""
HEARTBEAT_EVERY = 10
STALE_AFTER = 60
UNLOCK = "`ddp-deploy unlock`"
UNLOCK_LIVE = "`ddp-deploy unlock --force`"  # plain unlock refuses a live lock
MACHINE_ID = ("/etc/machine-id", "/var/lib/dbus/machine-id")
"""Where this machine's id is (systemd's, then D-Bus's): unique per installation, unlike hostnames."""
BOOT_ID = "/proc/sys/kernel/random/boot_id"
"""A new one at every boot: a holder from an earlier boot has ended, whatever its pid says now."""
OWNER_MAX = 16384
"""Bytes of a node's owner file read (held.sh's ``owner``, the same number): any local user can
read an owner file that is not the tool's (an earlier version's lock, kept in /tmp, could be anyone's). The tool's own owner files are a few hundred
bytes, at most 12 KiB (a hosts path of PATH_MAX bytes, JSON-escaped); a longer one is no owner."""
SHOWN = 100
"""Characters of an owner's field, or of an owner file that is not one, shown in a message."""

# Every program below takes $1 = the locks' root ("": ~/.ddp-deploy) and $2 = the lock's key, and
# finds the lock through ``lock_at``. ``held LOCK`` prints "held TAKEN QUIET" (seconds since the
# lock was taken and since its last heartbeat, on this node's clock) and then the owner file's first
# OWNER_MAX bytes; it fails when there is no lock. The owner file is read only through ``owner``.
_HELD = node_program("held.sh")

# What `held` prints, or "free".
LOOK = _HELD + 'lock_at "$1" "$2" || exit 1\nheld "$lock" || echo free\n'

# stdin = the owner JSON. Prints "taken", or what `held` prints about the
# lock already there (a lock that vanishes meanwhile is tried again). The lock is made whole beside
# its place (owner and heartbeat in "$lock.new.PID") and renamed into it, so that nobody ever sees it
# without its owner; the rename fails where a lock with files in it is there already. Only a lock
# directory with nothing in it (an earlier version's, in the moment between its mkdir and its owner
# file) could be replaced: the test before the rename leaves that a moment of microseconds, and its
# taker's owner file would then replace ours, which `FleetLock.confirm` finds before we start anything.
TAKE = _HELD + r"""umask 022
lock_at "$1" "$2" || exit 1
owner=$(cat); new="$lock.new.$$"
trap 'rm -rf "$new"' EXIT
rm -rf "$new" && mkdir -m 755 "$new" && printf '%s\n' "$owner" > "$new/owner" && : > "$new/heartbeat" \
  && cat /proc/sys/kernel/random/boot_id > "$new/boot" || exit 1
for _ in 1 2 3; do
  if [ ! -e "$lock" ] && err=$(mv -T "$new" "$lock" 2>&1); then echo taken; exit 0; fi
  held "$lock" && exit 0
done
echo "${err:-$lock is there and cannot be read}" >&2; exit 1
"""

# $3 = token. Refreshes the heartbeat of our own lock only; where the lock is no longer ours, prints
# "lost" and then what LOOK prints about the node's lock now.
BEAT = _HELD + r"""lock_at "$1" "$2" || exit 1
if owner "$lock" | grep -qF -e "$3"; then touch "$lock/heartbeat"
else echo lost; held "$lock" || echo free
fi
"""

# $3 = the token of the lock to remove ("" = a lock with no valid owner).
# Prints removed, gone (no lock) or kept (another lock is there now). The lock is renamed aside
# before its files are removed, so nobody sees it half removed.
RELEASE = _HELD + node_program("release.sh")


def root(node: Node) -> str:
    """The root of the node's locks as its programs take it ("": the default, ``ROOT``)."""
    return os.environ.get(ROOT_ENV, "").replace("{address}", node.address)


def path(node: Node, key: str) -> str:
    return f"{root(node) or ROOT}/{key}"


def job_key(inv: Inventory) -> str:
    return f"job-{inv.job.name}"


def image_key(inv: Inventory) -> str:
    """An image's reference may hold '/' and ':': its key is a digest of it."""
    return "image-" + hashlib.sha256(inv.image.name.encode()).hexdigest()[:16]


def keys(inv: Inventory, command: str) -> tuple[str, ...]:
    """The locks ``command`` takes, in the order every operator takes them: a deploy on the docker
    runtime ships an image, and takes its lock too."""
    if command == "deploy" and inv.job.runtime == "docker":
        return image_key(inv), job_key(inv)
    return (job_key(inv),)


def describe(inv: Inventory, command: str) -> str:
    """The locks ``command`` takes, for a dry run."""
    where = " and ".join(f"{os.environ.get(ROOT_ENV, ROOT)}/{k}" for k in keys(inv, command))
    which = "the locks of its image and of job" if len(keys(inv, command)) > 1 else "the lock of job"
    return f"{which} {inv.job.name} ({where} on every node, taken in address order)"


def canonical(inv: Inventory) -> list[Node]:
    """The order every operator takes the nodes in."""
    return sorted(inv.nodes, key=lambda n: (n.address, inv.ssh_for(n).port))


def _argv(script: str, *args: str) -> tuple[str, ...]:
    return ("sh", "-c", script, "sh", *args)


def _first_line(paths: tuple[str, ...]) -> str:
    """The first non-empty file of ``paths``, stripped; "" where none can be read."""
    for p in paths:
        try:
            with open(p, encoding="ascii", errors="replace") as f:
                text = f.read(256).strip()
        except OSError:
            continue
        if text:
            return text
    return ""


def machine_id() -> str:
    return _first_line(MACHINE_ID)


def boot_id() -> str:
    return _first_line((BOOT_ID,))


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
    machine: str = ""
    """The holder's machine id (``MACHINE_ID``); "" where it has none, and in owner files of
    versions before it, where ``host`` alone tells machines apart."""
    boot: str = ""
    """The holder's boot id (``BOOT_ID``) when it took the lock; "" where unknown."""

    @classmethod
    def here(cls, command: str, job: str, hosts: str) -> "Owner":
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry for this uid (containers)
            user = f"uid{os.getuid()}"
        return cls(user=user, host=socket.gethostname(), pid=os.getpid(), command=command, job=job,
                   hosts=os.path.abspath(hosts), started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   token=uuid.uuid4().hex, machine=machine_id(), boot=boot_id())

    def ended(self) -> str | None:
        """Why this holder's process has certainly ended, as far as this machine can tell; None
        while it may run, and always for a holder on another machine (its heartbeat tells)."""
        here = machine_id()
        if isinstance(self.machine, str) and self.machine and here:
            if self.machine != here:
                return None
            now = boot_id()
            if isinstance(self.boot, str) and self.boot and now and self.boot != now:
                return f"this machine has restarted since process {self.pid} took the lock"
            return None if _alive(self.pid) else f"process {self.pid} on this machine has ended"
        if self.host != socket.gethostname() or _alive(self.pid):
            return None
        why = "the lock names no machine id" if here else f"this machine has no machine id ({', '.join(MACHINE_ID)})"
        return f"process {self.pid} on this machine has ended (this machine told by its hostname {self.host}: {why})"

    def elsewhere(self) -> bool:
        """Whether the holder ran on another machine that has this machine's hostname."""
        here = machine_id()
        return (self.host == socket.gethostname() and isinstance(self.machine, str) and bool(self.machine)
                and bool(here) and self.machine != here)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, text: str) -> "Owner | None":
        """The owner a node's owner file names; None for anything else (any local user can write
        one): not JSON, nested past the parser's depth, a field missing or not text, a pid that is
        no integer."""
        if len(text) > OWNER_MAX:
            return None
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                return None
            # Fields a later version adds are ignored; those an earlier one lacked take their default.
            values = {f.name: data[f.name] if f.default is MISSING else data.get(f.name, f.default)
                      for f in fields(cls)}
            if not all(isinstance(v, str) for k, v in values.items() if k != "pid"):
                return None
            return cls(**{**values, "pid": int(values["pid"])})
        except (ValueError, TypeError, KeyError, OverflowError, RecursionError):
            return None  # OverflowError: a pid of 1e999 (inf); RecursionError: [[[[...]]]]


@dataclass(frozen=True)
class Seen:
    """A lock found on a node."""

    node: str
    owner: Owner | None
    """None for an earlier version's lock while it is being taken (no owner file yet: see held.sh),
    or when the owner file is unreadable."""
    age: int
    """Seconds since it was taken (the node's clock)."""
    quiet: int
    """Seconds since its last heartbeat (the node's clock)."""
    text: str = ""
    """The owner file's start as read (at most OWNER_MAX bytes), shown where it names no owner."""

    def stale(self) -> str | None:
        """Why nobody holds this lock any more, or None while its holder may still run."""
        if self.quiet > STALE_AFTER:
            return f"no heartbeat for {self.quiet} s"
        return None if self.owner is None else self.owner.ended()

    def holder(self) -> str:
        o = self.owner
        if o is not None:
            who = (f"{_cut(o.command)} of job {_cut(o.job)} by {_cut(o.user)}@{_cut(o.host)} (pid {_cut(str(o.pid))}"
                   + (", on another machine of that name" if o.elsewhere() else "") + ")")
        elif self.text.strip():
            who = f"an owner file that names no ddp-deploy ({_cut(' '.join(self.text.split()))})"
        else:
            who = "a ddp-deploy that has written no owner file (yet)"
        return f"{who}, started {_ago(self.age)} ago"

    def describe(self) -> str:
        return f"{self.node} is locked by {self.holder()}"


def parse(node: str, stdout: str) -> Seen | None:
    """The output of LOOK / TAKE: None for no lock (or one just taken), else what holds it."""
    head, _, rest = stdout.partition("\n")
    words = head.split()
    if words[:1] != ["held"] or len(words) != 3:
        return None
    return Seen(node, Owner.decode(rest), int(words[1]), int(words[2]), rest[:OWNER_MAX])


def _cut(text: str, most: int = SHOWN) -> str:
    """``text`` at most ``most`` characters long, its cut marked."""
    return text if len(text) <= most else text[:most - 1] + "…"


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 and -N name process groups, never a holder
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large
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
        return Busy(f"{command} refused, nothing started: {seen.describe()}", seen,
                    hint=f"wait for it to finish (--wait-lock SECONDS waits for it), or if that command no longer "
                         f"runs: {UNLOCK_LIVE}")
    return RuntimeFailure(f"{command} refused, nothing started: {seen.describe()}; the lock is stale: {why}",
                          hint=f"clear it with {UNLOCK}, then run {command} again")


class Busy(RuntimeFailure):
    """A live holder has the lock: what waiting for it waits on."""

    def __init__(self, message: str, seen: Seen, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.seen = seen


@dataclass(frozen=True)
class Survey:
    """Every node's lock of one key, as LOOK found it."""

    locks: dict[str, Seen | None]
    """Per node that answered: its lock, or None."""
    failed: dict[str, Result]
    """The nodes that did not answer (or whose LOOK failed)."""


def survey(inv: Inventory, remote: Remote, key: str) -> Survey:
    """Every node at once (which also opens every connection in parallel)."""
    res = remote.run({n.name: _argv(LOOK, root(n), key) for n in inv.nodes}, check=False, timeout=60)
    return Survey({n: parse(n, r.stdout) for n, r in res.items() if r.ok},
                  {n: r for n, r in res.items() if not r.ok})


class FleetLock:
    """The locks held on ``taken`` ((key, node) pairs, in the order taken), refreshed by a heartbeat
    thread until :meth:`release`."""

    def __init__(self, inv: Inventory, remote: Remote, owner: Owner, taken: list[tuple[str, str]]) -> None:
        self.inv, self.remote, self.owner, self.taken = inv, remote, owner, taken
        self.lost: dict[tuple[str, str], Seen | None] = {}
        """Locks the heartbeat found no longer ours: what holds each now (None: nothing)."""
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="fleet-lock-heartbeat", daemon=True)
        self._beat.start()

    def _by_key(self, pairs) -> dict[str, list[str]]:
        by: dict[str, list[str]] = {}
        for key, n in pairs:
            by.setdefault(key, []).append(n)
        return by

    def _heartbeat(self) -> None:
        # A Remote of its own: Remote opens a connection lazily and is not shared across threads.
        with Remote(self.inv) as remote:
            while not self._stop.wait(HEARTBEAT_EVERY):
                for key, nodes in self._by_key(self.taken).items():
                    beats = {n: _argv(BEAT, root(self.inv.node(n)), key, self.owner.token) for n in nodes}
                    for n, r in remote.run(beats, check=False, timeout=HEARTBEAT_EVERY).items():
                        head, _, rest = r.stdout.partition("\n")
                        if r.ok and head == "lost":
                            if (key, n) not in self.lost:
                                log.warning("the lock %s on %s: no longer ours", key, n)
                            self.lost[key, n] = parse(n, rest)
                        elif not r.ok:
                            log.warning("lock heartbeat on %s: %s", n, r.summary())

    def confirm(self, command: str, nothing: str = "nothing was started") -> None:
        """Raises unless the locks are still ours on every node they were taken on; called right
        before ``command`` changes anything there. One look at every node, or where the heartbeat
        found a lock lost, at those nodes, to name who holds it now (the heartbeat may have beaten
        between its removal and another's taking); a node that does not answer that look keeps the
        heartbeat's record."""
        lost = dict(self.lost)
        looked = [p for p in self.taken if p in lost] if lost else self.taken
        for key, nodes in self._by_key(looked).items():
            res = self.remote.run({n: _argv(LOOK, root(self.inv.node(n)), key) for n in nodes}, check=False,
                                  timeout=60)
            for n in nodes:
                r = res[n]
                if not r.ok:
                    if (key, n) in lost:
                        continue
                    raise RuntimeFailure(f"{command} stopped, {nothing}: cannot tell whether the lock on {n} "
                                         f"is still held: {r.summary()}", hint=f"run {command} again once {n} answers")
                seen = parse(n, r.stdout)
                if seen is None or seen.owner is None or seen.owner.token != self.owner.token:
                    lost[key, n] = seen
        for key, n in self.taken:
            if (key, n) in lost:
                seen = lost[key, n]
                what = ("removed (`ddp-deploy unlock --force`, or a reboot of the node)" if seen is None
                        else f"taken by {seen.holder()}")
                raise RuntimeFailure(f"the lock of job {self.inv.job.name} on {n} was {what} while this {command} "
                                     f"prepared; {nothing}",
                                     hint="another operator may be using these nodes: see `ddp-deploy status`, "
                                          f"then run {command} again")

    def release(self) -> list[str]:
        """Stops the heartbeat and removes the locks, last taken first; returns the nodes where one stays."""
        self._stop.set()
        self._beat.join()
        return _release(self.inv, self.remote, self.owner.token, self.taken)


def _release(inv: Inventory, remote: Remote, token: str, taken: list[tuple[str, str]]) -> list[str]:
    left = []
    for key, n in reversed(taken):
        r = remote.run({n: _argv(RELEASE, root(inv.node(n)), key, token)}, check=False, timeout=60)[n]
        if not r.ok:
            log.warning("the lock %s not released on %s: %s", key, n, r.summary())
            left.append(n)
    return list(dict.fromkeys(left))


def _take(inv: Inventory, remote: Remote, command: str, owner: Owner) -> list[tuple[str, str]]:
    """Takes every lock of ``command`` on every node that answers, in canonical order, or raises
    naming the holder (a live one as :class:`Busy`) with nothing left taken."""
    taken: list[tuple[str, str]] = []
    try:
        for key in keys(inv, command):
            seen = survey(inv, remote, key)
            order = [n for n in canonical(inv) if n.name not in seen.failed or seen.failed[n.name].connected]
            for n in order:  # a lock already there: refused before taking anything more
                if seen.locks.get(n.name) is not None:
                    raise refusal(command, seen.locks[n.name])
            for n in order:
                r = remote.run({n.name: _argv(TAKE, root(n), key)}, stdin={n.name: owner.encode()}, check=False,
                               timeout=60)[n.name]
                if not r.connected:
                    continue
                if not r.ok:
                    raise RuntimeFailure(f"{command} refused, nothing started: {n.name}: cannot take the lock "
                                         f"{path(n, key)}: {r.summary()}")
                other = parse(n.name, r.stdout)
                if other is not None and (other.owner is None or other.owner.token != owner.token):
                    raise refusal(command, other)
                taken.append((key, n.name))  # taken, or already ours: a lock directory this node shares
    except BaseException:
        _release(inv, remote, owner.token, taken)
        raise
    return taken


def acquire(inv: Inventory, remote: Remote, command: str, hosts: str, wait_s: float = 0.0,
            waiting: Callable[[str], None] = log.info, clock: Callable[[], float] = time.monotonic) -> FleetLock:
    """Takes the locks of ``command`` on every node that answers, or raises naming the holder.
    With ``wait_s``, a live holder is waited for up to that many seconds (``waiting`` is told whom
    it waits for, each time that changes); a stale lock is refused at once.

    Nodes that do not answer are skipped: the command's own checks name them.
    """
    owner = Owner.here(command, inv.job.name, hosts)
    deadline, told = clock() + wait_s, ""
    while True:
        try:
            return FleetLock(inv, remote, owner, _take(inv, remote, command, owner))
        except Busy as busy:
            left = deadline - clock()
            if left <= 0:
                if wait_s > 0:
                    raise RuntimeFailure(f"{busy.message}; waited {wait_s:g} s for it", hint=busy.hint) from None
                raise
            now = busy.seen.describe()
            if now != told:
                waiting(f"waiting up to {left:.0f} s for the lock: {now}")
                told = now
            time.sleep(min(WAIT_EVERY, left))


@contextlib.contextmanager
def held(inv: Inventory, remote: Remote, command: str, hosts: str, warn: Callable[[str], None] = log.warning,
         wait_s: float = 0.0) -> Iterator[FleetLock]:
    """The locks of ``command`` for the duration of the block (released however it ends)."""
    lock = acquire(inv, remote, command, hosts, wait_s, waiting=warn)
    try:
        yield lock
    finally:
        left = lock.release()
        if left:
            warn(f"the lock of job {inv.job.name} stays on {', '.join(left)} (not reachable now): it turns stale "
                 f"within {STALE_AFTER} s; clear it with {UNLOCK}")


def remove(inv: Inventory, remote: Remote, key: str, locks: dict[str, Seen]) -> dict[str, Result]:
    """Removes each node's lock ``key``, if it is still the one seen; stdout says removed, gone or kept."""
    def token(s: Seen) -> str:
        return s.owner.token if s.owner else ""

    return remote.run({n: _argv(RELEASE, root(inv.node(n)), key, token(s)) for n, s in locks.items()},
                      check=False, timeout=60)
