"""`launch` to the first training step, against its floor, on the real test cluster.

The floor is the same job started by hand: on every node at once, over SSH, ``docker run`` of the
same image with ``python -m torch.distributed.run`` (torchrun) and the same trainer flags, the
same mounts, the same network. It pays what any launcher pays (an SSH command, a container start,
torchrun's imports and rendezvous, the workers' imports, the process group, the data, the model,
the first step); what ``ddp-deploy launch`` adds on top is the overhead this bench measures: its
own phases before the start (the job's lock, the nodes' states, the code sync, the preflight
checks, the image check, the record, the start), its launcher wrapper, and anything else.

Ours is timed twice: ``probed``, a first launch after a new image, where each node runs the
preflight probe (a container importing torch); and ``ours``, a relaunch, where each CPU node
takes the probe answer it kept for the same image and command (deploy/programs/probe_kept.sh). Each
round runs the three one after the other, in turn first, on 1 node and on all nodes. For every
run it records:

- ``first_step_s``: from the operator's command to the first ``train`` METRICS record of the
  job (its ``time``, written by rank 0 after step 1);
- ``operator``: ``launch``'s own phases, as it printed them (not the floor);
- ``container_s``: from the operator's command to the start of the last node's container (its
  first process, the launcher, by /proc; the job cannot start before its last node);
- ``trainer``: node 1's first process's own line of where its time went, from its launcher's
  start to ready to train (trainer/startup.py: launcher to this process, imports, process
  group, data, model, resume);
- ``rest_s``: from node 1's first process ready to train to the first step's record (the step
  itself; the trainer's line gives tenths of a second, so this is as coarse).

Everything here shares one 2-core machine (operator, nodes, containers), so the figures are
ratios of runs made side by side, not absolute speeds; the bench also records the machine's
busy CPU seconds of each run.

Needs root, Debian's docker.io, openssh-server, debootstrap (like the cluster tests).
Run: python bench/bench_launch.py [--rounds 3] [--nodes 1,3] [--smoke]; writes
bench/results/launch.json (not with --smoke: one round on one node, nothing written, which only
proves that it runs; tests/cluster/test_bench_launch.py runs it so on the test cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_deploy import IMAGE, TRAIN, busy_cpu_seconds, inventory  # noqa: E402
from trainer.startup import started_at  # noqa: E402

PROCS = 2  # bench_deploy's inventory: 2 processes a node
KINDS = ("probed", "ours", "floor")
"""A launch whose nodes probe, a relaunch taking the answers they kept, the floor: in turn."""
FLOOR_PORT = 29410  # not the job's (29400): a floor run never meets a run of ours
READY = re.compile(r"trainer: ready to train (?:([\d.]+) s after the launcher started)?: (.*)")
PHASES = re.compile(r"launch took [\d.]+ s: (.*)")
PART = re.compile(r"([a-z][a-z ]*?) ([\d.]+) s")


def parts(text: str) -> dict[str, float]:
    """``lock 1.14 s, node states 0.49 s`` -> {"lock": 1.14, "node states": 0.49}."""
    return {name.strip(): float(s) for name, s in PART.findall(text)}


def ready_line(output: str) -> tuple[float | None, dict[str, float]]:
    """The first ``ready to train`` line of a process's output: (seconds after the launcher
    started, each phase's seconds); (None, {}) where there is none."""
    for line in output.splitlines():
        m = READY.search(line)
        if m:
            return (float(m.group(1)) if m.group(1) else None), parts(m.group(2))
    return None, {}


def launcher_started(pid: str) -> float:
    """When a container's first process (its launcher: ours, or torchrun for the floor) started,
    by the trainer's own clock (/proc; the nodes share this machine's kernel)."""
    at = started_at(pid.strip())
    if at is None:
        raise SystemExit(f"no process {pid.strip()} (the container ended before its first step was seen?)")
    return at


def first_step(metrics: Path, since: float, timeout: float = 300) -> float:
    """The ``time`` of the first ``train`` record in ``metrics`` (the job's metrics.jsonl)."""
    while time.time() - since < timeout:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if '"kind": "train"' in line:
                    return json.loads(line)["time"]
        time.sleep(0.05)
    raise SystemExit(f"no training step in {metrics} within {timeout:.0f} s")


