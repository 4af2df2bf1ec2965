"""A real multi-host cluster on one Linux machine, for the cluster tests and the benchmarks.

Each node is a network namespace ``ddpnI`` on the bridge ``ddpbr0`` (198.18.0.0/24, the
operator side is 198.18.0.1, node I is 198.18.0.(10+I)) with its own sshd on port 22 and its
own dockerd, whose socket every SSH session of that node gets as ``DOCKER_HOST``. An operator
dockerd in the root namespace builds images; the base image ``ddp-base:cpu`` (Debian bookworm,
python3.11, a venv /opt/venv with torch, numpy, pyyaml and tensorboard) is built once without any registry,
cached as a tar under /var/cache/ddp-bundle/ and loaded into the operator daemon only: getting
images onto the nodes is the deploy tool's job, and what the tests check.

Daemon state lives at fixed paths (/run/ddpcluster, /var/lib/ddpcluster) so that a crashed run
can always be cleaned up by name; keys, configs, logs and the NAS live in the state directory.

    python -m tests.cluster.netcluster up --nodes 3 --state DIR    # writes DIR/cluster.json
    python -m tests.cluster.netcluster down --state DIR

Needs root, iproute2, iptables, nsenter (util-linux), openssh-server, docker.io and, to build
the base image the first time, debootstrap.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

BRIDGE = "ddpbr0"
NS_PREFIX = "ddpn"
VETH_PREFIX = "ddpv"
SUBNET_PREFIX = "198.18.0."
OPERATOR_ADDRESS = SUBNET_PREFIX + "1"
NODE_INTERFACE = "eth0"
FORWARD_RULE = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]

RUN_ROOT = Path("/run/ddpcluster")          # sockets, pidfiles, exec roots (short paths)
DATA_ROOT = Path("/var/lib/ddpcluster")     # docker data roots
CURRENT = RUN_ROOT / "current.json"         # which state dir the running cluster uses
# The Slurm cluster on top (slurmcluster.py) keeps its config, munge and controller state here;
# every SSH session gets SLURM_CONF, which points nowhere while Slurm is not up.
SLURM_ROOT = RUN_ROOT / "slurm"
SLURM_CONF = SLURM_ROOT / "slurm.conf"
# In the environment of every daemon slurmcluster.py starts (and so of what they fork: slurmscriptd,
# slurmstepd), whose command lines do not all name a path of ours: teardown finds them by it.
DAEMON_MARK = "DDPCLUSTER_DAEMON"

CGROUP = "ddpcluster"  # the cgroup every daemon of ours puts its containers in (cgroup v1)
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_SHARES = 3 * 1024
"""The weight of the cluster's containers together: each node as much as one process at nice 0.
dockerd's default parent, ``/docker``, weighs 1024 for all containers of all nodes together: next
to the other lane of ``make test`` (reniced to 5, 335 a process) a whole cluster job got about what
that lane's training got. With three nodes' weight it gets about three quarters of the cores while
both lanes compute, and the other lane still uses all of what it leaves."""
STATE_PARENT, STATE_PREFIX = "/var/tmp", "ddpcluster-"  # a cluster's own state dir, when none is chosen
CACHE_DIR = Path("/var/cache/ddp-bundle")
OPERATOR_STORE_PREFIX = "operator-docker-"  # + base image key: the operator's kept data root
NODE_STORE_PREFIX = "node-docker-"  # + base image key: the data root every node's starts as a copy of



@dataclasses.dataclass(frozen=True)
class Site:
    """Where one cluster lives on this machine: its bridge, subnet, namespaces, fixed paths and
    cgroup. Site 0 is the names above (the parts built on a cluster, Slurm, the registry and the
    containerd node, use those); site *k* > 0 has names of its own, so that `make test` can run a
    second cluster beside the first (tools/suite/lanes.py) and each one's setup and teardown touch only
    what is its own."""
    index: int = 0

    def _named(self, zero: str, other: str) -> str:
        return zero if self.index == 0 else other.format(k=self.index)

    @property
    def bridge(self) -> str:
        return f"ddpbr{self.index}"

    @property
    def ns_prefix(self) -> str:
        return self._named(NS_PREFIX, "ddp{k}n")

    @property
    def veth_prefix(self) -> str:
        return self._named(VETH_PREFIX, "ddp{k}v")

    @property
    def subnet_prefix(self) -> str:
        return f"198.18.{self.index}."

    @property
    def operator_address(self) -> str:
        return self.subnet_prefix + "1"

    @property
    def forward_rule(self) -> list[str]:
        return ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]

    @property
    def run_root(self) -> Path:
        return Path(self._named(str(RUN_ROOT), str(RUN_ROOT) + "{k}"))

    @property
    def data_root(self) -> Path:
        return Path(self._named(str(DATA_ROOT), str(DATA_ROOT) + "{k}"))

    @property
    def current(self) -> Path:
        return self.run_root / CURRENT.name

    @property
    def state_prefix(self) -> str:
        return self._named(STATE_PREFIX, "ddpcluster{k}-")

    @property
    def cgroup(self) -> str:
        return self._named(CGROUP, CGROUP + "{k}")

    @property
    def store_prefix(self) -> str:
        return self._named(OPERATOR_STORE_PREFIX, "operator{k}-docker-")

    def operator_store(self) -> Path:
        """The operator daemon's data root, kept between runs so the base image is already in it."""
        return CACHE_DIR / f"{self.store_prefix}{base_image_key()}"

    def stores(self) -> list[Path]:
        return list(CACHE_DIR.glob(self.store_prefix + "*"))


FIRST_SITE = Site(0)

BASE_IMAGE = "ddp-base:cpu"
BASE_SUITE = "bookworm"
BASE_INCLUDE = "python3,python3-venv,python3-pip,ca-certificates"
# What the Dockerfile's docker/requirements.txt asks for is in the base already: the build has no
# index to install from (tensorboard: trainer/metrics.py's event files).
BASE_REQUIREMENTS = ("torch==2.13.0", "numpy", "pyyaml", "tensorboard", "py-spy")
BASE_PYTHON_TAG = "311"  # bookworm's python3 is 3.11: the wheels must be cp311
BASE_PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_RECIPE_VERSION = 1  # bump when the recipe below changes in a way the key does not see

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRED_TOOLS = ("ip", "iptables", "nsenter", "sshd", "ssh", "ssh-keygen", "dockerd", "docker")


