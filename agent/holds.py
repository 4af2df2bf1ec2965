"""Which jobs run on a node and which GPUs each holds, from kernel facts: one job at a time per GPU.

A job's launcher on a node says it runs there, and holds each GPU it was given (``$DDP_HOLD``), by
listening Unix sockets in the abstract namespace, ``@ddp-deploy/job/<token>`` and
``@ddp-deploy/gpu<index>/<token>``, each answering a connection with one line that tells the job,
its run, its user and its GPUs. The kernel removes them when the process ends, however it ends (a
kill, an OOM, a reboot), so a hold never outlives its job and there is no file to plant or to
clean. Abstract names are per network namespace: the node's (a docker job has the host's network).
Whoever holds one is named by what the kernel says of the listener (``SO_PEERCRED``: its pid and
uid, and the pid's start time), never by what a process says of itself; the job name a holder tells
is shown as its claim, as text.

Any user can make such a socket. A name that does not answer with one line within ASK_S holds
nothing; all claims are asked at once, at most :data:`CLAIMS_READ` per GPU, so a flood of them
costs one bounded read. Two jobs taking one GPU at the same moment may see each other; both
let go and try again after a random pause, so one finds it free and keeps it; a launcher that
still finds the GPU held after a few tries refuses to start, naming the holder.

Standard library only (Python 3.6+): deploy sends this file's text to a node's own ``python3``
to list the holds before a launch (``python3 -c SOURCE list INDEX...``: one JSON line per hold,
``told`` the sentence a launcher's refusal says of it),
and the jobs running there for ``ddp-deploy jobs`` (``python3 -c SOURCE jobs``).
"""

import json
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time

ENV = "DDP_HOLD"
"""agent.contract.HOLD_ENV, spelled here too: this file runs alone, from its text (a test holds them equal)."""

PREFIX = "ddp-deploy/"
JOB = "job"
CLAIMS_READ = 64
"""The claims per GPU asked who holds it (a flood of sockets beyond them is not asked)."""
UNIX_READ = 8 << 20
"""The bytes of /proc/net/unix read (a flood of sockets is not read to its end)."""
ASK_S = 1.0
"""How long one claim's answer is waited for."""
SAID_MAX = 512


class Held(Exception):
    """A GPU another process holds; its message names the GPU and the holder."""


def gpu(index):
    return "gpu%d" % index


def claims(keys, table="/proc/net/unix"):
    """``{key: [abstract name, ...]}``: the listening claims of these keys (``gpu(index)``, JOB)
    in this network namespace, the first CLAIMS_READ of each."""
    out = {k: [] for k in keys}
    try:
        with open(table, "rb") as fh:
            text = fh.read(UNIX_READ).decode("ascii", "replace")
    except OSError:
        return out
    for line in text.splitlines()[1:]:
        fields = line.split()
        # Num RefCount Protocol Flags Type St Inode Path: a listening socket's flags are 00010000
        if len(fields) < 8 or fields[3] != "00010000" or not fields[7].startswith("@" + PREFIX):
            continue
        parts = fields[7][1 + len(PREFIX):].split("/")
        if len(parts) == 2 and parts[0] in out and len(out[parts[0]]) < CLAIMS_READ:
            out[parts[0]].append(fields[7][1:])
    return out


def _started(pid):
    """When ``pid`` started, in seconds since the epoch (None where it has ended)."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            stat = fh.read(4096).decode("ascii", "replace")
        with open("/proc/stat", "rb") as fh:
            boot = next(int(l.split()[1]) for l in fh.read(1 << 16).decode().splitlines() if l.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _asked(names):
    """``{name: (pid, uid, said bytes)}`` of the claims among ``names`` that answer: every one is
    connected to at once and all are given ASK_S together, however many there are."""
    asked = {}
    for name in names:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect("\0" + name)
            pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:  # not listening (or its queue is full): it holds nothing
            s.close()
            continue
        asked[s] = [name, pid, uid, b""]
    out, end = {}, time.monotonic() + ASK_S
    while asked and time.monotonic() < end:
        ready = select.select(list(asked), [], [], max(0.0, end - time.monotonic()))[0]
        for s in ready:
            entry = asked[s]
            try:
                got = s.recv(SAID_MAX - len(entry[3]))
            except OSError:
                got = b""
            entry[3] += got
            if not got or b"\n" in entry[3] or len(entry[3]) >= SAID_MAX:
                if b"\n" in entry[3]:  # a holder answers with one line at once
                    out[entry[0]] = (entry[1], entry[2], entry[3].split(b"\n")[0])
                del asked[s]
                s.close()
    for s in asked:
        s.close()
    return out


def holders(indices, mine=None):
    """Every answering holder of these GPUs: ``[{"gpu", "name", "pid", "uid", "since", "said"}, ...]``;
    ``mine``: a hold's token, whose claims are not asked."""
    keys = {gpu(i): i for i in indices}
    return sorted((dict(h, gpu=keys[h.pop("key")]) for h in _answering(list(keys), mine)),
                  key=lambda h: (h["gpu"], h["since"]))


