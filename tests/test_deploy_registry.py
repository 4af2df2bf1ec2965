"""Registry delivery (deploy/images/registry.py): the planned commands, how docker's output is read, and the
whole push-then-pull against a fake ``docker`` on PATH. With a real registry, real daemons and
real nodes: tests/cluster/test_registry.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from deploy.images import delivery, image, registry, ways
from deploy.errors import RemoteFailure, RuntimeFailure
from deploy.images.image import NodeImages
from deploy.images.registry import Manifest, PullProgress, Registry
from deploy.nodes.remote import Remote
from fakes import FAKE_DOCKER_START, install_command
from local_job import local_nodes, on_paper

NAME = "registry.example.com:5000/team/ddp:v1"
REPO = "registry.example.com:5000/team/ddp"
DIGEST = "sha256:" + "d" * 64
IMAGE_ID = "sha256:" + "c" * 64
BLOBS = ("sha256:" + "a1" * 32, "sha256:" + "b2" * 32)
SIZES = (3_001_122, 2_000_813)

# What `docker push` printed against the cluster's registry (docker 28 CLI, dockerd 20.10).
PUSH_OUTPUT = f"""The push refers to repository [{REPO}]
a25752f27aae: Preparing
6180119c09ae: Preparing
a25752f27aae: Pushed
6180119c09ae: Layer already exists
v1: digest: {DIGEST} size: 739
"""


def _pull_output(already: int = 0) -> list[str]:
    """`docker pull` without a terminal: one line per layer and status change, no byte counts."""
    short = [b[7:19] for b in BLOBS]
    lines = [f"{REPO}@{DIGEST}: Pulling from team/ddp"]
    lines += [f"{s}: Already exists" for s in short[:already]]
    lines += [f"{s}: Pulling fs layer" for s in short[already:]]
    for s in reversed(short[already:]):
        lines += [f"{s}: Verifying Checksum", f"{s}: Download complete"]
    lines += [f"{s}: Pull complete" for s in short[already:]]
    return lines + [f"Digest: {DIGEST}", f"Status: Downloaded newer image for {REPO}@{DIGEST}", f"{REPO}@{DIGEST}"]


def _manifest() -> dict:
    return {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 1563,
                       "digest": IMAGE_ID},
            "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "size": s, "digest": b}
                       for b, s in zip(BLOBS, SIZES)]}


def _inv(tmp_path: Path, name: str = NAME, nodes=("a", "b"), transfer: str = "auto"):
    return on_paper(local_nodes(*nodes), job="reg", nas=tmp_path, image={"name": name, "transfer": transfer},
                    base_dir=tmp_path)


# ------------------------------------------------------------------ the plan


@pytest.mark.parametrize("name, repo", [
    (NAME, REPO),
    ("registry.example.com:5000/team/ddp", "registry.example.com:5000/team/ddp"),
    ("localhost/ddp:latest", "localhost/ddp"),
    (f"reg.io/ddp:v2@{DIGEST}", "reg.io/ddp"),
])
def test_the_pull_names_the_repository_by_digest_never_by_tag(name, repo):
    assert registry.repository(name) == repo
    assert registry.pinned(name, DIGEST) == f"{repo}@{DIGEST}"


def test_a_name_that_names_a_registry_picks_the_registry_way(tmp_path):
    assert isinstance(ways.for_inventory(_inv(tmp_path)), Registry)
    assert not isinstance(ways.for_inventory(_inv(tmp_path, "ddp-trainer:test")), Registry)
    assert isinstance(ways.for_inventory(_inv(tmp_path, "localhost:5000/ddp:1", transfer="registry")), Registry)


def test_the_plan_pushes_once_reads_the_manifest_and_pulls_by_digest_on_each_node(tmp_path):
    """The planned commands push once, read the manifest, and pull by digest on each node."""
    way = Registry(_inv(tmp_path))
    assert registry.push_argv(way.inv) == ["docker", "push", NAME]
    pull = registry.pull_argv(way.inv, DIGEST)
    assert pull[-2:] == (f"{REPO}@{DIGEST}", NAME)
    lines = way.describe(["a", "b"])
    assert lines[0].startswith(f"[local] docker push {NAME} ") and "registry.example.com:5000" in lines[0]
    assert lines[1].startswith(f"[local] docker manifest inspect {REPO}@{registry.DIGEST_PLACEHOLDER} ")
    assert [line.split("]")[0] for line in lines[2:]] == ["[a", "[b"]
    assert all(f"{REPO}@{registry.DIGEST_PLACEHOLDER} {NAME}" in line for line in lines[2:])


def test_deploy_dry_run_prints_the_push_and_each_node_s_pull(ddp, tmp_path):
    hosts = tmp_path / "hosts.yaml"
    inv_yaml = {"job": {"name": "reg"}, "rendezvous": {"node": "a"},
                "nodes": [{"name": "a", "address": "198.18.0.11"}, {"name": "b", "address": "198.18.0.12"}],
                "image": {"name": NAME},
                "storage": {"data": {"host": "/nas/data", "container": "/data"},
                            "checkpoints": {"host": "/nas/ckpt", "container": "/ckpt"}}}
    hosts.write_text(json.dumps(inv_yaml))
    r = ddp(hosts, "deploy", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "by registry (image.transfer: auto)" in r.output
    assert f"[local] docker push {NAME}" in r.output
    for node in ("a", "b"):
        assert any(line.startswith(f"[{node}] sh -c ") and "docker pull" in line
                   and f"{REPO}@{registry.DIGEST_PLACEHOLDER}" in line for line in r.output.splitlines())


# ------------------------------------------------------------------ reading docker's output


def test_the_digest_is_read_from_the_push_s_last_line():
    assert registry.push_digest(PUSH_OUTPUT) == DIGEST
    assert registry.push_digest("a25752f27aae: Pushed\n") is None


def test_pull_progress_counts_downloaded_layers_sizes_not_those_the_node_had():
    """Pull progress counts each downloaded layer's size and leaves out those the node had."""
    fresh = PullProgress.of(Manifest(DIGEST, IMAGE_ID, tuple(zip(BLOBS, SIZES))))
    seen = []
    for line in _pull_output() + [f"ID {IMAGE_ID}"]:
        if fresh.feed(line):
            seen.append((fresh.stage, fresh.done))
    assert seen[-1] == ("loading", sum(SIZES)) and fresh.total == sum(SIZES)
    assert seen[0] == ("pulling", SIZES[1])  # the smaller layer came in first
    assert fresh.image_id == IMAGE_ID

    again = PullProgress.of(Manifest(DIGEST, IMAGE_ID, tuple(zip(BLOBS, SIZES))))
    for line in _pull_output(already=1):
        again.feed(line)
    assert again.done == again.total == SIZES[1] and len(again.held) == 1


