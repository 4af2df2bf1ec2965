"""Deploy-tool fan-out on the real test cluster (tests/cluster/netcluster.py), one run:

  1. `check` on 1 node vs on all nodes: wall-time ratio (nodes handled in parallel => ~1).
  2. `deploy` (image shipped to nodes that lack it) on 1 node vs on all nodes: ratio.
  3. a repeated `deploy` with nothing changed: seconds, and image bytes sent (target 0).
  4. `launch` to the first training step on all nodes (3 x 2 processes, docker runtime).
  5. `deploy` after a code-only change (the nodes hold the previous image, which shares every
     layer below the trainer code) on 1 node vs on all nodes: ratio, and image bytes sent.

Every timed `deploy` starts with an empty image cache (DDP_DEPLOY_IMAGE_CACHE), so each one
pays its own `docker save`.

Needs root, Debian's docker.io, openssh-server, debootstrap (like the cluster tests).
Run: python bench/bench_deploy.py [--rounds 2]; writes bench/results/deploy.json.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.netcluster import NetCluster, copy_build_context  # noqa: E402

IMAGE = "ddp-trainer:test"
TRAIN = ["--dataset", "synthetic", "--synthetic-size", "1536", "--batch-size", "32", "--epochs", "1",
         "--log-every", "1"]


def busy_cpu_seconds() -> float:
    """CPU time the whole machine (operator and every node: they share it) has spent busy."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def timed(times: dict, cpu: dict, key: str, cluster: NetCluster, hosts: Path, *args: str):
    """Runs ddp-deploy; records its wall time and the machine's busy CPU seconds under ``key``."""
    before = busy_cpu_seconds()
    took, proc = ddp(cluster, hosts, *args)
    times[key].append(took)
    cpu.setdefault(key, []).append(busy_cpu_seconds() - before)
    return proc


def ddp(cluster: NetCluster, hosts: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "DOCKER_HOST": cluster.operator_docker_host, "COLUMNS": "200",
           "DDP_DEPLOY_LOG": str(hosts.parent / "debug.log"), "DDP_DEPLOY_IMAGE_CACHE": str(cache_dir(hosts))}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "deploy", "--hosts", str(hosts), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"ddp-deploy {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return took, proc


def inventory(cluster: NetCluster, workdir: Path, nodes: int) -> Path:
    config = cluster.hosts_config("docker", 2, TRAIN, "eth0")
    config["nodes"] = config["nodes"][:nodes]
    path = workdir / f"hosts-{nodes}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def cache_dir(hosts: Path) -> Path:
    return hosts.parent / "image-cache"


def drop_image(cluster: NetCluster, hosts: Path, base: bool = True) -> None:
    """No node of ``hosts`` holds the image, nor its base unless ``base`` is False (the test
    cluster's nodes hold the base from the start): a cold deploy is one to a fresh node; with the
    base held, one to a node that ran an earlier image."""
    import yaml

    names = [n["name"] for n in yaml.safe_load(hosts.read_text())["nodes"]]
    if not base:
        cluster.hold_base(names)  # where an earlier cold deploy's drop took it
    for name in names:
        cluster.run_on(name, ["docker", "image", "rm", "-f", IMAGE, *([cluster.base_image] if base else [])])
    shutil.rmtree(cache_dir(hosts), ignore_errors=True)


