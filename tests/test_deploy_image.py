"""Image shipping logic against a fake `docker` on PATH (no engine needed): ship only where
the ID differs, count the bytes, verify the ID after loading, and never fall back."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from deploy import image
from deploy.errors import RemoteFailure
from deploy.inventory import loads
from deploy.remote import Remote

FAKE_DOCKER = r"""#!/bin/sh
d=$FAKE_DOCKER_DIR
case "$1 $2" in
  "image inspect") if [ -s "$d/id" ]; then cat "$d/id"; else echo "No such image: $5" >&2; exit 1; fi ;;
  "save "*) head -c 3000000 /dev/zero ;;
  "load ") wc -c > "$d/loaded_bytes"; cp "$d/load_gives" "$d/id"; echo "Loaded image: x" ;;
  *) echo "fake docker: unexpected $*" >&2; exit 99 ;;
esac
"""


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "docker"
    exe.write_text(FAKE_DOCKER)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.setenv("FAKE_DOCKER_DIR", str(state))
    return state


def _inv(compress=False):
    return loads(json.dumps({
        "job": {"name": "img", "runtime": "docker"},
        "rendezvous": {"node": "here"},
        "nodes": [{"name": "here", "address": "127.0.0.1", "connection": "local"}],
        "image": {"name": "ddp-trainer:test", "compress": compress},
        "storage": {"data": {"host": "/nas/data", "container": "/data"},
                    "checkpoints": {"host": "/nas/ckpt", "container": "/ckpt"}},
    }))


def test_ships_to_a_node_without_the_image_and_verifies_its_id(fake_docker):
    (fake_docker / "load_gives").write_text("sha256:new\n")
    progress = []
    with Remote(_inv()) as remote:
        out = image.ship(_inv(), remote, "sha256:new", lambda node, n: progress.append((node, n)))
    assert out["here"].sent_bytes == 3_000_000
    assert int((fake_docker / "loaded_bytes").read_text()) == 3_000_000
    assert sum(n for _, n in progress) == 3_000_000 and {node for node, _ in progress} == {"here"}


def test_a_node_with_the_same_id_is_up_to_date_and_gets_nothing(fake_docker):
    (fake_docker / "id").write_text("sha256:new\n")
    with Remote(_inv()) as remote:
        out = image.ship(_inv(), remote, "sha256:new")
    assert out["here"].sent_bytes == 0
    assert not (fake_docker / "loaded_bytes").exists()


def test_a_node_that_ends_up_with_another_id_is_an_error(fake_docker):
    (fake_docker / "id").write_text("sha256:old\n")
    (fake_docker / "load_gives").write_text("sha256:other\n")
    with Remote(_inv()) as remote, pytest.raises(RemoteFailure) as e:
        image.ship(_inv(), remote, "sha256:new")
    (line,) = e.value.lines()
    assert line.startswith("here: image shipping: exit 1: after loading, the node has sha256:other")


def test_compress_puts_gzip_in_the_pipe(fake_docker):
    (fake_docker / "load_gives").write_text("sha256:new\n")
    assert image.save_stages(_inv(compress=True))[-1] == ["gzip", "-1"]
    with Remote(_inv(compress=True)) as remote:
        out = image.ship(_inv(compress=True), remote, "sha256:new")
    assert 0 < out["here"].sent_bytes < 100_000  # zeros compress well


def test_build_argv_passes_build_args_and_paths_relative_to_hosts_yaml():
    inv = loads(json.dumps({
        "job": {"name": "img"}, "rendezvous": {"node": "n"},
        "nodes": [{"name": "n", "address": "198.18.0.11"}],
        "image": {"name": "t:1", "build_args": {"BASE_IMAGE": "local/cpu-base:1"}},
        "storage": {"data": {"host": "/d", "container": "/data"}, "checkpoints": {"host": "/c", "container": "/ckpt"}},
    }), base_dir=Path("/repo"))
    assert image.build_argv(inv) == ["docker", "build", "-t", "t:1", "-f", "/repo/Dockerfile",
                                     "--build-arg", "BASE_IMAGE=local/cpu-base:1", "/repo"]
