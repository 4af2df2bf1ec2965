"""torchrun across the test cluster over SSH, without the deploy tool: the recipe it automates.

c10d rendezvous on node1, ``--rdzv-conf is_host=1`` there (hostnames do not resolve to node
addresses, so no node would otherwise start the store), ``--local-addr`` on every node, and
``GLOO_SOCKET_IFNAME`` naming the node's interface: without it every rank advertises 127.0.0.1
(what the shared hostname resolves to) and the full mesh fails after 60 s with "Connection
refused, remote=[127.0.0.1]".
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

NPROC = 2
PORT = 29400

ALLREDUCE = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist

    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "sum": t.item(),
                   "node": os.environ["NODE_NAME"],
                   "local_rank": int(os.environ["LOCAL_RANK"])}, f)
    dist.barrier()
    dist.destroy_process_group()
""")


def _torchrun_argv(cluster, host, script, out, rdzv_id):
    endpoint = cluster.hosts[0]
    argv = [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(len(cluster.hosts)), "--nproc-per-node", str(NPROC),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{endpoint.address}:{PORT}",
            "--rdzv-id", rdzv_id, "--local-addr", host.address, "--max-restarts", "0"]
    if host is endpoint:
        argv += ["--rdzv-conf", "is_host=1"]
    return argv + [script, out]


def test_torchrun_allreduce_across_three_nodes_over_ssh(cluster, tmp_path):
    nas = Path(cluster.nas_dir)
    job = nas / f"torchrun-{int(time.time() * 1000)}"
    (job / "out").mkdir(parents=True)
    script = job / "allreduce.py"
    script.write_text(ALLREDUCE)
    procs, logs = {}, {}
    try:
        for h in cluster.hosts:
            argv = _torchrun_argv(cluster, h, str(script), str(job / "out"), job.name)
            # Gloo advertises the address the hostname resolves to (127.0.0.1 here, as on many
            # real hosts) unless told the interface; `echo $$` + exec records the remote pid.
            # TMPDIR in the job's folder: torchrun keeps its logs in a $TMPDIR/torchelastic_* it
            # never removes, and these nodes share this machine's /tmp.
            tmp = shlex.quote(str(job / f"tmp-{h.name}"))
            remote = (f"echo $$ > {shlex.quote(str(job / (h.name + '.pid')))} && mkdir -p {tmp} && "
                      f"NODE_NAME={shlex.quote(h.name)} GLOO_SOCKET_IFNAME=eth0 TMPDIR={tmp} "
                      f"exec {shlex.join(argv)}")
            logs[h.name] = open(tmp_path / f"{h.name}.log", "w+")
            procs[h.name] = subprocess.Popen(cluster.ssh_argv(h.name, ["sh", "-c", remote]),
                                             stdout=logs[h.name], stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        failed = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
        if failed:
            tails = "\n".join(f"--- {n} ({'still running' if rc is None else f'exit {rc}'}):\n"
                              + (tmp_path / f"{n}.log").read_text()[-2500:]
                              for n, rc in failed.items())
            pytest.fail(f"torchrun failed on {sorted(failed)}:\n{tails}")
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                pidfile = job / f"{name}.pid"
                if pidfile.exists():
                    cluster.run_on(name, ["kill", pidfile.read_text().strip()])
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()

    results = [json.loads(f.read_text()) for f in sorted((job / "out").glob("rank*.json"))]
    world = len(cluster.hosts) * NPROC
    assert sorted(r["rank"] for r in results) == list(range(world))
    assert {r["world"] for r in results} == {world}
    assert {r["sum"] for r in results} == {float(sum(range(world)))}
    per_node = {h.name: sorted(r["local_rank"] for r in results if r["node"] == h.name)
                for h in cluster.hosts}
    assert per_node == {h.name: list(range(NPROC)) for h in cluster.hosts}