class ClusterError(RuntimeError):
    """The cluster could not be set up (the message says which step and why)."""


def missing_prerequisites(need_debootstrap: bool | None = None) -> list[str]:
    """What stops a cluster from being built here: empty when everything is in place."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root (network namespaces, sshd and dockerd need root)")
    for tool in REQUIRED_TOOLS:
        if _which(tool) is None:
            problems.append(f"{tool} not found")
    if need_debootstrap is None:
        need_debootstrap = not base_image_cache_path().exists()
    if need_debootstrap and _which("debootstrap") is None:
        problems.append("debootstrap not found (needed once, to build the cached base image)")
    return problems


DEBIAN_ROOT_BASHRC = Path("/usr/share/base-files/dot.bashrc")
"""root's ~/.bashrc on a freshly installed Debian machine (base-files ships it)."""


def fresh_login_shell(argv: list[str]) -> list[str]:
    """``argv`` (a node's sshd) run with root's ``~/.bashrc`` as a freshly installed Debian node has
    it, by a bind mount in the mount namespace of its own that ``ip netns exec`` gives it; this
    machine's file is untouched. The nodes share this machine's root home, and sshd runs every
    command through root's bash, which reads ``~/.bashrc`` even when not interactive: here that
    file runs pyenv's and cargo's init (about 0.1 s of CPU per SSH command, a whole core-minute
    in a few hundred launches) and puts pyenv's shims before the session's PATH, which a node of
    its own has neither of."""
    rc = Path(os.path.expanduser("~root")) / ".bashrc"
    if not rc.is_file() or not DEBIAN_ROOT_BASHRC.is_file():
        return argv
    return ["sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
            str(DEBIAN_ROOT_BASHRC), str(rc), *argv]


def _which(tool: str) -> str | None:
    path = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"
    return shutil.which(tool, path=path)


# --------------------------------------------------------------------------- small helpers

def _log(msg: str) -> None:
    print(f"[netcluster] {msg}", file=sys.stderr, flush=True)


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 120, **kw: Any):
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise ClusterError(f"{shlex.join(argv)} exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc


def _ns_path(ns: str) -> str:
    return f"/var/run/netns/{ns}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill_and_wait(pids: Sequence[int], grace: float = 10.0) -> None:
    """SIGTERM the given pids, wait up to ``grace`` seconds, then SIGKILL what is left."""
    pids = [p for p in set(pids) if p > 1 and p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        _reap()
        time.sleep(0.1)
    for pid in pids:
        if _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        _reap()
        time.sleep(0.05)


def _reap() -> None:
    """Collect exited children of this process (daemons we started) so they do not linger."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _processes_referencing(roots: Sequence[Path]) -> list[int]:
    """Pids whose command line mentions one of ``roots`` (our daemons, containerd, shims)."""
    needles = [str(r).rstrip("/").encode() + b"/" for r in roots]  # /run/ddpcluster/, never /run/ddpcluster1/
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if any(n in cmdline for n in needles):
            found.append(int(entry.name))
    return found


def _marked_processes(mark: str | None = None) -> list[int]:
    """Pids whose environment carries DAEMON_MARK (set to ``mark``, where given: one part's own
    daemons), and every descendant of theirs."""
    needle = (f"{DAEMON_MARK}={mark}\0" if mark is not None else f"{DAEMON_MARK}=").encode()
    marked: list[int] = []
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if needle in (entry / "environ").read_bytes():  # each entry ends with NUL, the last too
                marked.append(pid)
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    found, todo = set(marked), list(marked)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found)


def plug_namespace(ns: str, veth: str, address: str, bridge: str = BRIDGE) -> None:
    """A new network namespace ``ns`` on ``bridge``: its ``NODE_INTERFACE`` at ``address``, the
    other end ``veth`` on the bridge."""
    _run(["ip", "netns", "add", ns])
    _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", NODE_INTERFACE, "netns", ns])
    _run(["ip", "link", "set", veth, "master", bridge, "up"])
    inside = ["ip", "netns", "exec", ns, "ip"]
    _run([*inside, "addr", "add", f"{address}/24", "dev", NODE_INTERFACE])
    _run([*inside, "link", "set", NODE_INTERFACE, "up"])
    _run([*inside, "link", "set", "lo", "up"])


def _unmount_under(root: Path) -> None:
    """Unmount every mount point below ``root``, deepest first."""
    prefix = str(root).rstrip("/") + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point.startswith(prefix) or point == str(root):
            points.append(point)
    for point in sorted(set(points), key=len, reverse=True):
        r = subprocess.run(["umount", point], capture_output=True)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True)


@functools.lru_cache(maxsize=None)
def _dockerd_major() -> int:
    out = _run(["dockerd", "--version"]).stdout  # "Docker version 20.10.24+dfsg1, build ..."
    try:
        return int(out.split("version", 1)[1].strip().split(".")[0])
    except (IndexError, ValueError):
        return 0


class _Timings:
    def __init__(self) -> None:
        self.steps: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - start
            self.steps[name] = round(self.steps.get(name, 0.0) + took, 2)
            _log(f"{name}: {took:.1f} s")


# --------------------------------------------------------------------------- the trainer image's build context

BUILD_CONTEXT = ("Dockerfile", ".dockerignore", "docker", "agent", "trainer")
"""What the repository's Dockerfile is built from: its .dockerignore lets nothing else in. A copy
of the whole checkout instead takes its venvs along (11 GB in a clean clone after `make install`),
which once filled the disk in the middle of `make test`."""


def copy_build_context(dest: Path) -> Path:
    """A copy of the trainer image's build context at ``dest`` (made, or replaced), to edit and build."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for part in BUILD_CONTEXT:
        source = REPO_ROOT / part
        if source.is_dir():
            shutil.copytree(source, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, dest / part)
    return dest


# --------------------------------------------------------------------------- the base image

def base_image_key() -> str:
    recipe = json.dumps({
        "version": BASE_RECIPE_VERSION, "suite": BASE_SUITE, "include": BASE_INCLUDE,
        "requirements": BASE_REQUIREMENTS, "python": BASE_PYTHON_TAG, "path": BASE_PATH,
        "name": BASE_IMAGE,
    }, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def base_image_cache_path() -> Path:
    return CACHE_DIR / f"ddp-base-cpu-{base_image_key()}.tar"


def _debian_mirror() -> str:
    """The Debian mirror apt uses here (debootstrap must fetch from the same place)."""
    stanzas = []
    for path in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")):
        stanzas += path.read_text().split("\n\n")
    for stanza in stanzas:
        fields = dict(line.split(":", 1) for line in stanza.splitlines()
                      if ":" in line and not line.startswith((" ", "#")))
        suites = fields.get("Suites", "").split()
        if BASE_SUITE in suites and fields.get("URIs", "").split():
            return fields["URIs"].split()[0]
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = [p for p in line.split() if not p.startswith("[")]
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == BASE_SUITE:
                return parts[1]
    return "http://deb.debian.org/debian"


def build_base_image_tar(docker_host: str, timings: _Timings) -> Path:
    """Build ddp-base:cpu into the daemon at ``docker_host`` and save it to the cache."""
    target = base_image_cache_path()
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ddp-base-", dir="/var/tmp"))
    rootfs, wheels = work / "rootfs", work / "wheels"
    try:
        if _which("debootstrap") is None:
            raise ClusterError("debootstrap is needed to build the base image once; "
                               "apt-get install -y debootstrap")
        with timings.step("base image: debootstrap"):
            _run(["debootstrap", "--variant=minbase", f"--include={BASE_INCLUDE}",
                  BASE_SUITE, str(rootfs), _debian_mirror()], timeout=900)
        with timings.step("base image: pip download"):
            _run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels),
                  "--only-binary=:all:", "--python-version", BASE_PYTHON_TAG,
                  "--implementation", "cp", "--abi", f"cp{BASE_PYTHON_TAG}", "--abi", "abi3",
                  "--abi", "none",
                  "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                  "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_5_x86_64",
                  "--platform", "linux_x86_64", "--platform", "any",
                  *BASE_REQUIREMENTS], timeout=900)
        with timings.step("base image: venv + pip install in rootfs"):
            shutil.copytree(wheels, rootfs / "tmp" / "wheels")
            env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
                   "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}
            _run(["chroot", str(rootfs), "/usr/bin/python3", "-m", "venv", "/opt/venv"], env=env)
            _run(["chroot", str(rootfs), "/opt/venv/bin/pip", "install", "--quiet",
                  "--no-index", "--find-links", "/tmp/wheels", *BASE_REQUIREMENTS],
                 env=env, timeout=900)
            shutil.rmtree(rootfs / "tmp" / "wheels")
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "root/.cache"):
                for child in (rootfs / junk).glob("*"):
                    if child.is_file():
                        child.unlink()
        with timings.step("base image: docker import"):
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."],
                                   stdout=subprocess.PIPE)
            try:
                _run(["docker", "-H", docker_host, "import",
                      "--change", f"ENV PATH={BASE_PATH}",
                      "--change", 'CMD ["python3"]', "-", BASE_IMAGE],
                     stdin=tar.stdout, timeout=900)
            finally:
                tar.stdout.close()
                if tar.wait() != 0:
                    raise ClusterError("tar of the base rootfs failed")
        with timings.step("base image: docker save to cache"):
            partial = target.with_suffix(".partial")
            _run(["docker", "-H", docker_host, "save", "-o", str(partial), BASE_IMAGE],
                 timeout=900)
            partial.rename(target)
        for stale in CACHE_DIR.glob("ddp-base-cpu-*.tar"):
            if stale != target:
                stale.unlink()
        for stale in [*CACHE_DIR.glob("operator*-docker-*"), *CACHE_DIR.glob(NODE_STORE_PREFIX + "*")]:  # every site's
            if not stale.name.endswith(f"-docker-{base_image_key()}"):
                shutil.rmtree(stale, ignore_errors=True)
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def node_store_template() -> Path:
    """The data root each node's dockerd starts as a copy of: the base image alone, kept between runs."""
    return CACHE_DIR / f"{NODE_STORE_PREFIX}{base_image_key()}"