@pytest.mark.parametrize("message, says", [
    ('Error response from daemon: Get "https://198.18.0.2:5000/v2/": x509: certificate signed by unknown authority',
     "/etc/docker/certs.d/registry.example.com:5000/ca.crt"),
    ('Error response from daemon: Get "https://198.18.0.2:5000/v2/": dial tcp 198.18.0.2:5000: connect: no route '
     "to host", "cannot reach registry.example.com:5000"),
    ("Error response from daemon: Head \"https://r/v2/team/ddp/manifests/v1\": no basic auth credentials",
     "`docker login registry.example.com:5000`"),
    ('Error response from daemon: pull access denied for r/team/ddp, repository does not exist or may require '
     "'docker login': denied: requested access to the resource is denied", "`docker login registry.example.com:5000`"),
    ('Error response from daemon: Get "https://r/v2/": http: server gave HTTP response to HTTPS client',
     "insecure-registries"),
    ("Error response from daemon: manifest for r/team/ddp@sha256:00 not found: manifest unknown: manifest unknown",
     "does not hold the pushed image"),
])
def test_a_failed_pull_gets_the_hint_its_message_calls_for(message, says):
    assert says in registry.hint(message, "registry.example.com:5000", "the node")


# ------------------------------------------------------------------ push then pull, docker faked

