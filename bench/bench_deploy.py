"""Deploy-tool fan-out on the real test cluster (tests/cluster/netcluster.py), one run:

  1. `check` on 1 node vs on all nodes: wall-time ratio (nodes handled in parallel => ~1).
  2. `deploy` (image shipped to nodes that lack it) on 1 node vs on all nodes: ratio.
  3. a repeated `deploy` with nothing changed: seconds, and image bytes sent (target 0).
  4. `launch` to the first training step on all nodes (3 x 2 processes, docker runtime).

Needs root, Debian's docker.io, openssh-server, debootstrap (like the cluster tests).
Run: python bench/bench_deploy.py [--rounds 2]; writes bench/results/deploy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.netcluster import NetCluster  # noqa: E402

IMAGE = "ddp-trainer:test"
TRAIN = ["--dataset", "synthetic", "--synthetic-size", "1536", "--batch-size", "32", "--epochs", "1",
         "--log-every", "1"]


def ddp(cluster: NetCluster, hosts: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "DOCKER_HOST": cluster.operator_docker_host, "COLUMNS": "200",
           "DDP_DEPLOY_LOG": str(hosts.parent / "debug.log")}
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


def drop_image(cluster: NetCluster) -> None:
    for h in cluster.hosts:
        cluster.run_on(h.name, ["docker", "image", "rm", "-f", IMAGE])


def shipped_mb(output: str) -> float:
    return sum(float(mb) for mb in re.findall(r"shipped ([\d.]+) MB", output))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--only-check", action="store_true", help="time `check` alone (1 vs all nodes)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="ddp-bench-deploy-"))
    times: dict[str, list[float]] = {"check_1": [], "check_all": [], "deploy_1": [], "deploy_all": [],
                                     "redeploy_all": [], "launch_to_first_step": []}
    redeploy_mb: list[float] = []
    with NetCluster(nodes=3) as cluster:
        one, every = inventory(cluster, workdir, 1), inventory(cluster, workdir, len(cluster.hosts))
        if not args.only_check:
            ddp(cluster, every, "deploy")  # builds the image once, so later rounds time shipping alone
        for _ in range(args.rounds):
            times["check_1"].append(ddp(cluster, one, "check")[0])
            times["check_all"].append(ddp(cluster, every, "check")[0])
            if args.only_check:
                continue
            drop_image(cluster)
            times["deploy_1"].append(ddp(cluster, one, "deploy", "--no-build")[0])
            drop_image(cluster)
            times["deploy_all"].append(ddp(cluster, every, "deploy", "--no-build")[0])
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
        nodes = len(cluster.hosts)

    times = {k: v for k, v in times.items() if v}
    med = {k: statistics.median(v) for k, v in times.items()}
    record = {
        "bench": "deploy", "nodes": nodes, "rounds": args.rounds, "seconds": times, "median": med,
        "check_all_over_1": med["check_all"] / med["check_1"],
        "deploy_all_over_1": med["deploy_all"] / med["deploy_1"] if "deploy_1" in med else None,
        "redeploy_image_mb": redeploy_mb, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for k, v in med.items():
        print(f"{k:22s} {v:8.2f} s   rounds: {', '.join(f'{x:.2f}' for x in times[k])}")
    print(f"check  {nodes} nodes / 1 node = {record['check_all_over_1']:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only_check:
        (out / "deploy-check.json").write_text(json.dumps(record, indent=2) + "\n")
        return
    print(f"deploy {nodes} nodes / 1 node = {record['deploy_all_over_1']:.2f}")
    print(f"repeated deploy sent {max(redeploy_mb):.1f} MB of image")
    (out / "deploy.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