def ensure_base_image(docker_host: str, timings: _Timings) -> None:
    """Make the daemon hold the base image and nothing else: reset a kept store, or load the
    cached tar (about 35 s here), building the tar first if there is none (about 3 minutes)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    docker = ["docker", "-H", docker_host]
    have = _run([*docker, "image", "inspect", "--format", "{{.Id}}", BASE_IMAGE], check=False)
    if have.returncode == 0:
        with timings.step("operator store: reset to the base image only"):
            base_id = have.stdout.strip()
            containers = _run([*docker, "ps", "-aq"]).stdout.split()
            if containers:
                _run([*docker, "rm", "-f", "-v", *containers])
            images = _run([*docker, "images", "-aq", "--no-trunc"]).stdout.split()
            others = sorted({i for i in images if i != base_id})
            if others:
                _run([*docker, "rmi", "-f", *others], check=False)
            _run([*docker, "volume", "prune", "-f"], check=False)
            _run([*docker, "builder", "prune", "-af"], check=False)
        return
    with open(CACHE_DIR / "base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time
        cached = base_image_cache_path()
        if not cached.exists():
            _log(f"no cached {BASE_IMAGE} at {cached}: building it (about 3 minutes)")
            build_base_image_tar(docker_host, timings)
            return
    with timings.step("base image: docker load from cache"):
        _run([*docker, "load", "-q", "-i", str(cached)], timeout=900)


# --------------------------------------------------------------------------- the cluster

@dataclasses.dataclass
class Host:
    """One node: a network namespace with its own sshd and dockerd."""
    name: str
    ns: str
    address: str
    index: int
    site: Site = FIRST_SITE

    @property
    def veth(self) -> str:
        return f"{self.site.veth_prefix}{self.index}"

    @property
    def run_dir(self) -> Path:
        return self.site.run_root / self.name

    @property
    def docker_sock(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def docker_host(self) -> str:
        return f"unix://{self.docker_sock}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ns": self.ns, "address": self.address,
                "index": self.index, "interface": NODE_INTERFACE, "veth": self.veth,
                "docker_host": self.docker_host}


LIGHT_MODEL = ("--model", "lenet")
"""The model of the tests' jobs where what a test proves is not the model (a deploy, a refusal):
LeNet-5, 62 thousand parameters against the default ConvNet's 1.2 million, whose gradients'
all-reduce and optimizer dominate a test's small steps. A local 2-process job took 8.0 core-s with it
against 17.5 (48 steps of 32 samples), 9.8 against 15.9 (128 steps of 4): bench/bench_job_cpu.py. The
trainer's own tests, the shipped job and the jobs whose length in time a test relies on keep the
default: test_faults' (a stop sent through the CLI must find the job running: with LeNet it had
finished, under a whole run's load), Slurm's stop and requeue, the stall restart."""


class NetCluster:
    """A set of SSH-reachable hosts, each with its own Docker daemon, plus an operator daemon.

    ``up()`` builds it (cleaning leftovers of an earlier run first), ``down()`` removes every
    trace of it; ``down()`` is safe to call any number of times, also after a failed ``up()``.

    Parts built on top of it (the containerd node, the registry, Slurm) are ``attach()``ed by their
    fixtures: ``down()`` stops them first and ``up()`` starts them again, so a test that rebuilds
    the cluster leaves them working for the tests after it.
    """

    def __init__(self, nodes: int = 3, state_dir: str | os.PathLike | None = None,
                 keep_operator_store: bool = True, site: Site = FIRST_SITE, spares: int = 0) -> None:
        """``keep_operator_store``: reuse the operator's data root kept under CACHE_DIR, reset
        to hold only the base image (warm setup in seconds); False starts the operator daemon
        empty and loads the base image from the cached tar (about 35 s more). ``site``: where on
        this machine (Site); clusters on different sites run side by side. ``spares``: hosts made
        as the nodes are, after them (node4, ...), that no hosts.yaml of ``hosts_config`` lists:
        ``spare_hosts``, for a test to list as hosts.yaml's spares."""
        if not 1 <= nodes + spares <= 200 or nodes < 1 or spares < 0:
            raise ValueError(f"nodes and spares must be between 1 and 200 in all, got {nodes} and {spares}")
        self.site = site
        made = [Host(name=f"node{i}", ns=f"{site.ns_prefix}{i}", address=f"{site.subnet_prefix}{10 + i}", index=i,
                     site=site) for i in range(1, nodes + spares + 1)]
        self.hosts, self.spare_hosts = made[:nodes], made[nodes:]
        self._own_state_dir = state_dir is None
        self.state_dir = Path(state_dir) if state_dir else None
        self.base_image = BASE_IMAGE
        self.keep_operator_store = keep_operator_store
        self.timings = _Timings()
        self._daemons: dict[str, subprocess.Popen] = {}
        self._parts: list[Any] = []

    # ---- parts built on the cluster

    def attach(self, part: Any) -> None:
        """``part`` (with ``start()`` and ``stop()``) is stopped by ``down()`` and started by ``up()``.
        Parts use the first site's fixed names and ports: only a cluster there takes them."""
        if self.site != FIRST_SITE:
            raise ClusterError(f"{type(part).__name__} runs on the first site's cluster only, not on site "
                               f"{self.site.index}'s")
        self._parts.append(part)

    def detach(self, part: Any) -> None:
        if part in self._parts:
            self._parts.remove(part)

    # ---- paths

    @property
    def ssh_key(self) -> str:
        return str(self.state_dir / "ssh" / "id_ed25519")

    @property
    def known_hosts(self) -> str:
        return str(self.state_dir / "ssh" / "known_hosts")

    @property
    def nas_dir(self) -> str:
        return str(self.state_dir / "nas")

    @property
    def operator_cache_dir(self) -> str:
        """The operator's image cache (DDP_DEPLOY_IMAGE_CACHE) for this cluster's deploys: its own,
        so that a cluster beside it never evicts what it is about to read."""
        return str(self.state_dir / "operator-cache" / "images")

    @property
    def operator_docker_host(self) -> str:
        return f"unix://{self.site.run_root / 'operator' / 'docker.sock'}"

    @property
    def operator_address(self) -> str:
        return self.site.operator_address

    @property
    def bridge(self) -> str:
        return self.site.bridge

    @property
    def machines(self) -> list[Host]:
        """Every host made: the nodes, then the spares."""
        return [*self.hosts, *self.spare_hosts]

    def host(self, name: str) -> Host:
        for h in self.machines:
            if h.name == name:
                return h
        raise KeyError(f"no node named {name!r}; nodes: {[h.name for h in self.machines]}")

    def node_docker_host(self, name: str) -> str:
        return self.host(name).docker_host

    def session_path(self) -> str:
        """PATH of every SSH session: the python running the tests first, then the usual."""
        return f"{os.path.dirname(sys.executable)}:/usr/local/sbin:/usr/local/bin:" \
               "/usr/sbin:/usr/bin:/sbin:/bin"

    # ---- lifecycle

    def up(self) -> "NetCluster":
        problems = missing_prerequisites()
        if problems:
            raise ClusterError("cannot build the test cluster: " + "; ".join(problems))
        start = time.monotonic()
        self.timings = _Timings()
        try:
            with self.timings.step("clean leftovers"):
                cleanup_leftovers(self.site)
            self._prepare_state_dir()
            self.site.run_root.mkdir(parents=True, exist_ok=True)
            self.site.current.write_text(json.dumps({"state_dir": str(self.state_dir),
                                           "owned": self._own_state_dir}))
            with self.timings.step("operator dockerd"):
                self._start_operator()
            loader_error: list[BaseException] = []

            def load() -> None:
                try:
                    ensure_base_image(self.operator_docker_host, self.timings)
                except BaseException as e:  # re-raised in the main thread
                    loader_error.append(e)
            loader = threading.Thread(target=load, name="base-image", daemon=True)
            loader.start()
            with self.timings.step("network"):
                self._setup_network()
            with self.timings.step("ssh keys"):
                self._make_keys()
            with self.timings.step("sshd per node"):
                for h in self.machines:
                    self._start_sshd(h)
            with self.timings.step("wait for base image"):
                while loader.is_alive():
                    loader.join(0.2)
                if loader_error:
                    raise ClusterError(f"base image: {loader_error[0]}") from loader_error[0]
            with self.timings.step("node stores: copies of the base's"):
                self._copy_node_stores()
            with self.timings.step("dockerd per node"):
                for h in self.machines:
                    self._start_dockerd(h.name, h)
                for h in self.machines:
                    self._wait_sshd(h)
                    self._wait_docker(h.docker_host, h.name)
            self._write_description()
            for part in self._parts:
                with self.timings.step(f"restart {type(part).__name__}"):
                    part.start()
            self.timings.steps["total"] = round(time.monotonic() - start, 2)
            _log(f"cluster of {len(self.hosts)} nodes and {len(self.spare_hosts)} spares up in {time.monotonic() - start:.1f} s "
                 f"(state {self.state_dir})")
            return self
        except BaseException:
            _log("setup failed: tearing down what was started")
            self.down()
            raise

    def down(self) -> None:
        """Stop every daemon, remove namespaces, links, the iptables rule and state."""
        start = time.monotonic()
        for part in reversed(self._parts):
            try:
                part.stop()
            except Exception as e:  # the teardown below ends what it left
                _log(f"stopping {type(part).__name__}: {e}")
        teardown(self.state_dir, remove_state=self._own_state_dir,
                 procs=list(self._daemons.values()), site=self.site)
        self._daemons.clear()
        _log(f"cluster down in {time.monotonic() - start:.1f} s")

    def __enter__(self) -> "NetCluster":
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    # ---- setup steps

    def _prepare_state_dir(self) -> None:
        if self.state_dir is None:
            self.state_dir = Path(tempfile.mkdtemp(prefix=self.site.state_prefix, dir=STATE_PARENT))
        self.state_dir = self.state_dir.resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o755)
        for sub in ("ssh", "nodes", "logs"):
            (self.state_dir / sub).mkdir(exist_ok=True)
        nas = Path(self.nas_dir)
        for sub in ("", "data", "ckpt"):
            (nas / sub).mkdir(parents=True, exist_ok=True)
            os.chown(nas / sub, 1000, 1000)  # the container user
            os.chmod(nas / sub, 0o777)

    def _setup_network(self) -> None:
        site = self.site
        _run(["ip", "link", "add", site.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{site.operator_address}/24", "dev", site.bridge])
        _run(["ip", "link", "set", site.bridge, "up"])
        _run(["iptables", "-I", *site.forward_rule])
        for h in self.machines:
            plug_namespace(h.ns, h.veth, h.address, site.bridge)

    def _make_keys(self) -> None:
        ssh = self.state_dir / "ssh"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ddpcluster-operator",
              "-f", self.ssh_key])
        (ssh / "authorized_keys").write_text(Path(self.ssh_key + ".pub").read_text())
        # readable by every user: sshd reads it as the user who logs in (the tests' second user too)
        os.chmod(ssh / "authorized_keys", 0o644)
        lines = []
        for h in self.machines:
            d = self.state_dir / "nodes" / h.name
            d.mkdir(exist_ok=True)
            key = d / "ssh_host_ed25519_key"
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", str(key)])
            kind, blob = Path(str(key) + ".pub").read_text().split()[:2]
            lines.append(f"{h.address} {kind} {blob}\n")
        Path(self.known_hosts).write_text("".join(lines))

    def _sshd_config(self, h: Host) -> str:
        d = self.state_dir / "nodes" / h.name
        # XDG_CACHE_HOME: each node's own, as on machines of their own (the nodes share root's home)
        slurm_conf = SLURM_CONF if self.site == FIRST_SITE else self.site.run_root / "slurm" / SLURM_CONF.name
        env = {"DOCKER_HOST": h.docker_host, "PATH": self.session_path(), "SLURM_CONF": slurm_conf,
               "XDG_CACHE_HOME": str(self.node_cache_dir(h.name))}
        return "\n".join([
            f"ListenAddress {h.address}",
            "Port 22",
            f"HostKey {d / 'ssh_host_ed25519_key'}",
            f"PidFile {h.run_dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.state_dir / 'ssh' / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "MaxStartups 100:30:200",
            "MaxSessions 100",
            "LogLevel INFO",
            "Subsystem sftp internal-sftp",
            "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()),
            "",
        ])

    def node_cache_dir(self, name: str) -> Path:
        """Node ``name``'s XDG_CACHE_HOME in its SSH sessions (where it keeps its probe answers)."""
        return self.state_dir / "nodes" / name / "cache"

    def _start_sshd(self, h: Host) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        h.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "nodes" / h.name / "sshd_config"
        config.write_text(self._sshd_config(h))
        _run(["/usr/sbin/sshd", "-t", "-f", str(config)])
        log = self.state_dir / "logs" / f"sshd-{h.name}.log"
        sshd = ["/usr/sbin/sshd", "-D", "-f", str(config), "-E", str(log)]
        self._daemons[f"sshd-{h.name}"] = (subprocess.Popen(
            ["ip", "netns", "exec", h.ns, *fresh_login_shell(sshd)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))

    def _start_operator(self) -> None:
        if not self.keep_operator_store:
            self._start_dockerd("operator", None)
            self._wait_docker(self.operator_docker_host, "operator")
            return
        store = self.site.operator_store()
        try:
            self._start_dockerd("operator", None, data=store)
            self._wait_docker(self.operator_docker_host, "operator")
        except ClusterError as e:
            _log(f"the kept operator store {store} is unusable, starting afresh: {e}")
            teardown_daemons([self._daemons.pop("dockerd-operator")])
            _unmount_under(store)
            shutil.rmtree(store, ignore_errors=True)
            self._start_dockerd("operator", None, data=store)
            self._wait_docker(self.operator_docker_host, "operator")

    def _start_dockerd(self, name: str, h: Host | None, data: Path | None = None) -> str:
        run_dir = self.site.run_root / name
        run_dir.mkdir(parents=True, exist_ok=True)
        data = data or self.site.data_root / name
        data.mkdir(parents=True, exist_ok=True)
        sock = run_dir / "docker.sock"
        if Path("/run/containerd/containerd.sock").exists():
            # dockerd would then use that shared containerd, whose containers run in the root
            # namespace: --network host would not be the node's network.
            raise ClusterError("a system containerd is running (/run/containerd/containerd.sock)"
                               "; stop it: every test daemon must start its own containerd")
        argv = ["dockerd", "--data-root", str(data), "--exec-root", str(run_dir / "exec"),
                "--pidfile", str(run_dir / "dockerd.pid"), "-H", f"unix://{sock}",
                "--bridge=none", "--iptables=false", "--ip-masq=false",
                "--shutdown-timeout", "3", "--storage-driver", "overlay2",
                "--log-driver", "json-file"]
        # Our own config file, so that no /etc/docker/daemon.json leaks in; dockerd 20.10
        # derives its ID from a key file that all daemons would share without this setting.
        config: dict[str, Any] = {}
        if _dockerd_major() < 23:
            config["deprecated-key-path"] = str(data / "key.json")
        (run_dir / "daemon.json").write_text(json.dumps(config))
        argv += ["--config-file", str(run_dir / "daemon.json"), *cgroup_parent_args(self.site.cgroup)]
        if h is not None:
            # not `ip netns exec`: it remounts /sys and dockerd then finds no devices cgroup
            argv = ["nsenter", f"--net={_ns_path(h.ns)}", *argv]
        log = open(self.state_dir / "logs" / f"dockerd-{name}.log", "ab")
        self._daemons[f"dockerd-{name}"] = (subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, "PATH": self.session_path()}))
        log.close()
        return f"unix://{sock}"

    def _copy_node_stores(self) -> None:
        """Every node's data root starts as a copy of node_store_template() (made first where there is
        none): the node holds the base image, as a node that ran an earlier image of the job does, so
        a deploy ships the layers above it, and a test that removes the job's image from a node does not
        make the next deploy send the whole 1.2 GB again (13 such ships in one run, about 33 core-s a
        node each: bench/RESULTS.md). Each copy drops the template daemon's identity: its dockerd
        makes its own.

        The layers (overlay2/) are hard links to the template's files, the rest is copied: dockerd never
        writes a committed layer's files (a container writes to its own upper layer, a removed image
        unlinks them), while its databases beside them are written in place. So the nodes of both
        sites share one copy of the base on disk and in the page cache (its libtorch_cpu.so is 434 MB)
        instead of one each, and a node's store takes 0.6 core-s to make and 0.3 to remove, where a
        whole copy took 2.4 to 3.9 to make, 1.0 to remove, and wrote 1.3 GB."""
        template = node_store_template()
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        with open(CACHE_DIR / "node-store.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other site may be making it: once
            if not template.exists():
                self._make_node_store(template)
        for h in self.machines:
            data = self.site.data_root / h.name
            if data.exists():
                _unmount_under(data)
                shutil.rmtree(data)
            data.parent.mkdir(parents=True, exist_ok=True)
            data.mkdir()
            shutil.copystat(template, data)
            for part in template.iterdir():
                _run(["cp", "-al" if part.name == "overlay2" else "-a", str(part), str(data / part.name)],
                     timeout=600)
            for identity in ("key.json", "engine-id"):  # dockerd 20.10's key (its ID), and 23's ID
                (data / identity).unlink(missing_ok=True)

    def _make_node_store(self, template: Path) -> None:
        """A data root holding the base image alone, made by a dockerd of its own that is stopped before
        the data root is renamed into place (a running daemon's files are never copied)."""
        partial = template.with_name(template.name + ".partial")
        _kill_and_wait(sorted(set(_processes_referencing([partial]))), grace=5)  # a crashed attempt's
        if partial.exists():
            _unmount_under(partial)
            shutil.rmtree(partial)
        host = self._start_dockerd("node-store", None, data=partial)
        try:
            self._wait_docker(host, "node-store")
            with self.timings.step("node store: docker load of the base"):
                _run(["docker", "-H", host, "load", "-q", "-i", str(base_image_cache_path())], timeout=900)
        finally:
            _kill_and_wait([self._daemons.pop("dockerd-node-store").pid], grace=15)
            _unmount_under(partial)
        partial.rename(template)

    def hold_base(self, names: Sequence[str] | None = None) -> None:
        """Each node (default: every one) holds the base image again, loaded from the cached tar side by
        side where it lacks it: for a test that removed it (the deploy benchmark's cold deploy), since the
        nodes start with it (_copy_node_stores)."""
        errors: list[BaseException] = []

        def load(h: Host) -> None:
            try:
                if _run(["docker", "-H", h.docker_host, "image", "inspect", BASE_IMAGE], check=False).returncode == 0:
                    return
                _run(["docker", "-H", h.docker_host, "load", "-q", "-i", str(base_image_cache_path())], timeout=900)
            except BaseException as e:  # re-raised below
                errors.append(e)
        loaders = [threading.Thread(target=load, args=(self.host(n),), name=f"base-{n}")
                   for n in (names or [h.name for h in self.hosts])]
        for t in loaders:
            t.start()
        for t in loaders:
            t.join()
        if errors:
            raise ClusterError(f"{BASE_IMAGE} on the nodes: {errors[0]}") from errors[0]

    def _wait_docker(self, docker_host: str, name: str, timeout: float = 60) -> None:
        proc = self._daemons[f"dockerd-{name}"]
        deadline = time.monotonic() + timeout
        while True:
            r = subprocess.run(["docker", "-H", docker_host, "info", "--format", "{{.ID}}"],
                               capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip():
                return
            if proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with {proc.returncode}" if proc.returncode is not None
                       else f"did not answer within {timeout:.0f} s")
                raise ClusterError(f"dockerd of {name} {why}; last lines of its log:\n"
                                   + self._log_tail(f"dockerd-{name}"))
            time.sleep(0.1)

    def _log_tail(self, name: str, lines: int = 15) -> str:
        log = self.state_dir / "logs" / f"{name}.log"
        return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else ""

    def _wait_sshd(self, h: Host, timeout: float = 30) -> None:
        proc = self._daemons[f"sshd-{h.name}"]
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((h.address, 22), timeout=1):
                    return
            except OSError as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ClusterError(f"sshd of {h.name} not reachable at {h.address}:22 ({e});"
                                       " last lines of its log:\n"
                                       + self._log_tail(f"sshd-{h.name}"))
                time.sleep(0.05)

    def _write_description(self) -> None:
        (self.state_dir / "cluster.json").write_text(json.dumps(self.describe(), indent=2))

    def describe(self) -> dict[str, Any]:
        return {
            "site": self.site.index, "bridge": self.site.bridge, "subnet": self.site.subnet_prefix + "0/24",
            "operator_address": self.site.operator_address,
            "operator_docker_host": self.operator_docker_host,
            "base_image": self.base_image,
            "hosts": [h.to_json() for h in self.hosts],
            "spares": [h.to_json() for h in self.spare_hosts],
            "ssh": {"user": "root", "port": 22, "key": self.ssh_key,
                    "known_hosts": self.known_hosts},
            "nas_dir": self.nas_dir, "state_dir": str(self.state_dir),
            "python": sys.executable, "session_path": self.session_path(),
            "timings_s": self.timings.steps,
        }

    @classmethod
    def from_state(cls, state_dir: str | os.PathLike) -> "NetCluster":
        """The cluster described by ``state_dir/cluster.json`` (made by ``up``)."""
        desc = json.loads((Path(state_dir) / "cluster.json").read_text())
        return cls(nodes=len(desc["hosts"]), state_dir=desc["state_dir"], site=Site(desc.get("site", 0)),
                   spares=len(desc.get("spares", [])))

    # ---- helpers for tests and benchmarks

    def run_on(self, name: str, argv: Sequence[str], *, check: bool = False,
               timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside node ``name``'s namespace (not over SSH), DOCKER_HOST set."""
        h = self.host(name)
        env = {**os.environ, "DOCKER_HOST": h.docker_host, "PATH": self.session_path(),
               **kw.pop("env", {})}
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(["nsenter", f"--net={_ns_path(h.ns)}", *argv], env=env,
                              check=check, timeout=timeout, **kw)

    def ssh_argv(self, name: str, argv: Sequence[str] = (), *, connect_timeout: int = 10
                 ) -> list[str]:
        """An ``ssh`` command line that runs ``argv`` on node ``name`` with strict host keys."""
        h = self.host(name)
        cmd = ["ssh", "-i", self.ssh_key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
               "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts}",
               "-o", "GlobalKnownHostsFile=/dev/null", "-o", f"ConnectTimeout={connect_timeout}",
               "-o", "LogLevel=ERROR", f"root@{h.address}"]
        if argv:
            cmd += ["--", shlex.join(argv)]
        return cmd

    def ssh(self, name: str, argv: Sequence[str], *, timeout: float = 120,
            check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(self.ssh_argv(name, argv), capture_output=True, text=True,
                              timeout=timeout, check=check)

    def take_link_down(self, name: str) -> None:
        """Cut node ``name`` off the bridge (its interface stays configured, like a pulled cable)."""
        _run(["ip", "link", "set", self.host(name).veth, "down"])

    def bring_link_up(self, name: str) -> None:
        """Put node ``name`` back on the bridge as a plain link (any shaping removed too)."""
        self.unshape_link(name)
        _run(["ip", "link", "set", self.host(name).veth, "up"])

    def shape_link(self, name: str, rate_mbit: float) -> None:
        """Limit node ``name``'s link to ``rate_mbit`` in both directions, as a slow NIC would:
        a token bucket on its interface inside its namespace (what it sends) and on its veth on
        the bridge side (what it receives). Replaces any earlier shaping of that node."""
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        tbf = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "50ms"]
        for argv in self._link_qdisc_argv(name, "replace"):
            _run([*argv, *tbf])

    def unshape_link(self, name: str) -> None:
        """Give node ``name``'s link back its full speed (nothing to do when it is not shaped)."""
        for argv in self._link_qdisc_argv(name, "del"):
            r = _run([*argv, "root"], check=False)
            if r.returncode != 0 and not _no_root_qdisc(r.stderr):
                raise ClusterError(f"{shlex.join(argv)} root exited {r.returncode}: {r.stderr.strip()}")

    def link_qdiscs(self, name: str) -> list[str]:
        """``tc qdisc show`` of both ends of node ``name``'s link, node side first."""
        return [_run([*argv, "root"]).stdout.strip()
                for argv in self._link_qdisc_argv(name, "show")]

    def _link_qdisc_argv(self, name: str, verb: str) -> list[list[str]]:
        h = self.host(name)
        return [["nsenter", f"--net={_ns_path(h.ns)}", "tc", "qdisc", verb, "dev", NODE_INTERFACE],
                ["tc", "qdisc", verb, "dev", h.veth]]

    def hosts_config(self, runtime: str = "docker", procs: int = 2,
                     train_args: Sequence[str] | None = None, interface: str | None = None,
                     **overrides: Any) -> dict:
        """The hosts.yaml content for the deploy tool; each override replaces or updates a
        top-level section (a dict updates that section's keys, anything else replaces it).
        ``interface``: every node's NIC name (``eth0`` here); null leaves it to the tool."""
        nas = Path(self.nas_dir)
        config: dict[str, Any] = {
            "job": {"name": "ddp-test", "runtime": runtime, "max_restarts": 3},
            "rendezvous": {"node": self.hosts[0].name, "port": 29400, "join_timeout": 600},
            "ssh": {"user": "root", "port": 22, "key": self.ssh_key,
                    "known_hosts": self.known_hosts, "host_key_policy": "strict",
                    "connect_timeout": 10},
            "nodes": [{"name": h.name, "address": h.address, "connection": "ssh", "gpus": 0,
                       "procs": procs, "interface": interface} for h in self.hosts],
            "image": {"name": "ddp-trainer:test", "dockerfile": "Dockerfile",
                      "context": str(REPO_ROOT), "build_args": {"BASE_IMAGE": self.base_image},
                      "compress": False},
            "storage": {"data": {"host": str(nas / "data"), "container": "/data"},
                        "checkpoints": {"host": str(nas / "ckpt"), "container": "/ckpt"},
                        "min_free_gb": 1},
            "train": {"python": sys.executable,
                      "args": list(train_args if train_args is not None
                                   else ["--dataset", "synthetic", "--epochs", "1", *LIGHT_MODEL])},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **copy.deepcopy(value)}
            else:
                config[key] = copy.deepcopy(value)
        return config

    def write_hosts_yaml(self, path: str | os.PathLike, runtime: str = "docker",
                         procs: int = 2, train_args: Sequence[str] | None = None,
                         interface: str | None = None, **overrides: Any) -> Path:
        import yaml
        path = Path(path)
        path.write_text(yaml.safe_dump(
            self.hosts_config(runtime, procs, train_args, interface, **overrides),
            sort_keys=False))
        return path


# --------------------------------------------------------------------------- teardown

def _no_root_qdisc(stderr: str) -> bool:
    """tc's answer to deleting the root qdisc of a device that has only its default one."""
    return "Cannot delete qdisc with handle of zero" in stderr or "No such file or directory" in stderr


def _our_namespaces(site: Site = FIRST_SITE) -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    prefix = site.ns_prefix
    return [n for n in names if n.startswith(prefix) and n[len(prefix):].isdigit()]


def teardown_daemons(procs: Sequence[subprocess.Popen] = (), site: Site = FIRST_SITE) -> None:
    """Stop every dockerd of the site's (each stops its containers and its containerd)."""
    root = site.run_root
    pids = [p for p in (_read_pid(d / "dockerd.pid") for d in root.glob("*"))
            if p and _pid_alive(p)] if root.exists() else []
    pids += [p.pid for p in procs if p.poll() is None and "dockerd" in " ".join(p.args)]
    _kill_and_wait(pids, grace=15)


def cgroup_parent_args(name: str = CGROUP) -> list[str]:
    """``--cgroup-parent`` for a dockerd, to our weighted cgroup: made on cgroup v1 (dockerd's
    cgroupfs driver there), none elsewhere (the containers then go where dockerd puts them)."""
    if not (CGROUP_V1_CPU / "cpu.shares").exists():
        return []
    group = CGROUP_V1_CPU / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.shares").write_text(str(CGROUP_SHARES))
    except OSError as e:
        _log(f"containers keep dockerd's own cgroup: {group}: {e}")
        return []
    return ["--cgroup-parent", f"/{name}"]


def _remove_cgroups(name: str = CGROUP) -> None:
    """Our cgroup in every v1 hierarchy, once no container is left in it (dockerd makes it in each)."""
    for group in Path("/sys/fs/cgroup").glob(f"*/{name}"):
        for sub in sorted((d for d in group.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            group.rmdir()


def teardown(state_dir: Path | None, *, remove_state: bool,
             procs: Sequence[subprocess.Popen] = (), site: Site = FIRST_SITE) -> None:
    """Remove every trace of a cluster on ``site``: by name and fixed path, so it also works after a
    crash; another site's cluster is left alone."""
    t = _Timings()
    namespaces = _our_namespaces(site)
    # 1. daemons: dockerd first (it stops its containers and its containerd), then the rest
    with t.step("down: stop dockerds"):
        teardown_daemons(procs, site)
    stores = site.stores()
    pids = set(_processes_referencing([site.run_root, site.data_root, *stores]))
    if site == FIRST_SITE:
        pids.update(_marked_processes())  # the Slurm daemons and their jobs' step daemons (parts: site 0)
    for ns in namespaces:
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        pids.update(int(p) for p in r.stdout.split() if p.isdigit())
    pids.update(p.pid for p in procs if p.poll() is None)
    _kill_and_wait(sorted(pids), grace=5)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=1)
    _reap()
    # 2. mounts and daemon state; a test's own mounts on the NAS (a full volume), this cluster's
    # and those a crashed run left on its state dir
    for root in (site.run_root, site.data_root, *stores, *([state_dir] if state_dir is not None else []),
                 *Path(STATE_PARENT).glob(site.state_prefix + "*")):
        if root.exists():
            _unmount_under(root)
    _remove_cgroups(site.cgroup)
    # 3. network
    for ns in namespaces:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
    r = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0]
        if dev == site.bridge or (dev.startswith(site.veth_prefix) and dev[len(site.veth_prefix):].isdigit()):
            subprocess.run(["ip", "link", "delete", dev], capture_output=True)
    while subprocess.run(["iptables", "-C", *site.forward_rule], capture_output=True).returncode == 0:
        subprocess.run(["iptables", "-D", *site.forward_rule], capture_output=True)
    # 4. files
    if state_dir is None and site.current.exists():
        with contextlib.suppress(Exception):
            recorded = json.loads(site.current.read_text())
            if recorded.get("owned"):
                state_dir, remove_state = Path(recorded["state_dir"]), True
    for root in (site.data_root, site.run_root):
        shutil.rmtree(root, ignore_errors=True)
    if state_dir is not None and Path(state_dir).exists():
        if remove_state:
            shutil.rmtree(state_dir, ignore_errors=True)
        else:  # a directory the caller chose: remove what we made, keep the logs
            for sub in ("ssh", "nodes", "nas", "cluster.json"):
                target = Path(state_dir) / sub
                if target.is_dir():
                    shutil.rmtree(target, ignore_errors=True)
                elif target.exists():
                    target.unlink()


def cleanup_leftovers(site: Site = FIRST_SITE) -> None:
    """Remove what a crashed earlier run left behind on ``site`` (same names, same fixed paths)."""
    if (_our_namespaces(site) or site.run_root.exists() or site.data_root.exists()
            or (site == FIRST_SITE and _marked_processes())
            or subprocess.run(["ip", "link", "show", site.bridge], capture_output=True).returncode == 0
            or subprocess.run(["iptables", "-C", *site.forward_rule],
                              capture_output=True).returncode == 0):
        _log(f"cleaning up leftovers of an earlier run (site {site.index})")
        teardown(None, remove_state=False, site=site)


# --------------------------------------------------------------------------- command line

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.netcluster",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    up_p = sub.add_parser("up", help="build the cluster and write STATE/cluster.json")
    up_p.add_argument("--nodes", type=int, default=3)
    up_p.add_argument("--state", required=True, help="state directory (created if missing)")
    up_p.add_argument("--fresh-operator", action="store_true",
                      help="start the operator daemon empty and load the base image tar into it")
    up_p.add_argument("--site", type=int, default=0,
                      help="where on this machine: 0 (the default names), or another number for a cluster beside it")
    down_p = sub.add_parser("down", help="remove the cluster described in STATE")
    down_p.add_argument("--state", required=True)
    args = parser.parse_args(argv)
    try:
        if args.verb == "up":
            cluster = NetCluster(nodes=args.nodes, state_dir=args.state,
                                 keep_operator_store=not args.fresh_operator, site=Site(args.site)).up()
            print(json.dumps(cluster.describe(), indent=2))
        else:
            described = Path(args.state) / "cluster.json"
            site = Site(json.loads(described.read_text()).get("site", 0)) if described.exists() else FIRST_SITE
            teardown(Path(args.state).resolve(), remove_state=False, site=site)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
