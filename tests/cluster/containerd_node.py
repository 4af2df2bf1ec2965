"""One more host on the test cluster, whose Docker keeps images in the containerd image store.

The cluster's nodes run bookworm's Docker 20.10 (the classic store). New Docker installs keep
images in containerd instead, and that store loads images differently (deploy/images/oci.py), so the
deploy tool is tested against one for real: ``node9`` (namespace ``ddpn9``, 198.18.0.19, veth
``ddpv9`` on the cluster's bridge), with its own sshd like the others and Debian trixie's
dockerd 26 and containerd 1.7 started with ``"features": {"containerd-snapshotter": true}``.
Its SSH sessions get DOCKER_HOST of that daemon; the client is the machine's own ``docker``.

- The binaries: trixie's ``docker.io`` and ``containerd`` packages, fetched once with this
  machine's apt-get (trixie's package lists kept in a directory of their own, the system's
  sources untouched) and unpacked under /var/cache/ddp-bundle/trixie-docker-<recipe>/ (about
  60 MB of packages, a few seconds). Both run on bookworm. runc is the system's (bookworm's
  docker.io brings it): trixie's runc needs glibc 2.38.
- The node's data root is kept at /var/cache/ddp-bundle/containerd-node-<base image key> and
  reset to hold only the base image ``ddp-base:cpu`` at each start (a second or two); the first
  start loads the base image from the cluster's cached tar (about 50 s), so its layers are
  there as they would be after an earlier deploy.

Teardown stops the daemons and removes the namespace and link; the cluster's own teardown
finds them too (its dockerd's pid file lies under /run/ddpcluster, its namespace is ``ddpnN``).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .netcluster import (BASE_IMAGE, CACHE_DIR, NODE_INTERFACE, NS_PREFIX, SUBNET_PREFIX,
                         ClusterError, Host, _debian_mirror, _kill_and_wait, _ns_path, _read_pid, _run,
                         _unmount_under, _which, base_image_cache_path, base_image_key, cgroup_parent_args,
                         plug_namespace)

INDEX = 9
SUITE = "trixie"
PACKAGES = ("docker.io", "containerd")
BINARIES = {"dockerd": "usr/sbin/dockerd", "containerd": "usr/bin/containerd",
            "containerd-shim-runc-v2": "usr/bin/containerd-shim-runc-v2", "ctr": "usr/bin/ctr"}
RECIPE_VERSION = 1
DAEMON_CONFIG = {"features": {"containerd-snapshotter": True}}


class Unavailable(ClusterError):
    """The containerd node cannot be made here (the packages could not be fetched)."""


def missing_prerequisites() -> list[str]:
    return [f"{tool} not found (needed to fetch Debian {SUITE}'s Docker 26 once)"
            for tool in ("apt-get", "dpkg-deb") if _which(tool) is None and not _ready(binaries_dir())]


def _recipe_key() -> str:
    recipe = json.dumps({"version": RECIPE_VERSION, "suite": SUITE, "packages": PACKAGES}, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def binaries_dir() -> Path:
    return CACHE_DIR / f"trixie-docker-{_recipe_key()}"


def _ready(d: Path) -> bool:
    return (d / "ready").exists() and all((d / "bin" / b).exists() for b in BINARIES)


def ensure_binaries() -> Path:
    """The directory whose ``bin/`` holds dockerd 26 and containerd 1.7 (fetched once, cached)."""
    d = binaries_dir()
    if _ready(d):
        return d / "bin"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / "trixie-docker.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(d):
            return d / "bin"
        shutil.rmtree(d, ignore_errors=True)
        lists, debs, root = d / "lists", d / "debs", d / "root"
        for sub in (lists / "partial", debs, root, d / "bin"):
            sub.mkdir(parents=True, exist_ok=True)
        (d / "sources.list").write_text(f"deb {_debian_mirror()} {SUITE} main\n")
        apt = ["apt-get", "-q", "-o", f"Dir::Etc::sourcelist={d / 'sources.list'}", "-o", "Dir::Etc::sourceparts=-",
               "-o", f"Dir::State::Lists={lists}", "-o", "APT::Sandbox::User=root"]
        try:
            _run([*apt, "update"], timeout=300)
            _run([*apt, "download", *PACKAGES], cwd=debs, timeout=600)
        except (ClusterError, subprocess.TimeoutExpired) as e:
            shutil.rmtree(d, ignore_errors=True)
            raise Unavailable(f"cannot fetch Debian {SUITE}'s {' and '.join(PACKAGES)}: {e}") from e
        for deb in sorted(debs.glob("*.deb")):
            _run(["dpkg-deb", "-x", str(deb), str(root)])
        for name, rel in BINARIES.items():
            if not (root / rel).exists():
                raise Unavailable(f"{rel} is not in Debian {SUITE}'s {' and '.join(PACKAGES)}")
            (d / "bin" / name).symlink_to(root / rel)
        versions = {name: _run([str(d / "bin" / name), "--version"]).stdout.strip()
                    for name in ("dockerd", "containerd")}
        for used in (lists, debs):
            shutil.rmtree(used, ignore_errors=True)
        (d / "ready").write_text(json.dumps(versions, indent=2))
    return d / "bin"


def store_path() -> Path:
    """The node's kept data root (the base image already in it)."""
    return CACHE_DIR / f"containerd-node-{base_image_key()}-{_recipe_key()}"


