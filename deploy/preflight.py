"""Checks run on every node before anything is started anywhere.

Each check runs on all reachable nodes in parallel and yields one :class:`Check` per node.
An unreachable node gets one failed ``ssh`` check naming the cause and no further checks.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import secrets
from dataclasses import dataclass

from . import plan
from .inventory import Inventory
from .remote import Remote, Result

# $@ = paths. Per path: "OK PATH FREE_KB" | "MISSING PATH FREE_KB ANCESTOR" | "FAIL PATH why".
STORAGE = r"""for p in "$@"; do
  q=$p; while [ ! -e "$q" ]; do q=$(dirname "$q"); done
  if [ ! -d "$q" ] || [ ! -w "$q" ]; then echo "FAIL $p $q is not a writable directory"; continue; fi
  kb=$(df -Pk "$q" | awk 'NR==2 {print $4}')
  if [ "$q" = "$p" ]; then echo "OK $p $kb"; else echo "MISSING $p $kb $q"; fi
done
"""

# argv: PORT N TIMEOUT. Binds the port (fails if in use), accepts N connections or times out.
LISTEN = r"""import socket, sys, time
port, n, t = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
try:
    s = socket.create_server(("", port))
except OSError as e:
    print(f"port {port} is in use ({e.strerror})")
    sys.exit(3)
end, got = time.time() + t, 0
while got < n and time.time() < end:
    s.settimeout(max(0.05, end - time.time()))
    try:
        c, _ = s.accept()
    except OSError:
        break
    got += 1
    c.close()
print(f"accepted {got} of {n}")
sys.exit(0 if got >= n else 4)
"""

# $1 = address, $2 = port. Retries while the listener starts.
CONNECT = r"""i=0
while [ $i -lt 20 ]; do
  if timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null; then echo connected; exit 0; fi
  sleep 0.5; i=$((i+1))