FAKE_DOCKER = (FAKE_DOCKER_START + r"""
open(os.path.join(d, "calls.log"), "a").write(json.dumps(a) + "\n")
if a[:1] == ["push"]:
    if read("push_fails"):
        sys.exit(read("push_fails"))
    print(read("push_output"))
elif a[:2] == ["manifest", "inspect"] and read("index.json") and a[2].endswith(read("index_digest")):
    print(read("index.json"))
elif a[:2] == ["manifest", "inspect"]:
    print(read("manifest.json"))
elif a[:1] == ["pull"]:
    if read("pull_fails"):
        sys.exit(read("pull_fails"))
    print(read("pull_output"))
elif a[:1] == ["tag"]:
    pass
elif a[:2] == ["image", "inspect"] and "{{.Os}}" in a[3]:
    print("linux/amd64")
elif a[:2] == ["image", "inspect"]:
    print("ID " + read("pulled_id"))
else:
    sys.exit(f"fake docker: unexpected {a}")
""").replace("PYTHON", sys.executable)


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    monkeypatch.setenv(image.CACHE_ENV, str(tmp_path / "image-cache"))  # identities recorded there
    install_command(tmp_path, monkeypatch, "docker", FAKE_DOCKER)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("FAKE_DOCKER_DIR", str(state))
    (state / "push_output").write_text(PUSH_OUTPUT)
    (state / "manifest.json").write_text(json.dumps(_manifest()))
    (state / "pull_output").write_text("\n".join(_pull_output()))
    (state / "pulled_id").write_text(IMAGE_ID)
    return state


def _calls(state: Path) -> list[list[str]]:
    log = state / "calls.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _held(*nodes_ids):
    return {n: NodeImages(n, i) for n, i in nodes_ids}


def _ship(tmp_path, held, nodes=("a", "b")):
    inv = _inv(tmp_path, nodes=nodes)
    seen = []
    with Remote(inv) as remote:
        out = Registry(inv).ship(remote, IMAGE_ID, held, lambda *a: seen.append(a))
    return out, seen


def test_one_push_then_each_node_lacking_the_image_pulls_by_digest_and_is_verified(tmp_path, fake_docker):
    """One push, then each node lacking the image pulls it by digest and is verified."""
    out, seen = _ship(tmp_path, _held(("a", None), ("b", "sha256:old"), ("c", IMAGE_ID)), nodes=("a", "b", "c"))
    calls = _calls(fake_docker)
    assert [c for c in calls if c[0] == "push"] == [["push", NAME]]
    pulls = [c for c in calls if c[0] == "pull"]
    assert pulls == [["pull", f"{REPO}@{DIGEST}"]] * 2  # a and b; c had it
    assert [c for c in calls if c[0] == "tag"] == [["tag", f"{REPO}@{DIGEST}", NAME]] * 2
    assert out["a"].sent_bytes == out["b"].sent_bytes == sum(SIZES) and out["c"].sent_bytes == 0
    assert ("registry.example.com:5000", "verified", sum(SIZES), sum(SIZES)) in seen
    assert {s[0] for s in seen if s[1] == "verified"} == {"registry.example.com:5000", "a", "b"}
    assert all(stage in delivery.STAGES for _, stage, _, _ in seen)


def test_nothing_is_pushed_or_pulled_when_every_node_has_the_image(tmp_path, fake_docker):
    out, seen = _ship(tmp_path, _held(("a", IMAGE_ID), ("b", IMAGE_ID)))
    assert _calls(fake_docker) == [] and seen == []
    assert {o.sent_bytes for o in out.values()} == {0}


def test_a_failed_push_names_the_registry_and_what_to_do_and_no_node_pulls(tmp_path, fake_docker):
    (fake_docker / "push_fails").write_text("unauthorized: authentication required")
    with pytest.raises(RuntimeFailure) as e:
        _ship(tmp_path, _held(("a", None), ("b", None)))
    assert "docker push" in str(e.value) and "authentication required" in str(e.value)
    assert "`docker login registry.example.com:5000` on this machine" in str(e.value)
    assert not [c for c in _calls(fake_docker) if c[0] == "pull"]


def test_a_registry_with_another_config_under_the_digest_is_refused_before_any_pull(tmp_path, fake_docker):
    """A registry holding another config under the digest is refused before any pull."""
    other = _manifest()
    other["config"]["digest"] = "sha256:" + "e" * 64
    (fake_docker / "manifest.json").write_text(json.dumps(other))
    with pytest.raises(RuntimeFailure, match="not the image built here"):
        _ship(tmp_path, _held(("a", None)), nodes=("a",))
    assert not [c for c in _calls(fake_docker) if c[0] == "pull"]