def operator_docker(cluster: NetCluster, *args: str) -> str:
    proc = subprocess.run(["docker", "-H", cluster.operator_docker_host, *args], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"docker {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout.strip()


def build(cluster: NetCluster, hosts: Path) -> None:
    """IMAGE built in the operator's daemon by the command `deploy` runs (deploy/images/build.py),
    without shipping it anywhere."""
    from deploy.images.build import build_argv
    from deploy.inventory import load

    argv = build_argv(load(hosts))
    operator_docker(cluster, *argv[1:])


def build_code_change(cluster: NetCluster, workdir: Path) -> str:
    """Tag IMAGE to a rebuild with one changed trainer file (the dependency layers come from the cache)."""
    context = copy_build_context(workdir / "ctx")
    models = context / "trainer" / "models.py"
    models.write_text(models.read_text() + f"\n# code-only change {time.time()}\n")
    operator_docker(cluster, "build", "--build-arg", f"BASE_IMAGE={cluster.base_image}", "-t", IMAGE, str(context))
    return operator_docker(cluster, "image", "inspect", "--format", "{{.Id}}", IMAGE)


def hold_previous(cluster: NetCluster, hosts: Path, previous: str, current: str) -> None:
    """Every node holds the previous image under IMAGE and not the current one; the cache is empty."""
    for h in cluster.hosts:
        cluster.run_on(h.name, ["docker", "image", "rm", "-f", current])
        cluster.run_on(h.name, ["docker", "tag", previous, IMAGE])
    shutil.rmtree(cache_dir(hosts), ignore_errors=True)


def shipped_mb(output: str) -> float:
    return sum(float(mb) for mb in re.findall(r"shipped ([\d.]+) MB", output))


def measure(cluster: NetCluster, workdir: Path, rounds: int, nodes: int | None = None,
            only_check: bool = False, cold_all: bool = True, cold_one: bool = True) -> dict:
    """Every part (the module's docstring) ``rounds`` times, on 1 node and on ``nodes`` (default:
    all of the cluster's): the record main() writes. The operator's IMAGE is left retagged to the
    code-only change's build (its previous build stays tagged ``ddp-trainer:previous``).

    ``cold_all``, ``cold_one``: the deploy to every node, to one node, finds them without the
    base too. The smoke test (tests/cluster/test_bench_deploy.py) sets both False: the nodes hold
    the base, and only the layers above it travel (a whole ship costs about 33 s of a core, and
    putting the base back on a node 20 more)."""
    times: dict[str, list[float]] = {"check_1": [], "check_all": [], "deploy_1": [], "deploy_all": [],
                                     "redeploy_all": [], "launch_to_first_step": [],
                                     "code_change_1": [], "code_change_all": []}
    cpu: dict[str, list[float]] = {}
    redeploy_mb: list[float] = []
    code_change_mb: dict[str, list[float]] = {"1": [], "all": []}
    deploy_mb: dict[str, list[float]] = {"1": [], "all": []}
    nodes = nodes or len(cluster.hosts)
    one, every = inventory(cluster, workdir, 1), inventory(cluster, workdir, nodes)
    if not only_check:
        build(cluster, every)  # once, so later rounds time shipping alone
    for _ in range(rounds):
        timed(times, cpu, "check_1", cluster, one, "check")
        timed(times, cpu, "check_all", cluster, every, "check")
        if only_check:
            continue
        drop_image(cluster, one, base=cold_one)
        deploy_mb["1"].append(shipped_mb(timed(times, cpu, "deploy_1", cluster, one, "deploy", "--no-build").stdout))
        drop_image(cluster, every, base=cold_all)
        deploy_mb["all"].append(shipped_mb(timed(times, cpu, "deploy_all", cluster, every, "deploy",
                                                 "--no-build").stdout))
        took, proc = ddp(cluster, every, "deploy", "--no-build")
        times["redeploy_all"].append(took)
        redeploy_mb.append(shipped_mb(proc.stdout))

        subprocess.run(["rm", "-rf", f"{cluster.nas_dir}/ckpt"], check=True)
        ddp(cluster, every, "deploy", "--no-build")  # recreates the NAS directories
        started = time.time()
        ddp(cluster, every, "launch")
        metrics = Path(cluster.nas_dir) / "ckpt" / "metrics.jsonl"
        first = None
        while first is None and time.time() - started < 600:
            if metrics.exists():
                first = next((json.loads(line)["time"] for line in metrics.read_text().splitlines()
                              if '"kind": "train"' in line), None)
            time.sleep(0.2)
        times["launch_to_first_step"].append((first or float("nan")) - started)
        ddp(cluster, every, "stop")

    if not only_check:
        previous = operator_docker(cluster, "image", "inspect", "--format", "{{.Id}}", IMAGE)
        ddp(cluster, every, "deploy", "--no-build")  # every node holds the previous image
        operator_docker(cluster, "tag", previous, "ddp-trainer:previous")
        current = build_code_change(cluster, workdir)
        for _ in range(rounds):
            for key, hosts in (("1", one), ("all", every)):
                hold_previous(cluster, hosts, previous, current)
                proc = timed(times, cpu, f"code_change_{key}", cluster, hosts, "deploy", "--no-build")
                code_change_mb[key].append(shipped_mb(proc.stdout))

    times = {k: v for k, v in times.items() if v}
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bench": "deploy", "nodes": nodes, "rounds": rounds, "seconds": times, "median": med,
        "check_all_over_1": med["check_all"] / med["check_1"],
        "deploy_all_over_1": med["deploy_all"] / med["deploy_1"] if "deploy_1" in med else None,
        "deploy_image_mb": deploy_mb, "redeploy_image_mb": redeploy_mb,
        "code_change_all_over_1": (med["code_change_all"] / med["code_change_1"]
                                   if "code_change_1" in med else None),
        "code_change_image_mb": code_change_mb, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        # All nodes and the operator share this machine's cores: a run on N nodes needs at least
        # its busy CPU seconds / cores of wall time, whatever the parallelism.
        "cores": os.cpu_count(), "busy_cpu_seconds": cpu, "cold_all": cold_all, "cold_one": cold_one,
        "busy_cpu_median": {k: statistics.median(v) for k, v in cpu.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--only-check", action="store_true", help="time `check` alone (1 vs all nodes)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="ddp-bench-deploy-"))
    with NetCluster(nodes=3) as cluster:
        record = measure(cluster, workdir, args.rounds, only_check=args.only_check)
    nodes, times = record["nodes"], record["seconds"]
    for k, v in record["median"].items():
        spent = f"   busy CPU {record['busy_cpu_median'][k]:6.2f} s" if k in record["busy_cpu_median"] else ""
        print(f"{k:22s} {v:8.2f} s   rounds: {', '.join(f'{x:.2f}' for x in times[k])}{spent}")
    print(f"check  {nodes} nodes / 1 node = {record['check_all_over_1']:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only_check:
        (out / "deploy-check.json").write_text(json.dumps(record, indent=2) + "\n")
        return
    redeploy_mb, code_change_mb = record["redeploy_image_mb"], record["code_change_image_mb"]
    print(f"deploy {nodes} nodes / 1 node = {record['deploy_all_over_1']:.2f}")
    print(f"repeated deploy sent {max(redeploy_mb):.1f} MB of image")
    print(f"code-only change: deploy {nodes} nodes / 1 node = {record['code_change_all_over_1']:.2f}, "
          f"{max(code_change_mb['all']) / nodes:.1f} MB of image per node")
    (out / "deploy.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
