"""The test cluster itself: real hosts, each with its own SSH server, Docker daemon and address."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from . import netcluster

pytestmark = pytest.mark.cluster


def test_ssh_with_strict_host_keys_reaches_each_node_at_its_own_address(cluster):
    for h in cluster.hosts:
        r = cluster.ssh(h.name, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"])
        assert r.returncode == 0, r.stderr
        assert f"inet {h.address}/24" in r.stdout
        others = [o.address for o in cluster.hosts if o is not h]
        assert not any(f"inet {a}/" in r.stdout for a in others)


def test_ssh_refuses_a_host_whose_key_is_not_known(cluster, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    argv = cluster.ssh_argv("node1", ["true"])
    argv[argv.index(f"UserKnownHostsFile={cluster.known_hosts}")] = f"UserKnownHostsFile={empty}"
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == 255
    assert "host key" in r.stderr.lower() or "verification failed" in r.stderr.lower()


def test_ssh_sessions_get_the_nodes_docker_host_and_the_test_python_on_path(cluster):
    for h in cluster.hosts:
        r = cluster.ssh(h.name, ["sh", "-c", 'echo "$DOCKER_HOST"; echo "$PATH"'])
        docker_host, path = r.stdout.splitlines()
        assert docker_host == cluster.node_docker_host(h.name)
        assert netcluster.os.path.dirname(sys.executable) in path.split(":")


def test_each_node_has_its_own_docker_daemon_holding_the_operators_base_image(cluster):
    ids = {}
    base = subprocess.run(["docker", "-H", cluster.operator_docker_host, "image", "inspect", "--format", "{{.Id}}",
                           cluster.base_image], capture_output=True, text=True, check=True).stdout.strip()
    for h in cluster.hosts:
        r = cluster.ssh(h.name, ["docker", "info", "--format", "{{json .}}"])
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        ids[h.name] = info["ID"]
        assert info["DockerRootDir"].endswith(f"/{h.name}")
        # the base, as on a node that ran an earlier image of the job: a deploy ships what is above it
        r = cluster.ssh(h.name, ["docker", "image", "inspect", "--format", "{{.Id}}", cluster.base_image])
        assert r.returncode == 0 and r.stdout.strip() == base, r.stderr
    operator = subprocess.run(
        ["docker", "-H", cluster.operator_docker_host, "info", "--format", "{{.ID}}"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert len(set(ids.values()) | {operator}) == len(cluster.hosts) + 1, ids


def test_the_nodes_share_the_kept_base_s_files_and_one_node_s_write_reaches_no_other(cluster):
    """The nodes' stores hold the base as hard links to the kept template's layer files
    (_copy_node_stores): one copy on disk and in the page cache for every node. A container that
    writes to such a file writes to a copy in its own layer: the template and the other nodes keep
    the original. (A node whose base was removed and loaded again, as the deploy benchmark's cold
    deploy does, holds a layer of its own, under another directory.)"""
    rel = "opt/venv/lib/python3.11/site-packages/torch/version.py"
    template = netcluster.node_store_template()
    kept = next(template.glob(f"overlay2/*/diff/{rel}"))
    in_store = kept.relative_to(template)  # overlay2/LAYER/diff/...
    layer = Path(*in_store.parts[:2])
    nodes = [h.name for h in cluster.hosts if (cluster.site.data_root / h.name / layer).is_dir()]
    assert len(nodes) >= 2, f"only {nodes} still hold the kept base's layer"
    assert {(cluster.site.data_root / n / in_store).stat().st_ino for n in nodes} == {kept.stat().st_ino}
    before = kept.read_bytes()
    wrote = cluster.ssh(nodes[0], ["docker", "run", "--rm", "--user", "0", cluster.base_image, "sh", "-c",
                                   f"echo 'changed = True' >> /{rel} && tail -n 1 /{rel}"])
    assert wrote.returncode == 0 and wrote.stdout.strip() == "changed = True", wrote.stderr
    assert kept.read_bytes() == before
    other = cluster.ssh(nodes[1], ["docker", "run", "--rm", cluster.base_image, "tail", "-n", "1", f"/{rel}"])
    assert other.returncode == 0 and other.stdout == before.decode().splitlines(keepends=True)[-1], other


def test_a_file_written_to_the_nas_by_node1_is_read_by_node3(cluster):
    path = f"{cluster.nas_dir}/hello-from-node1"
    r = cluster.ssh("node1", ["sh", "-c", f"echo written-by-node1 > {path}"])
    assert r.returncode == 0, r.stderr
    r = cluster.ssh("node3", ["cat", path])
    assert r.stdout.strip() == "written-by-node1"


def test_the_container_user_can_write_to_the_nas(cluster):
    for sub in ("data", "ckpt"):
        r = cluster.run_on("node2", ["setpriv", "--reuid", "1000", "--regid", "1000",
                                     "--clear-groups", "touch", f"{cluster.nas_dir}/{sub}/uid1000"])
        assert r.returncode == 0, r.stderr


def test_operator_daemon_runs_the_base_image_with_torch(cluster):
    r = subprocess.run(
        ["docker", "-H", cluster.operator_docker_host, "run", "--rm", "--network", "host",
         cluster.base_image, "python", "-c",
         "import torch, numpy, yaml; print(torch.__version__)"],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("2.13.0")


def _import_probe_image(cluster, node: str) -> None:
    """A tiny image of the machine's own cat and libc, imported straight into the node's daemon."""
    files = ["usr/bin/cat", "lib64/ld-linux-x86-64.so.2", "lib/x86_64-linux-gnu/libc.so.6"]
    tar = subprocess.Popen(["tar", "-C", "/", "-ch", *files], stdout=subprocess.PIPE)
    imported = cluster.run_on(node, ["docker", "import", "-", "ddp-probe:cat"], stdin=tar.stdout)
    tar.stdout.close()
    assert tar.wait() == 0 and imported.returncode == 0, imported.stderr


def test_a_container_on_a_node_with_host_network_sees_the_nodes_address(cluster):
    """The premise of the docker runtime: --network host on node2's daemon is node2's network."""
    _import_probe_image(cluster, "node2")
    r = cluster.ssh("node2", ["docker", "run", "--rm", "--network", "host", "ddp-probe:cat",
                              "/usr/bin/cat", "/proc/net/fib_trie"])
    assert r.returncode == 0, r.stderr
    assert cluster.host("node2").address in r.stdout
    assert cluster.host("node1").address not in r.stdout


@pytest.mark.skipif(not (netcluster.CGROUP_V1_CPU / "cpu.shares").exists(), reason="cgroup v1 only: "
                    "elsewhere the containers go where dockerd puts them")
def test_every_nodes_containers_share_one_cgroup_weighing_one_process_a_node(cluster):
    """Under the other lane of `make test`, the cluster's job must not get the CPU share of a single
    process: its containers run in our cgroup, each node weighed as one process at nice 0."""
    _import_probe_image(cluster, "node1")
    r = cluster.ssh("node1", ["docker", "run", "--rm", "ddp-probe:cat", "/usr/bin/cat", "/proc/self/cgroup"])
    assert r.returncode == 0, r.stderr
    cpu = next(line for line in r.stdout.splitlines() if ":cpu," in line or line.split(":")[1] == "cpu")
    assert cpu.split(":")[2].startswith(f"/{cluster.site.cgroup}/"), cpu
    shares = (netcluster.CGROUP_V1_CPU / cluster.site.cgroup / "cpu.shares").read_text()
    assert int(shares) == netcluster.CGROUP_SHARES


SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    conn, peer = s.accept()
    conn.sendall(("pong to " + peer[0]).encode())
    conn.close()
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        print(c.recv(100).decode())
""")