class Bench:
    def __init__(self, cluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.nas = Path(cluster.nas_dir)

    def hosts(self, nodes: int) -> Path:
        return inventory(self.cluster, self.workdir, nodes)

    def ddp(self, hosts: Path, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "DOCKER_HOST": self.cluster.operator_docker_host, "COLUMNS": "200",
               "DDP_DEPLOY_LOG": str(self.workdir / "debug.log"), "DDP_DEPLOY_IMAGE_CACHE": self.cluster.operator_cache_dir}
        proc = subprocess.run([sys.executable, "-m", "deploy", "--hosts", str(hosts), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise SystemExit(f"ddp-deploy {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def docker(self, node: str, *args: str, both: bool = False) -> str:
        """docker's output on ``node`` (``both``: stdout and stderr, e.g. a container's logs)."""
        r = self.cluster.run_on(node, ["docker", *args], timeout=120)
        if r.returncode != 0:
            raise SystemExit(f"{node}: docker {' '.join(args)} failed: {r.stderr.strip()}")
        return r.stdout + r.stderr if both else r.stdout

    def _names(self, nodes: int) -> list[str]:
        return [h.name for h in self.cluster.hosts[:nodes]]

    def ours(self, nodes: int) -> dict:
        """A relaunch: the nodes kept their probe answers from the launch before (same image)."""
        return self._launch(nodes)

    def probed(self, nodes: int) -> dict:
        """A first launch after a new image: each node probes (its kept answers removed first)."""
        for n in self._names(nodes):
            shutil.rmtree(self.cluster.node_cache_dir(n) / "ddp-deploy" / "probe", ignore_errors=True)
        return self._launch(nodes)

    def _launch(self, nodes: int) -> dict:
        hosts = self.hosts(nodes)
        subprocess.run(["rm", "-rf", str(self.nas / "ckpt")], check=True)
        self.ddp(hosts, "deploy", "--no-build")  # the image is there: this makes the NAS folders again
        cpu, start = busy_cpu_seconds(), time.time()
        try:
            out = self.ddp(hosts, "launch").stdout
            step = first_step(self.nas / "ckpt" / "metrics.jsonl", start)
            cpu = busy_cpu_seconds() - cpu
            row = self._row(nodes, start, step, cpu, containers(hosts))
        finally:
            self.ddp(hosts, "stop")
        m = PHASES.search(out)
        row["operator"] = parts(m.group(1)) if m else {}
        return row

    def floor(self, nodes: int) -> dict:
        names = self._names(nodes)
        rdzv = self.cluster.hosts[0]
        ckpt = self.nas / "ckpt" / "floor"
        subprocess.run(["rm", "-rf", str(ckpt)], check=True)
        ckpt.mkdir(parents=True)
        os.chown(ckpt, 1000, 1000)  # the image's user
        containers = [f"ddp-floor-{n}" for n in names]

        def start(i: int) -> None:
            h = self.cluster.hosts[i]
            argv = ["docker", "run", "-d", "--name", containers[i], "--network", "host", "--ipc", "host",
                    "--pull", "never", "-v", f"{self.nas / 'data'}:/data", "-v", f"{self.nas / 'ckpt'}:/ckpt",
                    "-e", "GLOO_SOCKET_IFNAME=eth0", "--entrypoint", "python", IMAGE,
                    "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(PROCS),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rdzv.address}:{FLOOR_PORT}",
                    "--rdzv-id", "floor", "--local-addr", h.address, "--max-restarts", "0",
                    *(["--rdzv-conf", "is_host=1"] if i == 0 else []),
                    "-m", "trainer", "--data-dir", "/data", "--ckpt-dir", "/ckpt/floor", "--device", "cpu",
                    "--backend", "gloo", *TRAIN]
            r = subprocess.run(self.cluster.ssh_argv(h.name, argv), capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise SystemExit(f"{h.name}: the floor's docker run failed: {r.stderr.strip()}")

        cpu, begin = busy_cpu_seconds(), time.time()
        try:
            with ThreadPoolExecutor(nodes) as pool:
                list(pool.map(start, range(nodes)))
            step = first_step(ckpt / "metrics.jsonl", begin)
            cpu = busy_cpu_seconds() - cpu
            return self._row(nodes, begin, step, cpu, containers)
        finally:  # by their exact names, whatever happened
            for n, c in zip(names, containers):
                self.cluster.run_on(n, ["docker", "rm", "-f", c], timeout=120)

    def _row(self, nodes: int, start: float, step: float, cpu: float, containers: list[str]) -> dict:
        names = self._names(nodes)
        ups = [launcher_started(self.docker(n, "inspect", "-f", "{{.State.Pid}}", c))
               for n, c in zip(names, containers)]
        total, trainer = ready_line(self.docker(names[0], "logs", containers[0], both=True))
        row = {"nodes": nodes, "first_step_s": round(step - start, 2), "container_s": round(max(ups) - start, 2),
               "trainer_total_s": total, "trainer": trainer, "busy_cpu_s": round(cpu, 1)}
        if total is not None:  # node 1's first process was ready at its launcher's start + total
            row["rest_s"] = round(step - ups[0] - total, 2)
        return row


def containers(hosts: Path) -> list[str]:
    """The job's container on each node of ``hosts``, as the tool names them."""
    from deploy.inventory import load
    from deploy.job.runtime import runtime

    inv = load(hosts)
    return [runtime(inv).container(n) for n in inv.nodes]


def measure(cluster, workdir: Path, nodes: list[int], rounds: int) -> dict:
    """Every round, on each node count: the three KINDS one after the other, in turn first."""
    bench = Bench(cluster, workdir)
    bench.ddp(bench.hosts(max(nodes)), "deploy")  # the image on every node before anything is timed
    runs: list[dict] = []
    for r in range(rounds):
        for n in nodes:
            for kind in KINDS[r % 3:] + KINDS[:r % 3]:
                row = getattr(bench, kind)(n)
                row.update(kind=kind, round=r)
                runs.append(row)
                print(f"round {r} {kind:6s} {n} node(s): first step {row['first_step_s']:.2f} s, "
                      f"containers up {row['container_s']:.2f} s, busy CPU {row['busy_cpu_s']:.1f} s", flush=True)
    return summarize(runs, nodes)


def summarize(runs: list[dict], nodes: list[int]) -> dict:
    rows = []
    for n in nodes:
        row: dict = {"nodes": n}
        for kind in KINDS:
            mine = [r for r in runs if r["nodes"] == n and r["kind"] == kind]
            med = {k: statistics.median(r[k] for r in mine if r.get(k) is not None)
                   for k in ("first_step_s", "container_s", "trainer_total_s", "rest_s", "busy_cpu_s")
                   if any(r.get(k) is not None for r in mine)}
            phases: dict[str, float] = {}
            for part in ("operator", "trainer"):
                names = {name for r in mine for name in r.get(part, {})}
                phases.update({f"{part}: {name}": statistics.median(r[part][name] for r in mine if name in r.get(part, {}))
                               for name in sorted(names)})
            row[kind] = {**med, "phases": phases}
        for kind in ("probed", "ours"):  # each launch against the floor
            row[f"{kind}_overhead_s"] = round(row[kind]["first_step_s"] - row["floor"]["first_step_s"], 2)
            row[f"{kind}_ratio"] = round(row[kind]["first_step_s"] / row["floor"]["first_step_s"], 2)
        rows.append(row)
    return {"bench": "launch", "runs": runs, "rows": rows}


def table(result: dict) -> str:
    lines = []
    for row in result["rows"]:
        lines.append(f"{row['nodes']} node(s) x {PROCS}: floor {row['floor']['first_step_s']:.2f} s; launch (probed) "
                     f"{row['probed']['first_step_s']:.2f} s, overhead {row['probed_overhead_s']:.2f} s, ratio "
                     f"{row['probed_ratio']:.2f}; relaunch (answers kept) {row['ours']['first_step_s']:.2f} s, "
                     f"overhead {row['ours_overhead_s']:.2f} s, ratio {row['ours_ratio']:.2f}")
        cols = [row[k] for k in KINDS]
        lines.append(f"    {'':34s} {'probed':>8s} {'kept':>8s} {'floor':>8s}")
        for key in ("first_step_s", "container_s", "trainer_total_s", "rest_s", "busy_cpu_s"):
            lines.append(f"    {key:34s} " + " ".join(f"{c.get(key, float('nan')):8.2f}" for c in cols))
        for name in sorted(set().union(*(c["phases"] for c in cols))):
            lines.append(f"    {name:34s} " + " ".join(f"{c['phases'].get(name, float('nan')):8.2f}" for c in cols))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", default="1,3", help="node counts, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="one round on one node, nothing written")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    nodes = [1] if args.smoke else [int(n) for n in args.nodes.split(",")]
    rounds = 1 if args.smoke else args.rounds

    from tests.cluster.netcluster import NetCluster

    with NetCluster(nodes=max(nodes)) as cluster:
        result = measure(cluster, Path(tempfile.mkdtemp(prefix="ddp-bench-launch-")), nodes, rounds)
    print(table(result))
    if args.smoke:
        return
    result.update(time=time.strftime("%Y-%m-%dT%H:%M:%S"), rounds=rounds, cores=os.cpu_count(),
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
