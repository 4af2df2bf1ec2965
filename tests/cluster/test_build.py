"""The image's build on the operator's real Docker daemon, and its platform against the nodes'.

`deploy` builds with the nodes' platform (read from each node's own daemon), shows the build's
steps as it runs, and on a failed build names the failing step with its own output, for the
classic builder (what the docker CLI here uses without buildx) and BuildKit (docker 20.10's own,
`DOCKER_BUILDKIT=1`); nothing is shipped then. An image whose platform is not the nodes' (made
here without qemu: a tiny image whose config says arm64) is refused before anything is shipped.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from .operator_cli import REPO, _operator_env, image_id_on, ok

pytestmark = pytest.mark.cluster

WIDGET = 'echo "compiling widget"; for i in 1 2 3; do echo "line $i"; done; echo "fatal: widget.c missing" >&2; exit 3'


def operator_docker(cluster, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", cluster.operator_docker_host, *args], capture_output=True, timeout=120, **kw)


def ddp(cluster, hosts: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI as the operator runs it, with the build log and the image cache in the test's directory."""
    full = {**_operator_env(cluster, hosts), "DDP_DEPLOY_BUILD_LOG": str(hosts.parent / "build.log"),
            "DDP_DEPLOY_IMAGE_CACHE": str(hosts.parent / "cache"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "deploy", "--hosts", str(hosts), *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=300)


def hosts_for(cluster, tmp_path: Path, name: str, dockerfile: str, files: dict[str, str] | None = None) -> Path:
    context = tmp_path / "ctx"
    context.mkdir(exist_ok=True)
    (context / "Dockerfile").write_text(dockerfile)
    for file, text in (files or {}).items():
        (context / file).write_text(text)
    return cluster.write_hosts_yaml(tmp_path / "hosts.yaml", image={
        "name": name, "dockerfile": str(context / "Dockerfile"), "context": str(context),
        "build_args": {"BASE_IMAGE": cluster.base_image}, "transfer": "star"})


@pytest.fixture
def images(cluster):
    """Names of test images, removed afterwards from the operator and every node."""
    names: list[str] = []
    yield names
    for name in names:
        operator_docker(cluster, "image", "rm", "-f", name)
        for h in cluster.hosts:
            cluster.run_on(h.name, ["docker", "image", "rm", "-f", name])


def test_the_classic_build_targets_the_nodes_platform_and_shows_failed_step_output(cluster, tmp_path, images):
    """The classic build runs for the nodes' platform, and a failed step is shown with its output."""
    name = "ddp-build-test:classic"
    images.append(name)
    classic = {"DOCKER_BUILDKIT": "0"}
    hosts = hosts_for(cluster, tmp_path, name, "FROM scratch\nCOPY a.txt /a\n", {"a.txt": "a"})

    built = ok(ddp(cluster, hosts, "deploy", env=classic))
    assert "build [1/2] FROM scratch" in built.stderr and "build [2/2] COPY a.txt /a" in built.stderr
    assert "built in " in built.stderr and " by the classic builder: 2 steps, " in built.stderr
    assert (tmp_path / "build.log").read_text().startswith("$ docker build --platform linux/amd64 ")
    assert "(linux/amd64, the nodes' platform)" in built.stdout
    image_id = operator_docker(cluster, "image", "inspect", "--format", "{{.Id}}", name, text=True).stdout.strip()
    assert all(image_id_on(cluster, h.name, name) == image_id for h in cluster.hosts)

    hosts_for(cluster, tmp_path, name, f"ARG BASE_IMAGE\nFROM ${{BASE_IMAGE}}\nRUN echo first-step-ok\nRUN {WIDGET}\n")
    failed = ddp(cluster, hosts, "deploy", env=classic)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    said = failed.stderr.splitlines()
    step = f"[4/4] RUN {WIDGET}"
    assert f"build {step}"[:60] in failed.stderr  # the steps as they started
    shown = [line[len("  | "):] for line in said if line.startswith("  | ")]
    assert sorted(shown) == sorted(["compiling widget", "line 1", "line 2", "line 3", "fatal: widget.c missing"])
    assert "first-step-ok" not in shown  # the failing step's output only
    [error] = [line for line in said if line.startswith("error: ")]
    assert error.startswith("error: docker build failed at [4/4] RUN echo \"compiling widget\"")
    assert error.endswith(f": exit code 3 (its output is above; the whole build log: {tmp_path / 'build.log'})")
    assert "first-step-ok" in (tmp_path / "build.log").read_text()
    assert all(image_id_on(cluster, h.name, name) == image_id for h in cluster.hosts)  # nothing shipped


def test_a_failed_buildkit_step_is_named_with_the_builders_error(cluster, tmp_path, images):
    client = shutil.which("docker", path="/usr/bin")
    version = subprocess.run([client or "docker", "version", "--format", "{{.Client.Version}}"],
                             capture_output=True, text=True).stdout.strip()
    if not client or not version.startswith("20."):
        pytest.skip(f"no docker 20.10 client with its own BuildKit in /usr/bin (found {client}: {version!r})")
    name = "ddp-build-test:buildkit"
    images.append(name)
    hosts = hosts_for(cluster, tmp_path, name, "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nCOPY Dockerfile /b\n"
                                               "COPY missing.txt /m\n")
    failed = ddp(cluster, hosts, "deploy", env={"DOCKER_BUILDKIT": "1", "PATH": f"/usr/bin:{_operator_env(cluster, hosts)['PATH']}"})
    assert failed.returncode == 1, failed.stdout + failed.stderr
    [error] = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert error.startswith('error: docker build failed at [3/3] COPY missing.txt /m: failed to compute cache key: '
                            '"/missing.txt" not found'), error
    kept = (tmp_path / "build.log").read_text()
    assert "#1 [internal] load build definition from Dockerfile" in kept  # BuildKit's plain progress
    assert all(image_id_on(cluster, h.name, name) is None for h in cluster.hosts)


def arm64_image(cluster, name: str) -> str:
    """A tiny image whose config says linux/arm64, loaded into the operator's daemon (no qemu
    needed: nothing in it runs). Its ID."""
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tf:
        info = tarfile.TarInfo("hello")
        info.size = 5
        tf.addfile(info, io.BytesIO(b"hello"))
    operator_docker(cluster, "import", "-", name, input=payload.getvalue(), check=True)
    saved = operator_docker(cluster, "save", name, check=True).stdout
    members = {}
    with tarfile.open(fileobj=io.BytesIO(saved)) as tf:
        for m in tf:
            members[m.name] = (m, tf.extractfile(m).read() if m.isreg() else None)
    manifest = json.loads(members.pop("manifest.json")[1])
    config = json.loads(members.pop(manifest[0]["Config"])[1])
    config["architecture"] = "arm64"
    raw = json.dumps(config).encode()
    digest = hashlib.sha256(raw).hexdigest()
    manifest[0]["Config"] = f"{digest}.json"
    members.pop("repositories", None)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        for m, data in members.values():
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
        for member, data in ((f"{digest}.json", raw), ("manifest.json", json.dumps(manifest).encode())):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    operator_docker(cluster, "load", input=out.getvalue(), check=True)
    return f"sha256:{digest}"


def test_check_shows_the_nodes_platform_and_refuses_a_foreign_image_before_shipping(
        cluster, fresh_nas, tmp_path, images):
    """check shows the nodes' platform, and an image of another is refused before anything is shipped."""
    name = "ddp-build-test:arm64"
    images.append(name)
    image_id = arm64_image(cluster, name)
    said = operator_docker(cluster, "image", "inspect", "--format", "{{.Id}} {{.Os}}/{{.Architecture}}", name, text=True)
    assert said.stdout.split() == [image_id, "linux/arm64"]
    hosts = hosts_for(cluster, tmp_path, name, "FROM scratch\n")

    checked = ok(ddp(cluster, hosts, "check"))
    rows = [line.split() for line in checked.stdout.splitlines() if " platform " in line]
    assert sorted(row[1] for row in rows) == sorted(h.name for h in cluster.hosts)
    assert all("linux/amd64" in row for row in rows)

    refused = ddp(cluster, hosts, "deploy", "--no-build")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    [error] = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    nodes = ", ".join(h.name for h in cluster.hosts)
    assert error.startswith(f"error: image {name} is linux/arm64 but {nodes} are linux/amd64: nothing shipped "
                            "(drop --no-build: deploy builds it with --platform linux/amd64; "), error
    assert "qemu" in error and "binfmt" in error
    assert all(image_id_on(cluster, h.name, name) is None for h in cluster.hosts)
    assert not list((tmp_path / "cache").glob("*.tar*"))  # not even saved for shipping