def _serve_once(cluster, name, port):
    h = cluster.host(name)
    server = subprocess.Popen(
        ["nsenter", f"--net=/var/run/netns/{h.ns}", sys.executable, "-c", SERVER,
         h.address, str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    return server


def _connect(cluster, src, dst, port, timeout=5.0):
    return cluster.run_on(src, [sys.executable, "-c", CLIENT, cluster.host(dst).address,
                                str(port), str(timeout)], timeout=timeout + 30)


def test_two_nodes_reach_each_other_over_tcp(cluster):
    server = _serve_once(cluster, "node2", 45123)
    try:
        r = _connect(cluster, "node1", "node2", 45123)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"pong to {cluster.host('node1').address}"
    finally:
        server.kill()
        server.wait()


def test_a_node_whose_link_is_down_is_unreachable_until_it_comes_back(cluster):
    server = _serve_once(cluster, "node3", 45124)
    try:
        cluster.take_link_down("node3")
        try:
            r = _connect(cluster, "node1", "node3", 45124, timeout=2.0)
            assert r.returncode != 0
        finally:
            cluster.bring_link_up("node3")
        r = _connect(cluster, "node1", "node3", 45124, timeout=10.0)
        assert r.returncode == 0, r.stderr
    finally:
        server.kill()
        server.wait()


SINK = textwrap.dedent("""
    import socket, sys, time
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    conn, _ = s.accept()
    got, start = 0, None
    while chunk := conn.recv(1 << 20):
        start = start or time.monotonic()
        got += len(chunk)
    print(got, time.monotonic() - start, flush=True)
""")

SOURCE = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as c:
        c.sendall(bytes(int(sys.argv[3])))
""")


def _transfer_mbit(cluster, src, dst, port, nbytes):
    """Megabits per second of one TCP transfer from node ``src`` to node ``dst``, timed by the
    receiver from its first byte to the sender's close."""
    h = cluster.host(dst)
    sink = subprocess.Popen(["nsenter", f"--net=/var/run/netns/{h.ns}", sys.executable, "-c", SINK,
                             h.address, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "listening"
        r = cluster.run_on(src, [sys.executable, "-c", SOURCE, h.address, str(port), str(nbytes)])
        assert r.returncode == 0, r.stderr
        got, seconds = sink.communicate(timeout=60)[0].split()
    finally:
        sink.kill()
        sink.wait()
    assert int(got) == nbytes
    return nbytes * 8 / float(seconds) / 1e6


def test_a_shaped_link_carries_its_rate_both_ways_and_full_speed_once_unshaped(cluster):
    rate, nbytes = 80, 16 * 10**6  # 1.6 s each way at the shaped rate
    cluster.shape_link("node2", rate)
    try:
        assert all("tbf" in q and "rate 80Mbit" in q for q in cluster.link_qdiscs("node2"))
        sent = _transfer_mbit(cluster, "node2", "node1", 45125, nbytes)
        received = _transfer_mbit(cluster, "node3", "node2", 45126, nbytes)
        assert 0.75 * rate <= sent <= 1.25 * rate, sent
        assert 0.75 * rate <= received <= 1.25 * rate, received
    finally:
        cluster.unshape_link("node2")
    assert not any("tbf" in q for q in cluster.link_qdiscs("node2"))
    assert _transfer_mbit(cluster, "node3", "node2", 45127, nbytes) > 3 * rate
    cluster.unshape_link("node2")  # unshaping a plain link is not an error


def test_bringing_a_shaped_link_back_up_leaves_it_unshaped(cluster):
    cluster.shape_link("node3", 50)
    cluster.take_link_down("node3")
    cluster.bring_link_up("node3")
    assert not any("tbf" in q for q in cluster.link_qdiscs("node3"))


def test_hosts_yaml_describes_every_node_and_the_cluster_paths(cluster, tmp_path):
    yaml = pytest.importorskip("yaml")
    path = cluster.write_hosts_yaml(tmp_path / "hosts.yaml", runtime="host", procs=3,
                                    train_args=["--epochs", "2"], job={"max_restarts": 0})
    doc = yaml.safe_load(path.read_text())
    assert doc["job"] == {"name": "ddp-test", "runtime": "host", "max_restarts": 0}
    assert [n["address"] for n in doc["nodes"]] == [h.address for h in cluster.hosts]
    assert {n["procs"] for n in doc["nodes"]} == {3}
    assert doc["ssh"]["known_hosts"] == cluster.known_hosts
    assert doc["train"]["args"] == ["--epochs", "2"]
    assert doc["storage"]["data"]["host"].startswith(cluster.nas_dir)


def test_hosts_yaml_is_accepted_by_the_deploy_tools_inventory(cluster, tmp_path):
    inventory = pytest.importorskip("deploy.inventory")
    for runtime in ("docker", "host"):
        path = cluster.write_hosts_yaml(tmp_path / f"{runtime}.yaml", runtime=runtime,
                                        interface="eth0")
        inv = inventory.load(path)
        assert [n.address for n in inv.nodes] == [h.address for h in cluster.hosts]
        assert inv.rdzv_node.name == "node1"
        assert inv.context_path() == netcluster.REPO_ROOT


def _cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: (gone)"


def test_down_removes_every_trace_and_up_builds_the_cluster_again(cluster, containerd_node, image_registry, slurm):
    """Runs last in this file: the other test files get the rebuilt cluster, and the parts built on
    it (the containerd node, the registry, Slurm) are started again for them."""
    state_dir, site = cluster.state_dir, cluster.site
    others = re.compile(r"ddp[1-9][0-9]*[nv][0-9]+$|ddpbr[1-9]|ddpcluster[1-9]|operator[1-9][0-9]*-docker-")  # sites beside it
    cluster.down()
    try:  # what down left, read before up, asserted after it: a failure here costs no other test its cluster
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        mounts = open("/proc/self/mounts").read()
        left = {
            "links": [ln.split(":")[1].strip() for ln in links.splitlines()
                      if site.bridge in ln or site.veth_prefix in ln],
            "namespaces": [n for n in (line.split()[0] for line in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines() if line.strip())
                if not others.match(n)],
            "forward rule": subprocess.run(["iptables", "-C", *site.forward_rule],
                                           capture_output=True).returncode == 0,
            "processes": [_cmdline(p) for p in netcluster._processes_referencing(
                [site.run_root, site.data_root, site.operator_store()])],
            "mounts": [ln for ln in mounts.splitlines()
                       if ("ddpcluster" in ln or "operator-docker-" in ln) and not others.search(ln)],
            "paths": [str(p) for p in (state_dir, site.run_root) if p.exists()],
            "cgroups": [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{site.cgroup}")],
        }
    finally:
        cluster.up()
    assert not any(left.values()), f"down left: { {k: v for k, v in left.items() if v} }"

    r = cluster.ssh("node3", ["docker", "info", "--format", "{{.ID}}"])
    assert r.returncode == 0, r.stderr
    assert containerd_node.docker("image", "inspect", "--format", "{{.Id}}", netcluster.BASE_IMAGE).returncode == 0
    with socket.create_connection((containerd_node.address, 22), timeout=10) as conn:
        assert conn.recv(64).startswith(b"SSH-2.0-")  # its sshd is back
    assert image_registry.manifest("nothing-here", "latest") is None  # it answers, over TLS
    slurm.wait_idle()
    assert set(slurm.node_states()) == {h.name for h in cluster.hosts}
