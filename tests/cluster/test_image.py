"""The real Dockerfile, built on the local CPU base in the operator's Docker daemon."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .netcluster import copy_build_context

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]


def docker(cluster, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", cluster.operator_docker_host, *args], capture_output=True, text=True,
                          timeout=timeout)


def build(cluster, context: Path, tag: str) -> subprocess.CompletedProcess:
    proc = docker(cluster, "build", "--progress", "plain", "--build-arg", f"BASE_IMAGE={cluster.base_image}",
                  "-t", tag, str(context), timeout=900)
    if proc.returncode != 0 and "unknown flag: --progress" in proc.stderr:  # the classic builder
        proc = docker(cluster, "build", "--build-arg", f"BASE_IMAGE={cluster.base_image}", "-t", tag, str(context),
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_standalone_docker_run_trains_on_this_machine_as_a_non_root_user(cluster, tmp_path):
    build(cluster, REPO, "ddp-trainer:standalone")
    user = docker(cluster, "image", "inspect", "--format", "{{.Config.User}}", "ddp-trainer:standalone")
    assert user.stdout.strip() == "1000:1000"
    vol = tmp_path / "vol"
    for sub in ("data", "ckpt"):
        (vol / sub).mkdir(parents=True)
        os.chown(vol / sub, 1000, 1000)
    # The README's one command. The test daemons run without a bridge network (--bridge=none),
    # so the container takes the host's network, where its hostname resolves.
    run = docker(cluster, "run", "--rm", "--network", "host", "-e", "NPROC_PER_NODE=2",
                 "-v", f"{vol / 'data'}:/data", "-v", f"{vol / 'ckpt'}:/ckpt", "ddp-trainer:standalone",
                 "--epochs", "1", "--synthetic-size", "512", "--batch-size", "32", timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    final = json.loads((vol / "ckpt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["kind"] == "final" and final["world_size"] == 2
    assert (vol / "ckpt" / "final_model.pt").stat().st_uid == 1000
    docker(cluster, "image", "rm", "-f", "ddp-trainer:standalone")


def test_a_code_only_change_reuses_the_dependency_layers(cluster, tmp_path):
    context = copy_build_context(tmp_path / "ctx")
    first = build(cluster, context, "ddp-trainer:layers")
    (context / "trainer" / "models.py").write_text((context / "trainer" / "models.py").read_text() + "\n# changed\n")
    second = build(cluster, context, "ddp-trainer:layers")
    assert cached(second, "pip install")  # the dependency layer is reused...
    assert not cached(second, "COPY trainer")  # ...and the changed code is not
    docker(cluster, "image", "rm", "-f", "ddp-trainer:layers")
    assert first.returncode == 0


def cached(build_output: subprocess.CompletedProcess, step: str) -> bool:
    """Whether the build step whose line contains ``step`` came from the cache (classic or BuildKit log)."""
    lines = (build_output.stdout + build_output.stderr).splitlines()
    at = next(i for i, line in enumerate(lines) if step in line)
    return any("Using cache" in line or "CACHED" in line for line in lines[at:at + 3])