class ContainerdNode:
    """``node9`` of the cluster, with Docker 26 and the containerd image store."""

    def __init__(self, cluster, index: int = INDEX) -> None:
        self.cluster = cluster
        self.host = Host(name=f"node{index}", ns=f"{NS_PREFIX}{index}", address=f"{SUBNET_PREFIX}{10 + index}",
                         index=index)
        self.name = self.host.name
        self.address = self.host.address
        self.docker_host = self.host.docker_host
        self._bin: Path | None = None

    # ---- for tests

    def docker(self, *args: str, timeout: float = 300, **kw: Any) -> subprocess.CompletedProcess:
        """The machine's docker client against the node's daemon (not over SSH)."""
        return subprocess.run(["docker", "-H", self.docker_host, *args], capture_output=True, text=True,
                              timeout=timeout, **kw)

    def ctr(self, *args: str) -> subprocess.CompletedProcess:
        """containerd's own client on the node's containerd (namespace moby: Docker's)."""
        sock = self.host.run_dir / "exec" / "containerd" / "containerd.sock"
        return subprocess.run([str(self._bin / "ctr"), "-a", str(sock), "-n", "moby", *args],
                              capture_output=True, text=True, timeout=60)

    def inventory_node(self, procs: int = 1) -> dict[str, Any]:
        """This node as an entry of hosts.yaml's ``nodes``."""
        return {"name": self.name, "address": self.address, "connection": "ssh", "gpus": 0, "procs": procs,
                "interface": NODE_INTERFACE}

    def reset(self) -> None:
        """Only the base image left (what the node holds after start)."""
        base = self.docker("image", "inspect", "--format", "{{.Id}}", BASE_IMAGE)
        if base.returncode != 0:
            raise ClusterError(f"{self.name} lost {BASE_IMAGE}: {base.stderr.strip()}")
        containers = self.docker("ps", "-aq").stdout.split()
        if containers:
            self.docker("rm", "-f", *containers)
        # containerd's own list: `docker image ls` leaves out images whose content is not all there
        refs = self.ctr("images", "ls", "-q").stdout.split()
        keep = {r for r in refs if r.endswith("/" + BASE_IMAGE) or r.endswith("@" + base.stdout.strip())}
        if set(refs) - keep:
            r = self.ctr("images", "rm", "--sync", *sorted(set(refs) - keep))
            if r.returncode != 0:
                raise ClusterError(f"{self.name}: cannot remove its images: {r.stderr.strip()}")

    # ---- lifecycle

    def start(self) -> "ContainerdNode":
        self._bin = ensure_binaries()
        try:
            self._network()
            self._ssh()
            self._start_dockerd()
            self._base_image()
            return self
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        h = self.host
        pid = _read_pid(h.run_dir / "dockerd.pid")
        procs = [p for p in (self.cluster._daemons.pop(f"dockerd-{h.name}", None),) if p is not None]
        _kill_and_wait(([pid] if pid else []) + [p.pid for p in procs], grace=15)
        sshd = self.cluster._daemons.pop(f"sshd-{h.name}", None)
        left = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True).stdout.split()
        _kill_and_wait([p.pid for p in (sshd,) if p is not None] + [int(p) for p in left if p.isdigit()], grace=5)
        for p in (*procs, sshd):
            if p is not None:
                with contextlib.suppress(Exception):
                    p.wait(timeout=1)
        _unmount_under(h.run_dir)
        _unmount_under(store_path())
        subprocess.run(["ip", "netns", "delete", h.ns], capture_output=True)
        subprocess.run(["ip", "link", "delete", h.veth], capture_output=True)
        known = Path(self.cluster.known_hosts)
        if known.exists():
            known.write_text("".join(line for line in known.read_text().splitlines(keepends=True)
                                     if not line.startswith(f"{h.address} ")))

    def _network(self) -> None:
        h = self.host
        subprocess.run(["ip", "netns", "delete", h.ns], capture_output=True)  # a crashed run's
        subprocess.run(["ip", "link", "delete", h.veth], capture_output=True)
        plug_namespace(h.ns, h.veth, h.address)

    def _ssh(self) -> None:
        h, c = self.host, self.cluster
        d = c.state_dir / "nodes" / h.name
        d.mkdir(parents=True, exist_ok=True)
        key = d / "ssh_host_ed25519_key"
        for p in (key, Path(f"{key}.pub")):
            p.unlink(missing_ok=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", str(key)])
        kind, blob = Path(f"{key}.pub").read_text().split()[:2]
        with open(c.known_hosts, "a") as f:
            f.write(f"{h.address} {kind} {blob}\n")
        c._start_sshd(h)
        c._wait_sshd(h)

    def _start_dockerd(self, fresh: bool = False) -> None:
        h, c = self.host, self.cluster
        store = store_path()
        _unmount_under(store)  # a crashed run's container mounts
        if fresh:
            shutil.rmtree(store, ignore_errors=True)
        store.mkdir(parents=True, exist_ok=True)
        h.run_dir.mkdir(parents=True, exist_ok=True)
        (h.run_dir / "daemon.json").write_text(json.dumps(DAEMON_CONFIG))
        argv = ["nsenter", f"--net={_ns_path(h.ns)}", str(self._bin / "dockerd"), "--data-root", str(store),
                "--exec-root", str(h.run_dir / "exec"), "--pidfile", str(h.run_dir / "dockerd.pid"),
                "-H", f"unix://{h.docker_sock}", "--bridge=none", "--iptables=false", "--ip-masq=false",
                "--shutdown-timeout", "3", "--log-driver", "json-file",
                "--config-file", str(h.run_dir / "daemon.json"), *cgroup_parent_args()]
        log = open(c.state_dir / "logs" / f"dockerd-{h.name}.log", "ab")
        c._daemons[f"dockerd-{h.name}"] = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PATH": f"{self._bin}:{c.session_path()}"})
        log.close()
        try:
            c._wait_docker(h.docker_host, h.name)
        except ClusterError:
            if fresh:
                raise
            _kill_and_wait([c._daemons.pop(f"dockerd-{h.name}").pid], grace=15)
            self._start_dockerd(fresh=True)  # a kept store it cannot use: start afresh
            return
        info = self.docker("info", "--format", "{{json .DriverStatus}}").stdout
        if "io.containerd.snapshotter" not in info:
            raise ClusterError(f"dockerd of {h.name} does not use the containerd image store: {info.strip()}")

    def _base_image(self) -> None:
        if self.docker("image", "inspect", BASE_IMAGE).returncode == 0:
            self.reset()
            return
        with open(base_image_cache_path(), "rb") as tar:
            r = self.docker("load", "-q", stdin=tar, timeout=900)
        if r.returncode != 0:
            raise ClusterError(f"{self.name}: docker load of {BASE_IMAGE} failed: {r.stderr.strip()}")

