"""Both of Docker's image stores on real daemons: node1 (Docker 20.10, the classic store) and
node9 (Docker 26 with the containerd image store, containerd_node.py) get the image from one
deploy, layer-aware on both, by star and by chain; what deploy says per node; what each daemon
then holds, read from the daemon itself (node9's manifest read with containerd's own client); a
load the containerd store reports but cannot complete is refused, and the next deploy repairs it.

The image is small: a few MB on top of ``ddp-base:cpu``, which node9 holds from the start.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from deploy.engines import fleet
from deploy.images import image, oci
from deploy.inventory import load
from deploy.nodes.remote import Remote

from .operator_cli import ddp, ok

pytestmark = pytest.mark.cluster

NAME = "ddp-stores:test"


def _context(tmp_path: Path, code: str) -> Path:
    ctx = tmp_path / "ctx"
    ctx.mkdir(exist_ok=True)
    if not (ctx / "deps.bin").exists():
        (ctx / "deps.bin").write_bytes(os.urandom(3 << 20))
    (ctx / "code.txt").write_text(code)
    (ctx / "Dockerfile").write_text("ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\n"
                                    "COPY deps.bin /opt/deps.bin\nCOPY code.txt /opt/code.txt\n")
    return ctx


def _hosts(cluster, node9, tmp_path: Path, ctx: Path, transfer: str = "star") -> Path:
    config = cluster.hosts_config(procs=1, interface="eth0")
    config["nodes"] = [config["nodes"][0], node9.inventory_node()]
    config["image"].update(name=NAME, dockerfile=str(ctx / "Dockerfile"), context=str(ctx), transfer=transfer)
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _operator_id(cluster) -> str:
    return subprocess.run(["docker", "-H", cluster.operator_docker_host, "image", "inspect", "--format", "{{.Id}}",
                           NAME], capture_output=True, text=True, check=True).stdout.strip()


def _line(out: str, node: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"{node}: "))


def _config_of_manifest(node9, manifest: str) -> str:
    """The config digest the node's own manifest names (containerd's content store, by digest)."""
    got = node9.ctr("content", "get", manifest)
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)["config"]["digest"]


def _holds_exactly(cluster, node9, operator_id: str, code: str) -> None:
    assert image.parse_survey("node1", cluster.run_on("node1", ["sh", "-c", image.IDENTIFY, "sh", NAME]).stdout) \
        == image.NodeImages("node1", operator_id)
    manifest = node9.docker("image", "inspect", "--format", "{{.Id}}", NAME).stdout.strip()
    assert manifest != operator_id and _config_of_manifest(node9, manifest) == operator_id
    assert manifest in node9.docker("image", "ls", "-q", "--no-trunc").stdout.split()  # its content is all there
    names = node9.ctr("images", "ls", "-q").stdout.split()  # the name that held the previous image during the load
    assert not [n for n in names if "ddp-deploy-load-hold" in n], names  # is gone
    ran = node9.docker("run", "--rm", "--network", "none", NAME, "cat", "/opt/code.txt")
    assert (ran.returncode, ran.stdout) == (0, code), ran.stderr


@pytest.fixture
def stores(cluster, containerd_node, tmp_path, monkeypatch):
    """node1 and node9 without this test's image, an image cache of the test's own."""
    monkeypatch.setenv(image.CACHE_ENV, str(tmp_path / "cache"))
    yield
    cluster.run_on("node1", ["docker", "image", "rm", "-f", NAME])
    containerd_node.reset()
    subprocess.run(["docker", "-H", cluster.operator_docker_host, "image", "rm", "-f", NAME], capture_output=True)


def test_both_stores_get_the_exact_image_and_a_code_change_sends_only_its_layer(
        cluster, containerd_node, stores, tmp_path, monkeypatch):
    """Deploys leave the exact image on both stores, and a code change sends only its layer."""
    node9 = containerd_node
    hosts = _hosts(cluster, node9, tmp_path, _context(tmp_path, "v1"))
    monkeypatch.setenv("DDP_DEPLOY_IMAGE_CACHE_GB", "2")  # one saved image (base included) fits, two do not

    first = ok(ddp(cluster, hosts, "deploy"))
    v1 = _operator_id(cluster)
    assert "image stores: node1 classic, node9 containerd" in first.stdout
    line = _line(first.stdout, "node9")  # it holds the base: the layout without it
    assert line.startswith("node9: shipped ") and line.endswith(
        "(1 of 3 layers were there); containerd image store: an OCI layout without the 1 layers it holds"), line
    assert float(line.split()[2]) < 4.5  # MB: the 3 MB layer and the code, not the 1.2 GB base
    _holds_exactly(cluster, node9, v1, "v1")
    assert "image cache: " in first.stdout and "evicted" not in first.stdout

    hosts = _hosts(cluster, node9, tmp_path, _context(tmp_path, "v2"), "chain")  # a code-only change, by chain
    second = ok(ddp(cluster, hosts, "deploy"))
    v2 = _operator_id(cluster)
    for node in ("node1", "node9"):
        line = _line(second.stdout, node)
        assert "(2 of 3 layers were there)" in line and float(line.split()[2]) < 0.1, line
    assert "containerd image store: an OCI layout without the 2 layers it holds" in _line(second.stdout, "node9")
    _holds_exactly(cluster, node9, v2, "v2")
    cache = next(line for line in second.stdout.splitlines() if line.startswith("image cache: "))
    assert f"evicted ddp-stores_test {v1[:19]}" in cache and "1 saved image of 2 GB" in cache, cache

    again = ok(ddp(cluster, hosts, "deploy"))
    assert "node1: up to date" in again.stdout and "node9: up to date" in again.stdout

    inv = load(hosts)  # launch's check: one image on both stores
    with Remote(inv) as remote:
        assert fleet.one_image(inv, remote) == v2


def test_an_incomplete_containerd_load_is_refused_and_the_next_deploy_repairs_it(
        cluster, containerd_node, stores, tmp_path):
    """Docker 26's containerd store, given a layout without layers it does not hold, exits 1 but
    leaves the image's name on the exact manifest: the ID alone would pass, and a later survey
    would have found the node up to date."""
    node9 = containerd_node
    hosts = _hosts(cluster, node9, tmp_path, _context(tmp_path, "v1"))
    subprocess.run(["docker", "-H", cluster.operator_docker_host, "build", "-q", "--build-arg",
                    f"BASE_IMAGE={cluster.base_image}", "-t", NAME, str(tmp_path / "ctx")],
                   capture_output=True, check=True, timeout=600)
    inv = load(hosts)
    operator_id = _operator_id(cluster)
    env = {**os.environ, "DOCKER_HOST": cluster.operator_docker_host}
    saved_path = tmp_path / "saved.tar"
    with open(saved_path, "wb") as f:
        subprocess.run(["docker", "save", NAME], stdout=f, check=True, env=env, timeout=600)
    saved = image.index_saved(saved_path)
    ident = oci.identity(saved)
    partial = oci.layout(saved, 2, NAME)  # as if node9 held the 3 MB layer: it does not
    r = subprocess.run(node9_ssh(cluster, node9, image.load_argv(inv)), stdin=_pipe(partial), capture_output=True,
                       text=True, timeout=300)
    problem = image.load_problem(image.NodeImages("node9", None, store=image.CONTAINERD), r.stdout, ident)
    assert problem is not None and problem.startswith("docker load failed (exit 1): failed to unpack loaded image"), \
        r.stdout
    assert node9.docker("image", "inspect", "--format", "{{.Id}}", NAME).stdout.strip() == ident.manifest

    out = ok(ddp(cluster, hosts, "deploy", "--no-build"))
    line = _line(out.stdout, "node9")
    assert "every layer: the copy it holds lacks content" in line and "layers were there" not in line, line
    _holds_exactly(cluster, node9, operator_id, "v1")


def node9_ssh(cluster, node9, argv) -> list[str]:
    """ssh to node9 as deploy does (its host key is in the cluster's known_hosts)."""
    return ["ssh", "-i", cluster.ssh_key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={cluster.known_hosts}",
            "-o", "LogLevel=ERROR", f"root@{node9.address}", "--", shlex.join(argv)]


def _pipe(layout: oci.Layout):
    """The layout as a readable file (ssh's stdin)."""
    f = tempfile.TemporaryFile()
    for chunk in layout.chunks():
        f.write(chunk)
    f.seek(0)
    return f
