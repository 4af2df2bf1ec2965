"""The ``cluster`` fixture: a real 3-node cluster (see netcluster.py), built once per session;
``slurm``: a real Slurm cluster on its nodes (see slurmcluster.py), also once per session;
``image_registry``: a real image registry on the cluster's bridge (see registry_ns.py), once per session;
``containerd_node``: one more node whose Docker keeps images in containerd (see containerd_node.py).
The last three are attached to the cluster: a test that rebuilds it gets them restarted too.

Without root or the system tools they need, every test that uses them is skipped with the reason;
with ``DDP_CLUSTER_REQUIRED=1`` (set it in CI) a missing prerequisite fails the tests instead,
so a CI run can never go green without having run them.
"""
from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

import lanes
from . import registry_ns, slurmcluster
from .netcluster import NetCluster, Site, missing_prerequisites
from .operator_cli import empty_nas

CLUSTER_NODES = 3
CLUSTER_SPARES = 1  # node4: made as the nodes are, listed only by the tests of spares (hosts.yaml's spares:)


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def _unavailable(reason: str) -> None:
    """Skip with the reason, or fail where the cluster tests must run (DDP_CLUSTER_REQUIRED=1)."""
    if os.environ.get("DDP_CLUSTER_REQUIRED") == "1":
        pytest.fail(reason + " (DDP_CLUSTER_REQUIRED=1)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def cluster(request):
    problems = missing_prerequisites()
    if problems:
        _unavailable("test cluster unavailable: " + "; ".join(problems))
    # SIGTERM (a CI timeout) must still run the teardown below, as Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    c = NetCluster(nodes=CLUSTER_NODES, spares=CLUSTER_SPARES, site=Site(lanes.cluster_site(request.config)))
    try:
        c.up()
        yield c
    finally:
        c.down()
        signal.signal(signal.SIGTERM, previous)


def _part(request, what: str, problems: list[str], make, unavailable: tuple[type[Exception], ...] = ()):
    """A part built on the cluster, once per session: skipped (or failed) with its missing
    prerequisites; started, and attached to the cluster so that a rebuild of it restarts the part
    (NetCluster.attach); stopped at the end of the session."""
    if problems:  # before the cluster is built for nothing
        _unavailable(f"{what} unavailable: " + "; ".join(problems))
    cluster = request.getfixturevalue("cluster")
    part = make(cluster)
    try:
        part.start()  # where it fails, it stops what it had started
    except unavailable as e:
        _unavailable(str(e))
    cluster.attach(part)
    try:
        yield part
    finally:
        cluster.detach(part)
        part.stop()


@pytest.fixture(scope="session")
def slurm(request):
    """Slurm on the cluster's nodes, every node idle: ``.nodes``, ``.partition``, ``.conf``,
    ``.login`` (the node tests submit from over SSH), ``.run(argv)``, ``.wait_idle()``,
    ``.jobs()``, ``.node_states()``, ``.clear()``. No job of a test outlives it (see below)."""
    yield from _part(request, "Slurm cluster", slurmcluster.missing_prerequisites(), slurmcluster.SlurmCluster)


@pytest.fixture(scope="session")
def image_registry(request):
    """Debian's docker-registry in a namespace of its own on the cluster's bridge, over TLS that every
    daemon here trusts: ``.host`` (what image names start with), ``.manifest(repository, reference)``,
    ``.cut_off(node)`` / ``.reconnect(node)``."""
    yield from _part(request, "image registry", registry_ns.missing_prerequisites(), registry_ns.RegistryNamespace)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    """After a test that used ``slurm``: its jobs cancelled and every node idle again, before any
    of its fixtures is torn down (fresh_nas would otherwise empty the NAS under a running job)."""
    s = getattr(item, "funcargs", {}).get("slurm")
    error = None
    if s is not None:
        try:
            s.clear()
        except Exception as e:  # reported once the fixtures are torn down all the same
            error = e
    result = yield
    if error is not None:
        raise error
    return result


NODE_LOG_LINES = 60
NODE_LOG_HEAD = 40
CXX_FRAME = re.compile(r"frame #\d+: |Exception raised from |<omitting python frames>")
"""The lines of a C++ stack that c10 prints under its errors: dropped from a log shown in a report."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used ``fresh_nas`` shows the first and last lines of every node's kept log
    of every run it made, C++ stack frames left out, and the supervisor's exit records (the NAS is
    emptied after it, and CI keeps no tmp_path): the evidence of what each node did, in the report
    itself (a restarted node's first end is at the head of its log)."""
    report = yield
    nas = getattr(item, "funcargs", {}).get("fresh_nas")
    if call.when == "call" and report.failed and nas is not None:
        for log in sorted(Path(nas).glob("*/.ddp-deploy/*/runs/*/*/log")):
            report.sections.append((f"kept log {log.relative_to(nas)}", kept_log_excerpt(log)))
    return report


def kept_log_excerpt(log: Path) -> str:
    """A node's kept log as a failure report shows it: its supervisor's exit records, its first
    ``NODE_LOG_HEAD`` and last ``NODE_LOG_LINES`` lines, C++ stack frames left out."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if not CXX_FRAME.match(line)]
        exits = log.with_name("exits")
        ends = [e for e in exits.read_text(errors="replace").splitlines() if e] if exits.exists() else []
    except OSError as e:
        return f"(not read: {e})"
    if len(lines) > NODE_LOG_HEAD + NODE_LOG_LINES:
        lines = [*lines[:NODE_LOG_HEAD], f"[... {len(lines) - NODE_LOG_HEAD - NODE_LOG_LINES} lines ...]",
                 *lines[-NODE_LOG_LINES:]]
    return "\n".join([*([f"exits (time, code): {' | '.join(ends)}"] if ends else []), *lines])


@pytest.fixture
def fresh_nas(cluster):
    """An empty NAS for each test (the cluster itself is shared by the session), and after it."""
    nas = Path(cluster.nas_dir)
    empty_nas(nas)
    yield nas
    empty_nas(nas)


@pytest.fixture
def record_fault(request):
    """Appends one fault's measured figures to $DDP_FAULTS_RECORD, if set (tests/FAULTS.md)."""
    def write(**figures) -> None:
        target = os.environ.get("DDP_FAULTS_RECORD")
        if target:
            with open(target, "a") as fh:
                fh.write(json.dumps({"test": request.node.name, **figures}) + "\n")
    return write


ACL_XATTR = "system.posix_acl_access"
ACL_USER, ACL_MASK, ACL_UNDEFINED = 0x02, 0x10, 0xFFFFFFFF


def _acl(path: Path) -> dict[tuple[int, int], int]:
    """``path``'s POSIX ACL as {(tag, id): permissions}: its own, else the one its mode means."""
    try:
        raw = os.getxattr(path, ACL_XATTR)
        return {(tag, uid): perm for tag, perm, uid in struct.iter_unpack("<HHI", raw[4:])}
    except OSError:
        mode = path.stat().st_mode
        return {(0x01, ACL_UNDEFINED): (mode >> 6) & 7, (0x04, ACL_UNDEFINED): (mode >> 3) & 7,
                (0x20, ACL_UNDEFINED): mode & 7}


def _let_pass(path: Path, uid: int, allow: bool = True) -> None:
    """Lets ``uid`` pass through ``path`` (x), or no longer, by its POSIX ACL, the other entries kept
    (``setfacl -m u:UID:x`` / ``setfacl -x u:UID``; no acl tools here). The ACL goes once no user
    entry is left, and the mode's group bits, which showed its mask, are the group's again."""
    entries = _acl(path)
    entries.pop((ACL_MASK, ACL_UNDEFINED), None)
    if allow:
        entries[(ACL_USER, uid)] = 1
    else:
        entries.pop((ACL_USER, uid), None)
    group = entries[(0x04, ACL_UNDEFINED)]
    if not any(tag == ACL_USER for tag, _ in entries):
        with contextlib.suppress(OSError):
            os.removexattr(path, ACL_XATTR)
        os.chmod(path, (path.stat().st_mode & ~0o070) | (group << 3))
        return
    entries[(ACL_MASK, ACL_UNDEFINED)] = group | max(p for (t, _), p in entries.items() if t == ACL_USER)
    os.setxattr(path, ACL_XATTR, struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, perm, uid) for (tag, uid), perm in sorted(entries.items())))


