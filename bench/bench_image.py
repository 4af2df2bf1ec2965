"""Image delivery on shaped links: star vs chain vs registry to 1..K nodes, in one run.

Setup, not timed:
  - a K-node test cluster (tests/cluster/netcluster.py), plus the registry namespace
    (tests/cluster/registry_ns.py) when the registry is measured;
  - every node holds the base image ddp-base:cpu, as nodes that ran an earlier image do;
  - the bench image: that base plus one layer of --mb megabytes from os.urandom (incompressible,
    so that neither gzip nor a fast CPU changes what has to cross the links);
  - links shaped with tc (tests/cluster/shaping.py): the operator's uplink at --operator-mbit
    (shared by everything the operator sends), every node's link at --node-mbit; both rates are
    measured with a plain socket transfer before anything else and recorded.

Each row: `ddp-deploy deploy --no-build` run like a person would, with image.transfer set to the
way, to the first N nodes, none of which holds the image (it is removed from every node before
each run; for the registry a new layer of the same size is built for each run, since a registry
keeps what was pushed to it). Measured: the CLI's wall time, the bytes that crossed the operator's
uplink (the bridge device's tx_bytes) and the machine's busy CPU seconds. The operator's saved
image (DDP_DEPLOY_IMAGE_CACHE) is made once before the rows: `docker save` is paid once per image
whatever N is, and is left out so that the rows compare the ways of shipping.

Repair (chain only): a chain deploy to all K nodes; once every node has received a third of the
layer, the link of the chain's middle node goes down. Measured: the time from then until every
node after it is receiving again (its veth's tx_bytes grows by 1 MB), the deploy's exit and which
nodes hold the image; then the link comes back and a second deploy finishes that node.

Needs root and what the cluster tests need; run it under the cluster lock:
  flock /tmp/ddpcluster.lock .venv/bin/python bench/bench_image.py [--nodes 5] [--sizes 1,2,3,5]
Writes bench/results/image.json (and prints the side-by-side table).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster import shaping  # noqa: E402
from tests.cluster.netcluster import NetCluster, base_image_cache_path  # noqa: E402

IMAGE = "ddp-bench-image:latest"
RESUMED_BYTES = 1_000_000  # a node "receives again" once its relay has stored this much more


def busy_cpu_seconds() -> float:
    """CPU time the whole machine (operator and every node: they share it) has spent busy."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, int]:
    """(parent pid, CPU ticks so far) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def _kind(pid: str) -> str:
    """What a process of ours is, by its name and command line: the relay, the deploy CLI, or its name."""
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    if comm.startswith("python"):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"class Relay" in cmdline:
            return "relay"
        if b"-m\0deploy" in cmdline:
            return "deploy CLI"
    return "containerd" if comm.startswith("containerd") else comm


class CpuByKind:
    """CPU seconds while the block runs, sampled from /proc (a process's last half second before it
    exits is missed): per kind for the processes this bench started (the deploy CLI, the nodes'
    sshd and dockerd and what they run), ``kernel threads``, and ``not ours``: other work on this
    machine (other sessions' tests), which slows the rows it overlaps. ``unaccounted``: the
    machine's busy time the samples do not cover (exited processes, interrupts)."""

    KERNEL = "kernel threads"
    FOREIGN = "not ours"

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.seconds = interval, {}
        self._stop = threading.Event()

    def _sample(self) -> None:
        me = os.getpid()
        while True:
            parents = {}
            for entry in os.scandir("/proc"):
                if entry.name.isdigit():
                    try:
                        ppid, ticks = _stat(entry.name)
                    except (OSError, IndexError, ValueError):
                        continue
                    parents[int(entry.name)] = ppid
                    self._last[entry.name] = ticks
            for pid in parents:
                if self._kinds.get(str(pid), "").startswith("ours: "):
                    continue  # its parent may have gone since (re-parented): it stays ours
                up, seen = pid, 0
                while up not in (0, 1, 2, me) and seen < 64:
                    up, seen = parents.get(up, 0), seen + 1
                try:
                    self._kinds[str(pid)] = ("ours: " + _kind(str(pid)) if up == me and pid != me
                                             else self.KERNEL if up == 2 or pid == 2 else self.FOREIGN)
                except OSError:
                    pass
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "CpuByKind":
        self._first, self._last, self._kinds = {}, {}, {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    self._first[entry.name] = _stat(entry.name)[1]
        self._busy = busy_cpu_seconds()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        hz = os.sysconf("SC_CLK_TCK")
        seconds: dict[str, float] = {}
        for pid, ticks in self._last.items():
            spent = (ticks - self._first.get(pid, 0)) / hz
            if spent > 0 and pid in self._kinds:
                seconds[self._kinds[pid]] = seconds.get(self._kinds[pid], 0) + spent
        seconds["unaccounted"] = busy_cpu_seconds() - self._busy - sum(seconds.values())
        self.seconds = {k: round(v, 2) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}

    @property
    def ours(self) -> float:
        return sum(v for k, v in self.seconds.items() if k.startswith("ours: "))


class SpoolWatch:
    """How many bytes each node's chain relay has stored so far, read from the size of its spool
    file (found through /proc: the relay's open file and its network namespace): what a node has
    received, whatever the tool reports and whatever else crosses its veth (a bridge floods frames
    for a port that went down to every other port). Sampled every ``interval`` seconds while the
    block runs; ``timeline()``: per node, seconds from the start to its first and its last byte."""

    def __init__(self, cluster: NetCluster, interval: float = 0.1) -> None:
        self.interval = interval
        self.nodes = {os.stat(f"/var/run/netns/{h.ns}").st_ino: h.name for h in cluster.hosts}
        self.size: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._relays: dict[str, tuple[str, str]] = {}  # pid -> (node, /proc/pid/fd/N of its spool file)
        self._looked: dict[str, str] = {}  # pid -> comm when looked at (a fork is looked at again once it execs)
        self._stop = threading.Event()

    def _find(self) -> None:
        for entry in os.scandir("/proc"):
            pid = entry.name
            if not pid.isdigit() or pid in self._relays:
                continue
            try:
                comm = Path(f"/proc/{pid}/comm").read_text()
                if self._looked.get(pid) == comm:
                    continue
                if not comm.startswith("python") or b"class Relay" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    self._looked[pid] = comm
                    continue
                node = self.nodes.get(os.stat(f"/proc/{pid}/ns/net").st_ino)
                if node is None:
                    self._looked[pid] = comm
                    continue
                for fd in os.listdir(f"/proc/{pid}/fd"):  # none yet until the relay has its plan: look again
                    if "ddp-deploy-chain-" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                        self._relays[pid] = (node, f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._find()
            now = time.perf_counter() - self.start
            for node, fd in list(self._relays.values()):
                with contextlib.suppress(OSError):
                    size = os.stat(fd).st_size
                    if size > self.size.get(node, 0):
                        self.size[node] = size
                        self.first.setdefault(node, now)
                        self.last[node] = now

    def got(self, node: str) -> int:
        return self.size.get(node, 0)

    def __enter__(self) -> "SpoolWatch":
        self.start = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def timeline(self) -> dict[str, dict]:
        return {n: {"first_byte_s": round(self.first[n], 2), "last_byte_s": round(self.last[n], 2),
                    "bytes": self.size[n]} for n in sorted(self.size)}


def ways_supported() -> list[str]:
    from deploy.images.ways import WAYS

    return list(WAYS)


class Bench:
    def __init__(self, cluster: NetCluster, workdir: Path, args: argparse.Namespace, base: str | None = None) -> None:
        """``base``: the image the bench image is built on, which every node holds first (default:
        the cluster's torch base, as nodes that ran an earlier image of the job hold it)."""
        self.cluster, self.workdir, self.args = cluster, workdir, args
        self.base = base or cluster.base_image
        self.registry = None
        self.runs = 0
        self.image_bytes = 0

    # ---- the operator's daemon and the nodes'

    def operator_docker(self, *argv: str, timeout: float = 900, stdin=None) -> str:
        r = subprocess.run(["docker", "-H", self.cluster.operator_docker_host, *argv], capture_output=True,
                           text=True, timeout=timeout, stdin=stdin)
        if r.returncode != 0:
            raise SystemExit(f"docker {' '.join(argv)} failed: {(r.stderr or r.stdout).strip()[-2000:]}")
        return r.stdout.strip()

    def node_docker(self, node: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        r = self.cluster.run_on(node, ["docker", *argv], timeout=900)
        if check and r.returncode != 0:
            raise SystemExit(f"{node}: docker {' '.join(argv)} failed: {(r.stderr or r.stdout).strip()[-2000:]}")
        return r

    def image_id_on(self, node: str, name: str) -> str | None:
        r = self.node_docker(node, "image", "inspect", "--format", "{{.Id}}", name, check=False)
        return r.stdout.strip() if r.returncode == 0 else None

    def build(self, name: str) -> str:
        """``name``: the base plus one layer of args.mb random megabytes; returns its image ID."""
        context = self.workdir / "context"
        shutil.rmtree(context, ignore_errors=True)
        context.mkdir()
        with open(context / "blob", "wb") as f:
            for _ in range(self.args.mb):
                f.write(os.urandom(1 << 20))
        (context / "Dockerfile").write_text(f"FROM {self.base}\nCOPY blob /opt/bench/blob\n")
        self.operator_docker("build", "-q", "-t", name, str(context))
        shutil.rmtree(context, ignore_errors=True)
        return self.operator_docker("image", "inspect", "--format", "{{.Id}}", name)

    def size(self, name: str) -> int:
        return int(self.operator_docker("image", "inspect", "--format", "{{.Size}}", name))

    def base_on_every_node(self) -> None:
        """Every node holds the base; through the registry when it is measured, so that the nodes
        know the base's blobs there (a pull then fetches only the new layer) as they would in a
        team that pulls its images."""
        base = self.base
        if self.registry is not None:
            seeded = f"{self.registry.host}/ddp-bench-base:cpu"
            self.operator_docker("tag", base, seeded)
            self.operator_docker("push", seeded)
            for h in self.cluster.hosts:
                self.node_docker(h.name, "pull", "-q", seeded)
                self.node_docker(h.name, "tag", seeded, base)
            return
        tar = base_image_cache_path()
        if base != self.cluster.base_image:  # the cluster's base is saved already; another is saved here
            tar = self.workdir / "base.tar"
            self.operator_docker("save", "-o", str(tar), base)
        for h in self.cluster.hosts:
            self.node_docker(h.name, "load", "-q", "-i", str(tar))

    def drop_everywhere(self, name: str) -> None:
        for h in self.cluster.hosts:
            self.node_docker(h.name, "image", "rm", "-f", name, check=False)

    # ---- ddp-deploy

    def hosts_yaml(self, way: str, nodes: int, name: str) -> Path:
        import yaml

        config = self.cluster.hosts_config(
            "docker", 1, None, "eth0",
            image={"name": name, "transfer": way, "compress": False, "stall_seconds": self.args.stall_seconds},
            ssh={"connect_timeout": 5})
        config["nodes"] = config["nodes"][:nodes]
        path = self.workdir / f"hosts-{way}-{nodes}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.cluster.operator_docker_host, "COLUMNS": "200",
                "DDP_DEPLOY_LOG": str(self.workdir / "debug.log"),
                "DDP_DEPLOY_IMAGE_CACHE": str(self.workdir / "image-cache")}

    def deploy_argv(self, hosts: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "deploy", "--hosts", str(hosts), "deploy", "--no-build", *extra]

    def deploy(self, hosts: Path) -> dict:
        """One timed deploy: wall seconds, operator bytes, busy CPU, exit code and output; for the
        chain, when each node's relay got its first and last byte."""
        cpu, sent = busy_cpu_seconds(), shaping.operator_tx_bytes()
        start = time.perf_counter()
        with CpuByKind() as by_kind, SpoolWatch(self.cluster) as spools:
            proc = subprocess.run(self.deploy_argv(hosts), cwd=ROOT, env=self.env(), capture_output=True,
                                  text=True, timeout=1800)
        wall = time.perf_counter() - start
        return {"wall_s": wall, "relay_timeline": spools.timeline(), "operator_bytes": shaping.operator_tx_bytes() - sent,
                "busy_cpu_s": busy_cpu_seconds() - cpu, "cpu_s_by_process": by_kind.seconds,
                "ours_cpu_s": by_kind.ours, "not_ours_cpu_s": by_kind.seconds.get(CpuByKind.FOREIGN, 0), "exit": proc.returncode,
                "shipped_mb": sum(float(mb) for mb in re.findall(r"shipped ([\d.]+) MB", proc.stdout)),
                "output": (proc.stdout + proc.stderr)[-3000:] if proc.returncode else ""}

    # ---- the rows

    def row(self, way: str, nodes: int, image_id: str) -> dict:
        name = IMAGE
        if way == "registry":
            self.runs += 1
            name = f"{self.registry.host}/ddp-bench-image:run{self.runs}"
            image_id = self.build(name)
        self.drop_everywhere(name)
        hosts = self.hosts_yaml(way, nodes, name)
        result = self.deploy(hosts)
        targets = [h.name for h in self.cluster.hosts[:nodes]]
        result["verified_nodes"] = sum(self.image_id_on(n, name) == image_id for n in targets)
        # The same deploy with nothing to ship: what the tool spends on N nodes besides the image.
        result["nothing_to_ship_wall_s"] = self.deploy(hosts)["wall_s"]
        self.drop_everywhere(name)
        if way == "registry":
            self.operator_docker("image", "rm", "-f", name)
        return result

    def repair(self, image_id: str) -> dict:
        """A chain deploy to every node; the middle node's link goes down mid-transfer."""
        nodes = [h.name for h in self.cluster.hosts]
        hosts = self.hosts_yaml("chain", len(nodes), IMAGE)
        self.drop_everywhere(IMAGE)
        dry = subprocess.run([*self.deploy_argv(hosts), "--dry-run"], cwd=ROOT, env=self.env(),
                             capture_output=True, text=True, timeout=120)
        row = re.search(r"chain: local -> (.+?);", dry.stdout)
        order = row.group(1).split(" -> ") if row else nodes  # the chain's order, as the tool prints it
        middle = order[len(order) // 2]
        layer = self.image_bytes
        started = time.perf_counter()
        proc = subprocess.Popen(self.deploy_argv(hosts), cwd=ROOT, env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
        reader.start()
        down_at = None
        resumed: dict[str, float] = {}
        at_down: dict[str, int] = {}
        try:
            with SpoolWatch(self.cluster, interval=0.05) as spools:
                while proc.poll() is None:
                    now = time.perf_counter()
                    if down_at is None and min(spools.got(n) for n in nodes) >= layer / 3:
                        shaping.link_down(self.cluster, middle)
                        down_at = time.perf_counter()
                        at_down = {n: spools.got(n) for n in nodes}
                    elif down_at is not None:
                        for n in nodes:
                            if n != middle and n not in resumed and spools.got(n) - at_down[n] >= RESUMED_BYTES:
                                resumed[n] = now - down_at
                    time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            reader.join(5)
            shaping.link_up(self.cluster, middle)
        wall = time.perf_counter() - started
        after = order[order.index(middle) + 1:]
        holding = [n for n in nodes if self.image_id_on(n, IMAGE) == image_id]
        again = self.deploy(hosts)
        return {
            "nodes": len(nodes), "middle": middle, "stall_seconds": self.args.stall_seconds,
            "chain": order, "link_down_after_s": down_at and down_at - started,
            "bytes_per_node_at_link_down": at_down, "relay_timeline": spools.timeline(),
            "resumed_after_s": resumed,
            "repair_s": max(resumed[n] for n in after) if after and all(n in resumed for n in after) else None,
            "never_resumed": [n for n in after if n not in resumed],
            "deploy_wall_s": wall, "deploy_exit": proc.returncode, "deploy_output": "".join(output)[-4000:],
            "holding_the_image": holding,
            "second_deploy": {**again, "holding_the_image": [n for n in nodes if self.image_id_on(n, IMAGE) == image_id]},
        }


def git_state() -> dict:
    """The commit the tool ran from and the files of deploy/ that differed from it."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.split()  # noqa: E731
    return {"head": (git("rev-parse", "HEAD") or [""])[0],
            "modified": git("status", "--porcelain", "--untracked-files=all", "deploy")[1::2]}


def median_table(rows: list[dict], ways: list[str], sizes: list[int], image_bytes: int) -> dict:
    table: dict[str, dict[str, dict]] = {}
    for way in ways:
        table[way] = {}
        for n in sizes:
            mine = [r for r in rows if r["way"] == way and r["nodes"] == n and r["exit"] == 0
                    and r["verified_nodes"] == n]
            if not mine:
                continue
            table[way][str(n)] = {
                "wall_s": statistics.median(r["wall_s"] for r in mine),
                "operator_over_image": statistics.median(r["operator_bytes"] for r in mine) / image_bytes,
                "busy_cpu_s": statistics.median(r["busy_cpu_s"] for r in mine),
                "ours_cpu_s": statistics.median(r["ours_cpu_s"] for r in mine),
                "not_ours_cpu_s": statistics.median(r["not_ours_cpu_s"] for r in mine),
                "wall_s_rounds": [round(r["wall_s"], 2) for r in mine],
                "nothing_to_ship_wall_s": statistics.median(r["nothing_to_ship_wall_s"] for r in mine),
                "rounds": len(mine)}
        one = table[way].get("1")
        for cell in table[way].values():
            cell["ratio"] = cell["wall_s"] / one["wall_s"] if one else None
            # the same, less what the tool spends on N nodes when there is nothing to ship
            cell["shipping_ratio"] = ((cell["wall_s"] - cell["nothing_to_ship_wall_s"])
                                      / (one["wall_s"] - one["nothing_to_ship_wall_s"]) if one else None)
    return table


def print_table(table: dict, failed: list[dict]) -> None:
    cores = os.cpu_count() or 1
    print(f"{'way':9s} {'N':>3s} {'wall s':>8s} {'wall(N)/wall(1)':>16s} {'operator/image':>15s} "
          f"{'no-op s':>8s} {'shipping ratio':>15s} {'CPU s ours':>11s} {'floor s':>8s} {'not ours':>9s}")
    for way, cells in table.items():
        for n, c in cells.items():
            ratio = f"{c['ratio']:.2f}" if c["ratio"] is not None else "-"
            shipping = f"{c['shipping_ratio']:.2f}" if c["shipping_ratio"] is not None else "-"
            print(f"{way:9s} {n:>3s} {c['wall_s']:8.1f} {ratio:>16s} {c['operator_over_image']:15.2f} "
                  f"{c['nothing_to_ship_wall_s']:8.1f} {shipping:>15s} "
                  f"{c['ours_cpu_s']:11.1f} {c['ours_cpu_s'] / cores:8.1f} {c['not_ours_cpu_s']:9.1f}")
    for r in failed:
        print(f"FAILED {r['way']} N={r['nodes']}: exit {r['exit']}, {r['verified_nodes']} verified\n{r['output']}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=5, help="cluster size K (the largest N)")
    p.add_argument("--sizes", default="", help="comma-separated N (default: 1,2,3,...,K)")
    p.add_argument("--ways", default="", help="comma-separated ways (default: every way the tool has)")
    p.add_argument("--mb", type=int, default=300, help="megabytes of random data on top of the base")
    p.add_argument("--operator-mbit", type=float, default=200)
    p.add_argument("--node-mbit", type=float, default=1000)
    p.add_argument("--stall-seconds", type=float, default=10, help="image.stall_seconds")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-repair", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "image.json"))
    return p


def plan(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The ways and the sizes N the arguments ask for, or SystemExit naming what is wrong."""
    supported = ways_supported()
    ways = [w for w in args.ways.split(",") if w] or supported
    missing = [w for w in ways if w not in supported]
    if missing:
        raise SystemExit(f"ddp-deploy has no image.transfer {missing} yet (it has {supported})")
    sizes = [int(n) for n in args.sizes.split(",") if n] or list(range(1, args.nodes + 1))
    if max(sizes) > args.nodes or 1 not in sizes:
        raise SystemExit("--sizes must include 1 and stay within --nodes")
    return ways, sizes


def measure(cluster: NetCluster, workdir: Path, args: argparse.Namespace, registry=None,
            base: str | None = None) -> dict:
    """Every row (the module's docstring) on ``cluster`` (its first ``args.nodes`` hosts at most),
    then the chain's repair: the record main() writes. ``registry``: a started
    tests.cluster.registry_ns.RegistryNamespace, where the registry way is measured. ``base``: as
    Bench's. The bench image is left on the operator's daemon and the nodes (``drop_everywhere``)."""
    ways, sizes = plan(args)
    tree = git_state()
    rows: list[dict] = []
    bench = Bench(cluster, workdir, args, base)
    others = []
    if "registry" in ways:
        from tests.cluster import registry_ns

        if registry is None:
            raise SystemExit("the registry way needs the registry (tests/cluster/registry_ns.py) started")
        bench.registry = registry
        others.append((registry_ns.NS, registry_ns.VETH))
    t = time.perf_counter()
    bench.base_on_every_node()
    image_id = bench.build(IMAGE)
    bench.image_bytes = bench.size(IMAGE) - bench.size(bench.base)
    print(f"setup {time.perf_counter() - t:.0f} s; image layer {bench.image_bytes / 1e6:.1f} MB", flush=True)

    with shaping.shaped(cluster, args.operator_mbit, args.node_mbit, others):
        probe = lambda mbit: int(mbit * 1e6 / 8 * 2)  # noqa: E731  (2 s at the rate)
        rates = {
            "operator_to_node1": shaping.measure_mbit(cluster, shaping.OPERATOR, "node1", probe(args.operator_mbit)),
            "node1_to_node2": shaping.measure_mbit(cluster, "node1", "node2", probe(args.node_mbit)),
        }
        print("measured Mbit/s: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()), flush=True)

        warm = bench.hosts_yaml("star", 1, IMAGE)  # fills the operator's saved-image cache
        bench.drop_everywhere(IMAGE)
        if bench.deploy(warm)["exit"] != 0:
            raise SystemExit("the first deploy (filling the saved-image cache) failed; see its debug log")

        for _ in range(args.rounds):
            for n in sizes:
                for way in ways:
                    r = {"way": way, "nodes": n, **bench.row(way, n, image_id)}
                    rows.append(r)
                    print(f"{way:9s} N={n}: {r['wall_s']:6.1f} s, operator {r['operator_bytes'] / 1e6:7.1f} MB, "
                          f"exit {r['exit']}, {r['verified_nodes']}/{n} verified", flush=True)

        repair = None
        if "chain" in ways and not args.no_repair and len(cluster.hosts) >= 3:
            repair = bench.repair(image_id)
            print(f"repair: middle {repair['middle']} down after {repair['link_down_after_s'] or 0:.1f} s; "
                  f"receiving again after {repair['resumed_after_s']}; deploy exit {repair['deploy_exit']}; "
                  f"holding {repair['holding_the_image']}; second deploy exit {repair['second_deploy']['exit']}",
                  flush=True)
        qdiscs = shaping.qdiscs(cluster)

    table = median_table(rows, ways, sizes, bench.image_bytes)
    failed = [r for r in rows if r["exit"] != 0 or r["verified_nodes"] != r["nodes"]]
    print_table(table, failed)
    return {
        "bench": "image", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cores": os.cpu_count(),
        "nodes": len(cluster.hosts), "sizes": sizes, "ways": ways, "rounds": args.rounds,
        "image_layer_bytes": bench.image_bytes, "operator_mbit": args.operator_mbit, "node_mbit": args.node_mbit,
        "measured_mbit": rates, "git": tree, "qdiscs": qdiscs, "stall_seconds": args.stall_seconds,
        "table": table, "rows": rows, "failed": failed, "repair": repair,
    }


def main() -> None:
    args = parser().parse_args()
    plan(args)  # refused before a cluster is built for nothing
    workdir = Path(tempfile.mkdtemp(prefix="ddp-bench-image-"))
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(NetCluster(nodes=args.nodes))
        registry = None
        if "registry" in plan(args)[0]:
            from tests.cluster import registry_ns

            registry = registry_ns.RegistryNamespace(cluster).start()
            stack.callback(registry.stop)
        record = measure(cluster, workdir, args, registry)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
