"""Image shipping against a fake `docker` on PATH (no engine needed): ship only where the ID
differs, `docker save` once per image into the cache and fan that file out, leave out the
layers a node already holds, count the bytes, verify the ID after loading, never fall back."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

from deploy import image
from deploy.errors import RemoteFailure
from deploy.inventory import loads
from deploy.remote import Remote
from fakes import install_command
from test_deploy_ship_layers import docker_save_tar

FAKE_DOCKER = r"""#!PYTHON
import gzip, json, os, sys
d = os.environ["FAKE_DOCKER_DIR"]
a = sys.argv[1:]
def read(name, default=None):
    p = os.path.join(d, name)
    return open(p).read() if os.path.exists(p) else default
if a[:1] == ["save"] and read("save_stalls"):  # half the image, then nothing: a slow save of a big one
    open(os.path.join(d, "save.pid"), "w").write(str(os.getpid()))
    data = open(os.path.join(d, "saved.tar"), "rb").read()
    sys.stdout.buffer.write(data[:len(data) // 2]); sys.stdout.flush()
    import time; time.sleep(120)
elif a[:1] == ["save"]:
    open(os.path.join(d, "saves.log"), "a").write(a[1] + "\n")
    sys.stdout.buffer.write(open(os.path.join(d, "saved.tar"), "rb").read())
elif a[:2] == ["image", "ls"]:
    print("\n".join(f"sha256:held{i}" for i, _ in enumerate(json.loads(read("node_held.json", "[]")))))
elif a[:2] == ["image", "inspect"] and a[3].startswith("LAYERS"):
    for layers in json.loads(read("node_held.json", "[]")):
        print("LAYERS " + json.dumps(layers))
elif a[:2] == ["image", "inspect"] and "RootFS" in a[3]:
    print(read("local_layers.json"))
elif a[:2] == ["image", "inspect"]:
    if read("node_id"):
        print(read("node_id").strip())
    else:
        sys.exit("No such image: " + a[-1])
elif a[:1] == ["load"]:
    data = sys.stdin.buffer.read()
    open(os.path.join(d, "loaded_bytes"), "a").write(f"{len(data)}\n")
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    open(os.path.join(d, "loaded.tar"), "wb").write(data)
    import io, tarfile  # as docker load: a cut stream (a tar that does not read to its end) loads nothing
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            names = [m.name for m in tf if not m.isreg() or tf.extractfile(m).read() is not None]
    except (tarfile.TarError, EOFError) as e:
        sys.exit(f"unexpected EOF: {e}")
    if "manifest.json" not in names:
        sys.exit("unexpected EOF: no manifest.json")
    if read("load_fails"):
        sys.exit(read("load_fails"))
    open(os.path.join(d, "node_id"), "w").write(read("load_gives"))
    print("Loaded image: x")
else:
    sys.exit(f"fake docker: unexpected {a}")
""".replace("PYTHON", sys.executable)

NAME = "ddp-trainer:test"


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    install_command(tmp_path, monkeypatch, "docker", FAKE_DOCKER)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("FAKE_DOCKER_DIR", str(state))
    monkeypatch.setenv(image.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(image.WHOLE_ENV, raising=False)
    return state


def _image(state: Path, layers: list[bytes], tag: str = NAME) -> tuple[str, list[str]]:
    """The operator's image: `docker save` gives this tar; returns (image ID, diff IDs)."""
    data, image_id, diff_ids = docker_save_tar(layers, tag)
    (state / "saved.tar").write_bytes(data)
    (state / "local_layers.json").write_text(json.dumps(diff_ids))
    (state / "load_gives").write_text(image_id)
    return image_id, diff_ids


def _inv(compress=False, nodes=1):
    return loads(json.dumps({
        "job": {"name": "img", "runtime": "docker"},
        "rendezvous": {"node": "n1"},
        "nodes": [{"name": f"n{i}", "address": f"127.0.0.{i}", "connection": "local"} for i in range(1, nodes + 1)],
        "image": {"name": NAME, "compress": compress},
        "storage": {"data": {"host": "/nas/data", "container": "/data"},
                    "checkpoints": {"host": "/nas/ckpt", "container": "/ckpt"}},
    }))


def _members(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return tf.getnames()


BASE, DEPS, CODE = b"base" * 50_000, b"deps" * 100_000, b"code v1" * 1000


def test_ships_the_saved_image_to_a_node_without_it_and_verifies_its_id(fake_docker):
    image_id, _ = _image(fake_docker, [BASE, DEPS, CODE])
    progress, planned = [], {}
    with Remote(_inv()) as remote:
        out = image.ship(_inv(), remote, image_id, lambda node, n: progress.append((node, n)),
                         on_plan=lambda node, total: planned.update({node: total}))
    saved = (fake_docker / "saved.tar").read_bytes()
    assert (fake_docker / "loaded.tar").read_bytes() == saved
    assert out["n1"].sent_bytes == len(saved) == sum(n for _, n in progress)
    assert image.cache_path(image_id, NAME).read_bytes() == saved  # kept for the next deploy
    assert list(image.cache_dir().glob("*.tmp")) == []


def test_a_node_with_the_same_id_is_up_to_date_and_nothing_is_saved(fake_docker):
    image_id, _ = _image(fake_docker, [BASE, CODE])
    (fake_docker / "node_id").write_text(image_id)
    with Remote(_inv()) as remote:
        out = image.ship(_inv(), remote, image_id)
    assert out["n1"].sent_bytes == 0
    assert not (fake_docker / "loaded_bytes").exists() and not (fake_docker / "saves.log").exists()


def test_docker_save_runs_once_for_three_nodes_and_once_per_image(fake_docker):
    image_id, _ = _image(fake_docker, [BASE, DEPS, CODE])
    inv = _inv(nodes=3)
    with Remote(inv) as remote:
        out = image.ship(inv, remote, image_id)
    saved_size = len((fake_docker / "saved.tar").read_bytes())
    assert [o.sent_bytes for o in out.values()] == [saved_size] * 3
    assert (fake_docker / "loaded_bytes").read_text().split() == [str(saved_size)] * 3
    (fake_docker / "node_id").unlink()
    with Remote(inv) as remote:  # the nodes lost it: the cached file is sent again, not saved again
        image.ship(inv, remote, image_id)
    assert (fake_docker / "saves.log").read_text().splitlines() == [NAME]


def test_a_node_holding_the_previous_image_gets_the_tar_without_the_layers_it_has(fake_docker):
    _, old_diff_ids = docker_save_tar([BASE, DEPS, CODE], NAME)[1:]
    image_id, diff_ids = _image(fake_docker, [BASE, DEPS, b"code v2" * 1000])
    assert diff_ids[:2] == old_diff_ids[:2] and diff_ids[2] != old_diff_ids[2]
    (fake_docker / "node_id").write_text("sha256:previous")
    (fake_docker / "node_held.json").write_text(json.dumps([old_diff_ids, ["sha256:unrelated"]]))
    with Remote(_inv()) as remote:
        out = image.ship(_inv(), remote, image_id)
    loaded = (fake_docker / "loaded.tar").read_bytes()
    saved = (fake_docker / "saved.tar").read_bytes()
    full, partial = _members(saved), _members(loaded)
    assert sorted(set(full) - set(partial)) == sorted(f"layer{i}/layer.tar" for i in (0, 1))
    assert "layer2/layer.tar" in partial and "manifest.json" in partial
    assert out["n1"].sent_bytes == len(loaded) < len(saved) - len(BASE) - len(DEPS) + 4096
    assert (out["n1"].layers_held, out["n1"].layers) == (2, 3)


def test_a_refused_layered_tar_is_an_error_that_names_the_way_out(fake_docker):
    image_id, diff_ids = _image(fake_docker, [BASE, CODE])
    (fake_docker / "node_held.json").write_text(json.dumps([diff_ids[:1]]))
    (fake_docker / "load_fails").write_text("open /var/lib/docker/tmp/x/layer.tar: no such file or directory")
    with Remote(_inv()) as remote, pytest.raises(RemoteFailure) as e:
        image.ship(_inv(), remote, image_id)
    (line,) = e.value.lines()
    assert line.startswith("n1: image shipping: exit 1: docker load refused the image without the 1 layers")
    assert image.WHOLE_ENV in line


def test_a_node_that_ends_up_with_another_id_is_an_error(fake_docker):
    image_id, _ = _image(fake_docker, [BASE])
    (fake_docker / "node_id").write_text("sha256:old")
    (fake_docker / "load_gives").write_text("sha256:other")
    with Remote(_inv()) as remote, pytest.raises(RemoteFailure) as e:
        image.ship(_inv(), remote, image_id)
    (line,) = e.value.lines()
    assert line.startswith("n1: image shipping: exit 1: after loading, the node has sha256:other")


def test_an_image_that_changed_while_it_was_saved_is_an_error_and_is_not_cached(fake_docker):
    _image(fake_docker, [BASE])
    with Remote(_inv()) as remote, pytest.raises(RemoteFailure) as e:
        image.ship(_inv(), remote, "sha256:" + "0" * 64)
    assert "changed while it was saved" in e.value.lines()[0]
    assert list(image.cache_dir().iterdir()) == []


def test_compress_sends_gzip_of_the_saved_tar(fake_docker):
    image_id, _ = _image(fake_docker, [bytes(3_000_000)])
    with Remote(_inv(compress=True)) as remote:
        out = image.ship(_inv(compress=True), remote, image_id)
    assert 0 < out["n1"].sent_bytes < 100_000  # zeros compress well
    assert (fake_docker / "loaded.tar").read_bytes() == (fake_docker / "saved.tar").read_bytes()


def test_the_cache_keeps_the_latest_images_and_drops_stale_temporary_files(tmp_path, monkeypatch):
    monkeypatch.setenv(image.CACHE_ENV, str(tmp_path))
    old = time.time() - 2 * image.STALE_TEMP_SECONDS
    for i, name in enumerate(["a.x.tar", "b.x.tar", "c.x.tar", "c.x.tar.1-ab.tmp", "d.x.tar.2-cd.tmp"]):
        (tmp_path / name).write_text(name)
        os.utime(tmp_path / name, (old + i, old + i))
    os.utime(tmp_path / "d.x.tar.2-cd.tmp")  # being written now
    image.clean_cache(tmp_path / "a.x.tar")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.x.tar", "c.x.tar", "d.x.tar.2-cd.tmp"]


def test_build_argv_passes_build_args_and_paths_relative_to_hosts_yaml():
    inv = loads(json.dumps({
        "job": {"name": "img"}, "rendezvous": {"node": "n"},
        "nodes": [{"name": "n", "address": "198.18.0.11"}],
        "image": {"name": "t:1", "build_args": {"BASE_IMAGE": "local/cpu-base:1"}},
        "storage": {"data": {"host": "/d", "container": "/data"}, "checkpoints": {"host": "/c", "container": "/ckpt"}},
    }), base_dir=Path("/repo"))
    assert image.build_argv(inv) == ["docker", "build", "-t", "t:1", "-f", "/repo/Dockerfile",
                                     "--build-arg", "BASE_IMAGE=local/cpu-base:1", "/repo"]


def test_the_directories_and_the_survey_share_one_command_and_a_failed_mkdir_names_itself(fake_docker):
    with Remote(_inv()) as remote, pytest.raises(RemoteFailure) as e:
        image.survey(_inv(), remote, ["sh", "-c", "echo '/nas is not writable by op' >&2; exit 1"],
                     what="creating the storage directories", hint="be root")
    assert e.value.lines() == ["n1: creating the storage directories: exit 1: /nas is not writable by op (be root)"]
    (fake_docker / "node_id").write_text("sha256:abc")
    (fake_docker / "node_held.json").write_text(json.dumps([["sha256:l1", "sha256:l2"]]))
    with Remote(_inv()) as remote:
        held = image.survey(_inv(), remote, ["true"])
    assert held["n1"] == image.NodeImages("n1", "sha256:abc", (("sha256:l1", "sha256:l2"),))


def test_one_ctrl_c_during_shipping_ends_docker_save_and_counts_no_half_loaded_image(fake_docker, tmp_path):
    import signal
    import threading

    image_id, _ = _image(fake_docker, [BASE, DEPS, CODE])
    (fake_docker / "save_stalls").write_text("1")
    pressed = []

    def ctrl_c_once_the_save_stalls():
        while not (fake_docker / "save.pid").exists():
            time.sleep(0.05)
        time.sleep(0.5)  # the node reads what the save wrote so far
        pressed.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_once_the_save_stalls, daemon=True).start()
    with Remote(_inv()) as remote, pytest.raises(KeyboardInterrupt):
        image.ship(_inv(), remote, image_id)
    assert pressed and time.monotonic() - pressed[0] < 10  # not the 120 s the stalled save would take
    save = int((fake_docker / "save.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(save) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(save), "docker save still runs after Ctrl-C"
    assert list((tmp_path / "cache").iterdir()) == []  # no partial file that a later deploy could take for the image
    assert not (fake_docker / "node_id").exists()  # the node's load never completed: nothing counts as loaded


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False
