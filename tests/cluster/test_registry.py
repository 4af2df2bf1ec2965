"""Registry delivery on the cluster: image.name names the registry of ``image_registry`` (Debian's
docker-registry over TLS, in a namespace of its own), ``deploy`` pushes once from the operator's daemon
and every node's own daemon pulls by digest. What the nodes hold is read from their daemons, what the
registry holds from the registry itself. The image is a few MB of random bytes in two layers, so
that the test is about the delivery, not about moving the base image."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from .operator_cli import ddp, image_id_on, ok

pytestmark = pytest.mark.cluster

REPOSITORY = "ddp-test/registry"


def _build_context(tmp_path: Path, shared: bytes, own_mb: int) -> Path:
    """Two layers: ``shared`` (the same in every image of this file) and fresh random bytes."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "shared").write_bytes(shared)
    (ctx / "own").write_bytes(os.urandom(own_mb << 20))
    (ctx / "Dockerfile").write_text("FROM scratch\nCOPY shared /shared\nCOPY own /own\n")
    return ctx


@pytest.fixture(scope="module")
def shared_layer() -> bytes:
    return os.urandom(3 << 20)


def _hosts(cluster, tmp_path: Path, name: str, ctx: Path) -> Path:
    return cluster.write_hosts_yaml(tmp_path / "hosts.yaml", image={
        "name": name, "dockerfile": str(ctx / "Dockerfile"), "context": str(ctx), "build_args": {}})


def _operator_id(cluster, name: str) -> str:
    return subprocess.run(["docker", "-H", cluster.operator_docker_host, "image", "inspect", "--format", "{{.Id}}",
                           name], capture_output=True, text=True, check=True).stdout.strip()


def _repo_digests(cluster, node: str, name: str) -> list[str]:
    r = cluster.run_on(node, ["docker", "image", "inspect", "--format", "{{range .RepoDigests}}{{.}} {{end}}", name])
    return r.stdout.split()


def test_deploy_pushes_once_and_every_node_pulls_the_exact_image_by_digest(cluster, image_registry, tmp_path,
                                                                            shared_layer):
    name = f"{image_registry.host}/{REPOSITORY}:one"
    hosts = _hosts(cluster, tmp_path, name, _build_context(tmp_path, shared_layer, 2))
    dry = ok(ddp(cluster, hosts, "deploy", "--dry-run"))
    assert f"[local] docker push {name}" in dry.stdout
    assert all(f"[{h.name}] sh -c 'docker pull" in dry.stdout for h in cluster.hosts)

    first = ok(ddp(cluster, hosts, "deploy"))
    image_id = _operator_id(cluster, name)
    held = image_registry.manifest(REPOSITORY, "one")
    assert held is not None, "the registry holds no manifest for the tag"
    digest, manifest = held
    assert manifest["config"]["digest"] == image_id  # the registry holds the image built here
    for h in cluster.hosts:
        assert image_id_on(cluster, h.name, name) == image_id, h.name
        assert f"{image_registry.host}/{REPOSITORY}@{digest}" in _repo_digests(cluster, h.name, name), h.name
        assert f"{h.name}: shipped" in first.stdout
    assert "verified" in first.stderr

    again = ok(ddp(cluster, hosts, "deploy"))
    assert all(f"{h.name}: up to date" in again.stdout for h in cluster.hosts), again.stdout
    assert "pushing" not in again.stderr and "pulling" not in again.stderr


def test_a_node_that_cannot_reach_the_registry_is_named_and_the_others_get_the_image(cluster, image_registry,
                                                                                   tmp_path, shared_layer):
    name = f"{image_registry.host}/{REPOSITORY}:two"
    hosts = _hosts(cluster, tmp_path, name, _build_context(tmp_path, shared_layer, 1))
    cut = cluster.hosts[1].name
    image_registry.cut_off(cut)
    try:
        r = ddp(cluster, hosts, "deploy")
    finally:
        image_registry.reconnect(cut)
    assert r.returncode == 1, r.stdout + r.stderr
    image_id = _operator_id(cluster, name)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {cut}: image pull from {image_registry.host}: "), r.stderr
    assert "no route to host" in errors[0] and f"the node cannot reach {image_registry.host}" in errors[0]
    others = [h.name for h in cluster.hosts if h.name != cut]
    assert [image_id_on(cluster, n, name) for n in others] == [image_id] * len(others)
    assert image_id_on(cluster, cut, name) is None

    ok(ddp(cluster, hosts, "deploy"))  # a later deploy finishes it
    assert image_id_on(cluster, cut, name) == image_id


def test_a_containerd_node_pulls_the_same_image_and_names_it_by_the_pushed_digest(
        cluster, image_registry, containerd_node, tmp_path, shared_layer):
    """A containerd-store node pulls the same image, and names it by the pushed digest."""
    node9 = containerd_node
    name = f"{image_registry.host}/{REPOSITORY}:stores"
    ctx = _build_context(tmp_path, shared_layer, 1)
    config = cluster.hosts_config(procs=1, interface="eth0")
    config["nodes"] = [config["nodes"][0], node9.inventory_node()]
    config["image"].update(name=name, dockerfile=str(ctx / "Dockerfile"), context=str(ctx), build_args={})
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        first = ok(ddp(cluster, hosts, "deploy"))
        image_id = _operator_id(cluster, name)
        digest, manifest = image_registry.manifest(REPOSITORY, "stores")
        assert manifest["config"]["digest"] == image_id
        assert image_id_on(cluster, "node1", name) == image_id
        # that store names an image by its manifest's digest: the one pushed, whose config is the image's
        assert node9.docker("image", "inspect", "--format", "{{.Id}}", name).stdout.strip() == digest
        assert digest in node9.docker("image", "ls", "-q", "--no-trunc").stdout.split()  # its content is all there
        assert "node9: shipped" in first.stdout

        again = ok(ddp(cluster, hosts, "deploy"))
        assert "node1: up to date" in again.stdout and "node9: up to date" in again.stdout
    finally:
        node9.reset()
        cluster.run_on("node1", ["docker", "image", "rm", "-f", name])
