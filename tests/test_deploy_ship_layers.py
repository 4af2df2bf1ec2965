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

from deploy.images import image, oci


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
def test_the_rewritten_tar_drops_held_layers_and_keeps_every_other_member_intact(tmp_path, fmt):
    """The rewritten tar drops the held layer files, and keeps every other member intact."""
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


# ------------------------------------------------------------------ the tar both stores load (oci.py)


def _saved(tmp_path: Path, contents: list[bytes], tag: str = "t:1") -> image.SavedImage:
    data, _, _ = docker_save_tar(contents, tag)
    (tmp_path / "saved.tar").write_bytes(data)
    return image.index_saved(tmp_path / "saved.tar")


def test_the_layout_carries_docker_manifest_and_an_oci_index_over_the_same_blobs(tmp_path):
    saved = _saved(tmp_path, [b"base" * 3000, b"deps" * 5000, b"code"])
    full = _members(b"".join(oci.layout(saved).chunks()))
    blobs = {f"blobs/sha256/{d[7:]}" for d in saved.diff_ids}
    ident = oci.identity(saved)
    assert set(full) == blobs | {f"blobs/sha256/{ident.config[7:]}", f"blobs/sha256/{ident.manifest[7:]}",
                                 "index.json", "manifest.json", "oci-layout"}
    originals = _members((tmp_path / "saved.tar").read_bytes())
    assert all(full[f"blobs/sha256/{d[7:]}"] == originals[f] for d, f in zip(saved.diff_ids, saved.layer_files))
    docker_manifest = json.loads(full["manifest.json"])[0]
    assert docker_manifest["RepoTags"] == ["t:1"]
    assert [full[p] for p in docker_manifest["Layers"]] == [originals[f] for f in saved.layer_files]
    index = json.loads(full["index.json"])["manifests"][0]
    assert index["digest"] == ident.manifest
    assert index["annotations"] == {"io.containerd.image.name": "docker.io/library/t:1",
                                    "org.opencontainers.image.ref.name": "1"}
    manifest = json.loads(full[f"blobs/sha256/{ident.manifest[7:]}"])
    assert manifest["config"]["digest"] == ident.config == saved.image_id
    assert [layer["digest"] for layer in manifest["layers"]] == list(saved.diff_ids)


def test_the_layout_without_held_layers_leaves_out_only_their_blobs(tmp_path):
    saved = _saved(tmp_path, [b"base" * 3000, b"deps" * 5000, b"code"])
    tar = oci.layout(saved, 2, "registry.example:5000/team/ddp:7")
    data = b"".join(tar.chunks())
    assert len(data) == tar.size and len(data) % 512 == 0
    kept = _members(data)
    assert {n for n in kept if n.startswith("blobs/sha256/")} & {f"blobs/sha256/{d[7:]}" for d in saved.diff_ids} == \
        {f"blobs/sha256/{saved.diff_ids[2][7:]}"}
    assert json.loads(kept["index.json"])["manifests"][0]["annotations"]["io.containerd.image.name"] == \
        "registry.example:5000/team/ddp:7"
    assert json.loads(kept["manifest.json"])[0]["RepoTags"] == ["registry.example:5000/team/ddp:7", "t:1"]


@pytest.mark.parametrize("offset", [0, 1, 511, 512, 4000, 10_000])
def test_the_layout_read_from_any_offset_is_the_rest_of_the_same_bytes(tmp_path, offset):
    saved = _saved(tmp_path, [b"base" * 3000, b"deps" * 5000, b"code"])
    tar = oci.layout(saved, 1)
    whole = b"".join(tar.chunks(1000))
    pieces = list(tar.pieces(offset, 777))
    assert b"".join(d for _, d in pieces) == whole[offset:]
    assert [at for at, _ in pieces] == list(_running(offset, [len(d) for _, d in pieces]))


def _running(start: int, sizes: list[int]):
    for n in sizes:
        yield start
        start += n


def test_the_manifest_digest_is_the_one_the_containerd_store_made_of_dockers_own_tar():
    """Docker 26.1.5 with containerd 1.7.24 loaded a `docker save` of Docker 20.10 (config 1716
    bytes, three uncompressed layers) and named it by this manifest digest."""
    diff_ids = ("sha256:56b04acdc05ed1c2ea571fd65ed068a0b49d3e5faea40587d1ba95b62eeac7cf",
                "sha256:244a78085518b781de521279f12cb669041c9e80f63139035cbb3c9e12e1047c",
                "sha256:08ffd593a56f9538c517109d532fdb623e1b4b03792426a5d612e5263b5604e2")
    layer_files = tuple(f"{d}/layer.tar" for d in ("525f", "e427", "089b"))
    config = "677c513b1962412a9c7b743ae2244d5c445519c8a8ac0a38f433337e4bba80d0.json"
    files = ((config, 0, 1716),) + tuple((f, 0, n) for f, n in zip(layer_files, (2007040, 1001984, 2048)))
    saved = image.SavedImage(Path("x.tar"), 0, (), "sha256:" + config[:-5], layer_files, diff_ids, files, config)
    assert oci.identity(saved) == oci.Identity(
        "sha256:677c513b1962412a9c7b743ae2244d5c445519c8a8ac0a38f433337e4bba80d0",
        "sha256:6123027b33ff18e0ffe47a9bfb7777f8c20c63b746bae727199aaddb470a0ddb")


@pytest.mark.parametrize("name, full", [
    ("ddp-trainer:test", "docker.io/library/ddp-trainer:test"),
    ("ddp-trainer", "docker.io/library/ddp-trainer:latest"),
    ("team/ddp:1", "docker.io/team/ddp:1"),
    ("localhost:5000/ddp:1", "localhost:5000/ddp:1"),
    ("localhost/ddp", "localhost/ddp:latest"),
    ("nvcr.io/nvidia/pytorch:24.01-py3", "nvcr.io/nvidia/pytorch:24.01-py3"),
])
def test_names_are_normalised_as_docker_does(name, full):
    assert oci.full_name(name) == full