@pytest.fixture(scope="session")
def tenant(cluster):
    """A second user of the nodes, ``ddp-tenant<site>``, with a home of its own (the nodes share
    this machine's accounts, and their sshd takes the cluster's key for any user, from a file every
    user can read): jobs of two users on the same nodes. Its processes end and it is removed after
    the session."""
    name = f"ddp-tenant{cluster.site.index}"
    for _ in range(20):  # another lane's useradd may hold the account files' lock a moment
        # "*": no password, yet not a locked account, which sshd without PAM refuses
        made = subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", "--password", "*", name],
                              capture_output=True, text=True)
        if made.returncode != 10:  # 10: cannot lock the account files
            break
        time.sleep(0.5)
    if made.returncode not in (0, 9):  # 9: there already (a run killed before its teardown)
        _unavailable(f"cannot add the user {name}: {made.stderr.strip()}")
    account = pwd.getpwnam(name)
    os.chmod(account.pw_dir, 0o700)
    # The tests' interpreter lives under root's home (pyenv): the user may pass through it, no more.
    home = Path(pwd.getpwuid(0).pw_dir)
    _let_pass(home, account.pw_uid)
    yield account
    subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
    _let_pass(home, account.pw_uid, allow=False)
    for _ in range(20):
        if subprocess.run(["userdel", "--remove", name], capture_output=True).returncode != 10:
            break
        time.sleep(0.5)


@pytest.fixture(scope="session")
def containerd_node(request):
    """``node9``: one more host on the cluster whose Docker 26 keeps images in the containerd image
    store (see containerd_node.py), holding only ``ddp-base:cpu``; not in the cluster's own hosts
    (tests add ``.inventory_node()`` to their hosts.yaml). ``.docker(...)`` reads its daemon."""
    from . import containerd_node as ctr

    yield from _part(request, "containerd-store node", ctr.missing_prerequisites(), ctr.ContainerdNode,
                     unavailable=(ctr.Unavailable,))