done
echo "cannot connect to $1:$2" >&2; exit 1
"""

WRITE_TOKEN = r"""printf %s "$1" > "$2" """
LISTEN_SECONDS = 15


@dataclass(frozen=True)
class Check:
    node: str
    name: str
    ok: bool
    detail: str


def run_checks(inv: Inventory, remote: Remote) -> list[Check]:
    checks: list[Check] = []
    reach = remote.run_all(["true"], check=False, timeout=60)
    up = [n for n, r in reach.items() if r.connected]
    for node, r in reach.items():
        how = "local" if inv.node(node).connection == "local" else "ssh"
        checks.append(Check(node, how, r.connected, "reachable" if r.connected else r.error))
    if not up:
        return checks

    if inv.job.runtime == "docker":
        engine = partial(_simple, remote, up, "docker", ["docker", "version", "--format", "{{.Server.Version}}"],
                         lambda r: (True, f"engine {r.stdout.strip()}"), "docker engine not usable")
    else:
        engine = partial(_simple, remote, up, "python", list(plan.python_check_argv(inv)),
                         lambda r: (True, f"torch {r.stdout.strip()}"),
                         f"{inv.python_path()} cannot import trainer and torch")
    gpu_nodes = [n for n in up if inv.node(n).gpus > 0]
    # The checks are independent of one another: they run at the same time, each over every
    # node in parallel, on the connections opened above (one SSH channel per command).
    groups = [engine, partial(_gpus, inv, remote, gpu_nodes), partial(_storage, inv, remote, up),
              partial(_shared, inv, remote, up), partial(_rendezvous, inv, remote, up),
              partial(_previous_run, inv, remote, up)]
    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="check") as pool:
        for found in pool.map(lambda group: group(), groups):
            checks += found
    return checks


def _simple(remote, nodes, name, argv, judge, fail_text) -> list[Check]:
    out = []
    for node, r in remote.run({n: argv for n in nodes}, check=False, timeout=60).items():
        if r.ok:
            ok, detail = judge(r)
        else:
            ok, detail = False, f"{fail_text}: {r.summary()}"
        out.append(Check(node, name, ok, detail))
    return out


def _gpus(inv, remote, nodes) -> list[Check]:
    def judge(r: Result):
        want = inv.node(r.node).gpus
        have = sum(1 for line in r.stdout.splitlines() if line.startswith("GPU "))
        return have >= want, f"{have} GPUs, need {want}"

    return _simple(remote, nodes, "gpus", ["nvidia-smi", "-L"], judge, "nvidia-smi failed")


def _storage(inv, remote, nodes) -> list[Check]:
    s = inv.storage
    need_kb = s.min_free_gb * 1024 * 1024
    out = []
    argv = ["sh", "-c", STORAGE, "sh", s.data.host, s.checkpoints.host]
    for node, r in remote.run({n: argv for n in nodes}, check=False, timeout=60).items():
        if not r.ok:
            out.append(Check(node, "storage", False, r.summary()))
            continue
        problems, notes = [], []
        for line in r.stdout.splitlines():
            kind, path, rest = (line.split(" ", 2) + ["", ""])[:3]
            if kind == "FAIL":
                problems.append(f"{path}: {rest}")
                continue
            free_kb = int(rest.split()[0])
            if free_kb < need_kb:
                problems.append(f"{path}: {free_kb / 1048576:.1f} GB free, need {s.min_free_gb:g}")
            if kind == "MISSING":
                notes.append(f"{path} missing (deploy creates it)")
        detail = "; ".join(problems or notes) or "exists, writable, enough space"
        out.append(Check(node, "storage", not problems, detail))
    return out


def _shared(inv, remote, nodes) -> list[Check]:
    """Write a random token on the first node, read it on all others."""
    if len(inv.nodes) < 2 or len(nodes) < 2:
        return [Check(n, "shared storage", True, "single node") for n in nodes] if len(inv.nodes) < 2 else []
    token = secrets.token_hex(16)
    ckpt = inv.storage.checkpoints.host
    probe = remote.run({nodes[0]: ["sh", "-c", STORAGE, "sh", ckpt]}, check=False)[nodes[0]]
    words = probe.stdout.split()
    if not probe.ok or not words or words[0] == "FAIL":
        return [Check(n, "shared storage", False, f"cannot write under {ckpt} on {nodes[0]}") for n in nodes]
    base = ckpt if words[0] == "OK" else words[3]
    path = f"{base.rstrip('/')}/.ddp-deploy-check-{token}"
    w = remote.run({nodes[0]: ["sh", "-c", WRITE_TOKEN, "sh", token, path]}, check=False)[nodes[0]]
    if not w.ok:
        return [Check(nodes[0], "shared storage", False, f"cannot write {path}: {w.summary()}")]
    try:
        reads = remote.run({n: ["cat", path] for n in nodes[1:]}, check=False)
    finally:
        remote.run({nodes[0]: ["rm", "-f", path]}, check=False)
    out = [Check(nodes[0], "shared storage", True, f"wrote token to {base}")]
    for n, r in reads.items():
        same = r.ok and r.stdout.strip() == token
        out.append(Check(n, "shared storage", same,
                         f"sees {nodes[0]}'s token" if same else f"does not see {path} written by {nodes[0]}: "
                         "not the same storage"))
    return out


def _rendezvous(inv, remote, nodes) -> list[Check]:
    rdzv = inv.rdzv_node
    port = inv.rendezvous.port
    if rdzv.name not in nodes:
        return [Check(rdzv.name, "rendezvous", False, "endpoint node unreachable")]
    others = [n for n in nodes if n != rdzv.name]
    python = "python3" if inv.job.runtime == "docker" else inv.python_path()
    listen = [python, "-c", LISTEN, str(port), str(len(others)), str(LISTEN_SECONDS)]
    connect = ["sh", "-c", CONNECT, "sh", rdzv.address, str(port)]

    def one(node: str) -> Result:
        argv = listen if node == rdzv.name else connect
        return remote.run({node: argv}, check=False, timeout=LISTEN_SECONDS + 15)[node]

    results = remote.parallel(nodes, one)
    out = []
    for node, r in results.items():
        if node == rdzv.name:
            detail = f"port {port} free" if r.ok else (r.stdout.strip() or r.summary())
        else:
            detail = f"reaches {rdzv.address}:{port}" if r.ok else f"cannot reach {rdzv.address}:{port}"
        out.append(Check(node, "rendezvous", r.ok, detail))
    return out


def _previous_run(inv, remote, nodes) -> list[Check]:
    out = []
    cmds = {n: plan.status_argv(inv, inv.node(n)) for n in nodes}
    for node, r in remote.run(cmds, check=False, timeout=60).items():
        if not r.ok:
            out.append(Check(node, "previous run", False, r.summary()))
            continue
        st = plan.parse_status(r.stdout)
        if st.running:
            detail = "still running: run `ddp-deploy stop` first"
        elif st.exists:
            detail = f"finished ({st.state}); launch clears it and the job resumes from its checkpoint"
        else:
            detail = "none"
        out.append(Check(node, "previous run", not st.running, detail))
    return out
