"""How the nodes of a preflight session meet, each way its node-side commands beside the judge of
what they printed: a launch's (or ``check``'s) nodes through shared storage and at the rendezvous
(:class:`FleetMeeting`), a node joining a running job through that job's record and store
(:class:`JoinMeeting`). deploy/checks/preflight.py runs the session: phase 1 runs every check,
the barrier, then the waves a meeting sends on stdin (phase 2)."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping, Sequence

from ..inventory import Inventory, Node
from ..job.runtime import runtime
from ..nodes.remote import Result
from ..programs import node_program
from .node_checks import Check, parse_tagged

# $1 = directory, $2 = token. Writes the token into $1 (or its nearest existing ancestor, as
# STORAGE does); prints the file's path before writing it; exit 3: no writable directory.
TOKEN = node_program("token.sh")

# argv: PORT N TIMEOUT. Binds the port (fails if in use), accepts N connections or times out.
LISTEN = node_program("listen.py")

# $1 = address, $2 = port, $3 = seconds. Retries while the listener starts.
CONNECT = node_program("connect.bash")

LISTEN_SECONDS = 15


def rendezvous_argv(inv: Inventory, node: Node) -> tuple[str, ...]:
    """The endpoint listens for every other node; every other node connects to it."""
    rdzv, port = inv.rdzv_node, str(inv.rendezvous.port)
    if node.name == rdzv.name:
        return (runtime(inv).listener_python(), "-c", LISTEN, port, str(len(inv.nodes) - 1), str(LISTEN_SECONDS))
    return ("bash", "-c", CONNECT, "bash", rdzv.address, port, str(LISTEN_SECONDS))


def token_waves(inv: Inventory, first: Mapping[str, Result]) -> list[dict[str, str]]:
    """Phase 2: the other nodes read the reference's token, then the reference ends."""
    up = [n.name for n in inv.nodes if first[n.name].connected]
    if len(up) < 2:
        return []
    token = parse_tagged(up[0], first[up[0]].stdout).get("token")
    path = token.stdout.strip() if token is not None and token.ok else ""
    if not path:
        return []
    return [{n: f"READ {path}\n" for n in up[1:]}, {up[0]: ""}]


class FleetMeeting:
    """How the nodes of a launch (or ``check``) meet: through shared storage (every node writes a
    token in phase 1, the others read the first node's in phase 2) and at the rendezvous (the
    endpoint listens on the port, free, while every other node connects)."""

    def __init__(self, inv: Inventory) -> None:
        self.inv = inv
        self.tokens = {n.name: secrets.token_hex(16) for n in inv.nodes} if len(inv.nodes) > 1 else {}

    @staticmethod
    def meeting_checks(inv: Inventory, node: Node, token: str) -> list[tuple[str, Sequence[str]]]:
        out: list[tuple[str, Sequence[str]]] = []
        if token:
            out.append(("token", ("sh", "-c", TOKEN, "sh", inv.storage.checkpoints.host, token)))
        return [*out, ("rdzv", rendezvous_argv(inv, node))]

    def checks(self, node: Node) -> list[tuple[str, Sequence[str]]]:
        return self.meeting_checks(self.inv, node, self.tokens.get(node.name, ""))

    def waves(self, first: Mapping[str, Result]) -> list[dict[str, str]]:
        return token_waves(self.inv, first)

    def judge(self, up: list[str], results) -> list[Check]:
        return shared(self.inv, up, results, self.tokens) + rendezvous(self.inv, up, results)


class JoinMeeting:
    """How a node meets a job that runs already (``ddp-deploy join``): in phase 2 it reads the
    job's launch record on the shared storage, which must match what a running node read there,
    and it reaches the job's rendezvous store, which listens."""

    def __init__(self, inv: Inventory, record_path: str, record_text: str) -> None:
        self.inv, self.path, self.text = inv, record_path, record_text

    def checks(self, node: Node) -> list[tuple[str, Sequence[str]]]:
        rdzv = self.inv.rdzv_node
        return [("rdzv", ("bash", "-c", CONNECT, "bash", rdzv.address, str(self.inv.rendezvous.port),
                          str(LISTEN_SECONDS)))]

    def waves(self, first: Mapping[str, Result]) -> list[dict[str, str]]:
        return [{n: f"READ {self.path}\n" for n, r in first.items() if r.connected}]

    def judge(self, up: list[str], results) -> list[Check]:
        rdzv, port = self.inv.rdzv_node, self.inv.rendezvous.port
        out = []
        for node in up:
            seen = results[node]["seen"]
            same = seen.ok and seen.stdout.strip() == self.text.strip()
            out.append(Check(node, "shared storage", same, f"sees the running job's launch record {self.path}" if same
                             else f"does not see the running job's launch record {self.path} "
                                  f"({seen.summary() if not seen.ok else 'another content'}): not the same storage"))
            reached = results[node]["rdzv"].ok
            out.append(Check(node, "rendezvous", reached, f"reaches the running job's store at {rdzv.address}:{port}"
                             if reached else f"cannot reach the running job's store at {rdzv.address}:{port}"))
        return out


def shared(inv: Inventory, up: list[str], results, tokens) -> list[Check]:
    """The first reachable node's token, written in phase 1, must be read by every other node."""
    if len(inv.nodes) < 2:
        return [Check(n, "shared storage", True, "single node") for n in up]
    if len(up) < 2:
        return []
    ref, ckpt = up[0], inv.storage.checkpoints.host
    w = results[ref]["token"]
    path = w.stdout.strip()
    if not path:
        return [Check(n, "shared storage", False, f"cannot write under {ckpt} on {ref}") for n in up]
    if not w.ok:
        return [Check(ref, "shared storage", False, f"cannot write {path}: {w.summary()}")]
    out = [Check(ref, "shared storage", True, f"wrote token to {os.path.dirname(path)}")]
    for n in up[1:]:
        r = results[n]["seen"]
        same = r.ok and r.stdout.strip() == tokens[ref]
        out.append(Check(n, "shared storage", same,
                         f"sees {ref}'s token" if same else f"does not see {path} written by {ref}: "
                         "not the same storage"))
    return out


_ACCEPTED = re.compile(r"accepted (\d+) of \d+")


def rendezvous(inv: Inventory, up: list[str], results) -> list[Check]:
    rdzv = inv.rdzv_node
    port = inv.rendezvous.port
    if rdzv.name not in up:
        return [Check(rdzv.name, "rendezvous", False, "endpoint node unreachable")]
    others = [n for n in up if n != rdzv.name]
    out = []
    for node in up:
        r = results[node]["rdzv"]
        if node == rdzv.name:
            got = _ACCEPTED.search(r.stdout)
            ok = got is not None and r.exit_code in (0, 4) and int(got[1]) >= len(others)
            if ok:
                detail = f"port {port} free"
            elif got is not None and r.exit_code in (0, 4):
                detail = f"accepted {got[1]} of {len(others)}"
            else:
                detail = r.stdout.strip() or r.summary()
        else:
            ok = r.ok
            detail = f"reaches {rdzv.address}:{port}" if ok else f"cannot reach {rdzv.address}:{port}"
        out.append(Check(node, "rendezvous", ok, detail))
    return out


