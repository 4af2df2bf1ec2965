"""The layer-aware tar rewriting on hand-built `docker save` tars: which layers a node needs,
which members are left out, and that every kept member arrives byte for byte.
(``docker_save_tar`` builds such a tar; test_deploy_image.py uses it too.)"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from deploy import image


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def layer_tar(content: bytes, path: str = "app/file") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, path, content)
    return buf.getvalue()


def docker_save_tar(contents: list[bytes], tag: str, layer_dirs: list[str] | None = None,
                    fmt: int = tarfile.USTAR_FORMAT) -> tuple[bytes, str, list[str]]:
    """(tar bytes, image ID, diff IDs). Members in lexical order, as `docker save` writes them."""
    layers = [layer_tar(c) for c in contents]
    diff_ids = ["sha256:" + hashlib.sha256(t).hexdigest() for t in layers]
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    image_hex = hashlib.sha256(config).hexdigest()
    dirs = layer_dirs or [f"layer{i}" for i in range(len(layers))]
    files = {f"{image_hex}.json": config,
             "manifest.json": json.dumps([{"Config": f"{image_hex}.json", "RepoTags": [tag],
                                           "Layers": [f"{d}/layer.tar" for d in dirs]}]).encode(),
             "repositories": b"{}"}
    for d, t in zip(dirs, layers):
        files[f"{d}/VERSION"] = b"1.0"
        files[f"{d}/json"] = b"{}"
        files[f"{d}/layer.tar"] = t
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name in sorted(files):
            _add(tf, name, files[name])
    return buf.getvalue(), "sha256:" + image_hex, diff_ids


def _members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf if m.isreg()}


def test_held_prefix_is_the_longest_run_of_leading_layers_on_any_image():
    ours = ["sha256:a", "sha256:b", "sha256:c"]
    assert image.held_prefix(ours, [["sha256:a", "sha256:x"], ["sha256:a", "sha256:b", "sha256:z", "sha256:c"]]) == 2
    assert image.held_prefix(ours, [["sha256:b", "sha256:c"]]) == 0  # same layers on another base: other chain IDs
    assert image.held_prefix(ours, [ours + ["sha256:d"]]) == 3
    assert image.held_prefix(ours, []) == 0


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_rewritten_tar_drops_the_held_layer_files_and_keeps_every_other_member_intact(tmp_path, fmt):
    long_dirs = [f"{i}{'f' * 120}" for i in range(3)]  # names past 100 characters need extended headers
    data, image_id, diff_ids = docker_save_tar([b"base" * 3000, b"deps" * 5000, b"code"], "t:1", long_dirs, fmt)
    path = Path(tmp_path / "saved.tar")
    path.write_bytes(data)
    saved = image.index_saved(path)
    assert saved.image_id == image_id and saved.diff_ids == tuple(diff_ids)

    drop = image.dropped_files(saved, 2)
    assert drop == {f"{d}/layer.tar" for d in long_dirs[:2]}
    out = b"".join(image.without_layers(saved, drop))
    assert len(out) == image.stream_size(saved, drop) and len(out) % 512 == 0
    full, kept = _members(data), _members(out)
    assert set(kept) == set(full) - drop
    assert all(kept[name] == full[name] for name in kept)
    assert json.loads(kept["manifest.json"])[0]["Layers"][2] == f"{long_dirs[2]}/layer.tar"


def test_nothing_held_sends_the_saved_file_unchanged(tmp_path):
    data, _, _ = docker_save_tar([b"x" * 1000, b"y"], "t:1")
    (tmp_path / "saved.tar").write_bytes(data)
    saved = image.index_saved(tmp_path / "saved.tar")
    assert image.dropped_files(saved, 0) == frozenset()
    assert b"".join(image.without_layers(saved, frozenset())) == data


def test_a_layer_file_still_needed_higher_up_is_not_dropped(tmp_path):
    """OCI-style saves name layer files by digest: the same file can serve two positions."""
    blob = "blobs/sha256/" + "e" * 64
    saved = image.SavedImage(tmp_path / "x.tar", 0, (), "sha256:x", (f"blobs/sha256/{'a' * 64}", blob, "b/layer.tar", blob),
                             ("sha256:a", "sha256:e", "sha256:b", "sha256:e"))
    assert image.dropped_files(saved, 2) == {f"blobs/sha256/{'a' * 64}"}


def test_a_tar_whose_manifest_lists_two_images_is_refused(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        body = json.dumps([{"Config": "a.json", "Layers": []}, {"Config": "b.json", "Layers": []}]).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(body)
        tf.addfile(info, io.BytesIO(body))
    (tmp_path / "two.tar").write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="describes 2 images"):
        image.index_saved(tmp_path / "two.tar")