def test_a_failed_pull_names_the_node_with_the_registry_s_message_and_a_hint(tmp_path, fake_docker):
    (fake_docker / "pull_fails").write_text('Error response from daemon: Get "https://registry.example.com:5000/v2/": '
                                            "dial tcp 198.18.0.2:5000: connect: no route to host")
    with pytest.raises(RemoteFailure) as e:
        _ship(tmp_path, _held(("a", None)), nodes=("a",))
    (line,) = e.value.lines()
    assert line.startswith("a: image pull from registry.example.com:5000: ")
    assert "no route to host" in line and "the node cannot reach registry.example.com:5000" in line


def test_a_containerd_store_node_naming_the_image_by_the_pushed_digest_is_verified(tmp_path, fake_docker):
    (fake_docker / "pulled_id").write_text(DIGEST)  # that store's image ID is the manifest's digest
    out, seen = _ship(tmp_path, _held(("a", None)), nodes=("a",))
    assert out["a"].sent_bytes == sum(SIZES) and ("a", "verified", sum(SIZES), sum(SIZES)) in seen


def test_an_image_built_on_containerd_is_verified_on_a_classic_node_by_its_config(tmp_path, fake_docker):
    """An image built on the containerd store is verified on a classic node by its config."""
    inv = _inv(tmp_path, nodes=("a",))
    with Remote(inv) as remote:  # that store's image ID here is the manifest's digest, the one pushed
        out = Registry(inv).ship(remote, DIGEST, _held(("a", None)))
    assert out["a"].sent_bytes == sum(SIZES)


def test_a_pushed_index_gives_the_layer_sizes_of_this_machine_s_platform(tmp_path, fake_docker):
    index = "sha256:" + "9" * 64
    child = "sha256:" + "8" * 64
    (fake_docker / "push_output").write_text(PUSH_OUTPUT.replace(DIGEST, index))
    (fake_docker / "index_digest").write_text(index)
    (fake_docker / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"digest": "sha256:" + "7" * 64, "platform": {"os": "linux", "architecture": "arm64"}},
        {"digest": child, "platform": {"os": "linux", "architecture": "amd64"}}]}))
    out, _ = _ship(tmp_path, _held(("a", None)), nodes=("a",))
    assert out["a"].sent_bytes == sum(SIZES)
    assert [c for c in _calls(fake_docker) if c[:2] == ["manifest", "inspect"]] == [
        ["manifest", "inspect", f"{REPO}@{index}"], ["manifest", "inspect", f"{REPO}@{child}"]]
    assert [c for c in _calls(fake_docker) if c[0] == "pull"] == [["pull", f"{REPO}@{index}"]]


def test_a_pull_that_leaves_another_image_under_the_name_is_refused(tmp_path, fake_docker):
    (fake_docker / "pulled_id").write_text("sha256:" + "f" * 64)
    with pytest.raises(RemoteFailure) as e:
        _ship(tmp_path, _held(("a", None)), nodes=("a",))
    assert "is sha256:ffff" in str(e.value) and IMAGE_ID in str(e.value) and DIGEST in str(e.value)


def test_a_containerd_node_on_the_pushed_digest_is_up_to_date_and_launch_uses_it(tmp_path, fake_docker):
    """A containerd node on the pushed digest is up to date the next time, and launch reads it as the
    image."""
    (fake_docker / "pulled_id").write_text(DIGEST)  # that store names the pulled image by the pushed digest
    _ship(tmp_path, _held(("a", None)), nodes=("a",))
    surveyed = NodeImages("a", DIGEST, store=image.CONTAINERD)  # what the next survey or launch reads there
    assert image.comparable_id(surveyed) == IMAGE_ID  # launch compares it with classic nodes by the config
    calls = len(_calls(fake_docker))
    out, _ = _ship(tmp_path, {"a": surveyed}, nodes=("a",))
    assert out["a"].sent_bytes == 0 and len(_calls(fake_docker)) == calls  # nothing pushed or pulled again