def jobs():
    """Every job whose launcher runs on this node, as it answers: ``[{"name", "pid", "uid", "since",
    "said"}, ...]``, oldest first."""
    found = _answering([JOB])
    for h in found:
        del h["key"]
    return found


def _answering(keys, mine=None):
    names = {name: key for key, found in claims(keys).items() for name in found
             if mine is None or not name.endswith("/" + mine)}
    out = []
    for name, (pid, uid, said) in sorted(_asked(names).items()):
        since = _started(pid) if pid > 0 else None
        if since is None:  # ended since, or in a process namespace this one cannot see
            continue
        try:
            told = json.loads(said.decode("utf-8"))
        except ValueError:
            told = {}
        out.append({"key": names[name], "name": name, "pid": pid, "uid": uid, "since": round(since, 2),
                    "said": told if isinstance(told, dict) else {}})
    return sorted(out, key=lambda h: (h["since"], h["pid"]))


def describe(h):
    """One holder, as a refusal names it (what it tells of itself as quoted text)."""
    said = h.get("said") or {}
    job, user = (repr(str(said.get(k, "?"))[:64]) for k in ("job", "user"))
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"]))
    return "GPU %d is held by job %s of user %s (uid %d, pid %d) since %s" % (h["gpu"], job, user, h["uid"],
                                                                              h["pid"], since)


class Hold:
    """This process's hold on ``indices``: listening claims that answer who holds them."""

    TRIES = 4

    def __init__(self, indices, job, run=""):
        indices = list(indices)
        try:
            import pwd
            user = pwd.getpwuid(os.getuid()).pw_name
        except (ImportError, KeyError):
            user = str(os.getuid())
        self.said = {"job": job, "run": run, "user": user, "gpus": indices}
        self.answer = self._line({})
        self.sockets = []
        for attempt in range(self.TRIES):
            self._bind(indices)
            other = self._other(indices)
            if other is None:
                break
            # Two launchers that bound at the same moment each see the other: both let go, and
            # try again after a random pause, so that one of them finds the GPUs free.
            self.release()
            if attempt == self.TRIES - 1:
                raise Held(other)
            time.sleep(0.2 + secrets.randbelow(400) / 1000)
        threading.Thread(target=self._answer, name="gpu-hold", daemon=True).start()

    def _bind(self, indices):
        self.token = secrets.token_hex(8)
        for key in [JOB] + [gpu(i) for i in indices]:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind("\0%s%s/%s" % (PREFIX, key, self.token))
            s.listen(64)
            self.sockets.append(s)

    def _other(self, indices):
        """Another holder of one of ``indices``, described; None where there is none."""
        for h in holders(indices, mine=self.token):
            return describe(h)
        return None

    def _answer(self):
        while self.sockets:
            try:
                ready, _, _ = select.select(self.sockets, [], [], 1.0)
            except (OSError, ValueError):
                return
            for s in ready:
                try:
                    c, _ = s.accept()
                    c.settimeout(1.0)
                    c.sendall(self.answer)
                    c.close()
                except OSError:
                    pass

    def _line(self, more):
        line = json.dumps(dict(self.said, **more))
        return (line if len(line) < SAID_MAX else json.dumps(self.said)).encode() + b"\n"  # what it tells first

    def tell(self, state, every=1.0):
        """Tell what the job is doing with each answer from now on: ``state()``, a dict (the
        launcher's: its ranks' state and step, agent.contract.state), read every ``every``
        seconds in a thread of its own, so that an answer never waits on it."""
        def refresh():
            while self.sockets:
                try:
                    more = state()
                except Exception as exc:  # answers go on whatever the reading met
                    more = {"state": "unknown (%s)" % type(exc).__name__}
                self.answer = self._line(more)
                time.sleep(every)
        threading.Thread(target=refresh, name="gpu-hold-state", daemon=True).start()

    def release(self):
        for s in self.sockets:
            s.close()
        self.sockets = []


def from_environ(environ=os.environ):
    """The hold ``$DDP_HOLD`` asks for (removed from ``environ``: the workers hold nothing), or
    None where it asks for none. Raises Held where another job holds one of its GPUs."""
    spec = environ.pop(ENV, "")
    if not spec:
        return None
    want = json.loads(spec)
    return Hold([int(i) for i in want["gpus"]], str(want.get("job", "")), str(want.get("run", "")))


def main(argv):
    if argv[:1] in (["list"], ["jobs"]):
        for h in holders([int(i) for i in argv[1:]]) if argv[0] == "list" else jobs():
            print(json.dumps(dict(h, told=describe(h)) if "gpu" in h else h, sort_keys=True))
        return 0
    if argv[:1] == ["hold"]:  # hold JOB INDEX...: until killed (what a launcher does, for a test)
        try:
            Hold([int(i) for i in argv[2:]], argv[1])
        except Held as e:
            print("held: %s" % e, flush=True)
            return 3
        print("holding", flush=True)
        while True:
            time.sleep(3600)
    print("usage: holds.py list INDEX... | jobs | hold JOB INDEX...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
