"""The saved image as a tar that both of Docker's image stores load, with or without layers.

``docker save`` (the operator's classic store) writes docker's own layout: ``manifest.json``
naming a config file and one tar per layer. The two stores load it differently:

- Docker's classic store reads ``manifest.json`` and skips a layer whose chain ID it already
  has, so a tar without the leading layers a node holds loads there (moby
  image/tarexport/load.go). The image ID is the config's digest.
- The containerd image store (``"features": {"containerd-snapshotter": true}``, the default of
  new Docker installs) refuses that tar ("failed to resolve layers: layer ... not found"): its
  importer wants every file ``manifest.json`` names. Given an OCI image layout (``index.json``,
  ``blobs/sha256/<digest>``) it takes the blobs that are there, and a manifest whose layers the
  content store already holds unpacks and runs. Its image ID is the manifest's digest.

:func:`layout` writes both in one tar (what ``docker save`` of Docker 25+ does too): every blob
once under ``blobs/sha256/``, an ``index.json`` and an ``oci-layout`` for the containerd store,
and a ``manifest.json`` pointing at the same blobs for the classic one. Leaving out the leading
layers works on both stores. The manifest is the one containerd's importer makes of docker's
own tar (docker media types, uncompressed layers), so the containerd store names the image by
the same digest however it got it: :func:`identity`.

:func:`index_saved` reads where each member of ``docker save``'s tar lies (without reading the
layers): the input of all the above.

The tar is a plan, not a file: headers and small JSON members as bytes, layer and config data
as byte ranges of the saved file, read when sent.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
LAYER_TYPE = "application/vnd.docker.image.rootfs.diff.tar"
"""An uncompressed layer: ``docker save`` of the classic store writes layers uncompressed."""
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
BLOCK = tarfile.BLOCKSIZE
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
READ = 1 << 20


@dataclass(frozen=True)
class Identity:
    """One image as each store names it; both digests bind the exact config and layers."""

    config: str
    """The config's digest: the image ID on Docker's classic store (and ``docker save``'s)."""
    manifest: str
    """The manifest's digest: the image ID on the containerd image store."""

    def on(self, store: str) -> str:
        """The ID a node of ``store`` (image.CLASSIC or image.CONTAINERD) shows for this image."""
        return self.manifest if store == "containerd" else self.config


# ------------------------------------------------------------------ a saved tar (docker save)


@dataclass(frozen=True)
class SavedImage:
    """Where each member of a ``docker save`` tar lies in the file, and which are layers."""

    path: Path
    size: int
    members: tuple[tuple[str, int, int], ...]
    """(name, first byte of its headers, end of its data blocks), in file order."""
    image_id: str
    """The config's digest, which is the image ID."""
    layer_files: tuple[str, ...]
    """The member holding each layer, in diff-ID order."""
    diff_ids: tuple[str, ...]
    files: tuple[tuple[str, int, int], ...] = ()
    """(name, first byte of its data, its size) of each regular file, in file order."""
    config_file: str = ""
    repo_tags: tuple[str, ...] = ()


def _norm(name: str) -> str:
    return name[2:] if name.startswith("./") else name


def index_saved(path: Path) -> SavedImage:
    """Read the headers of a ``docker save`` tar (one image) without reading the layers."""
    members, files, links = [], [], []
    with tarfile.open(path, "r:") as tf:
        for ti in tf:
            end = ti.offset_data + (-(-ti.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE if ti.isreg() else 0)
            members.append((_norm(ti.name), ti.offset, end))
            if ti.isreg():
                files.append((_norm(ti.name), ti.offset_data, ti.size))
            elif ti.issym():  # docker save writes a layer it already wrote (an identical one) as a link
                links.append((_norm(ti.name), posixpath.normpath(posixpath.join(posixpath.dirname(_norm(ti.name)),
                                                                                  ti.linkname))))
            elif ti.islnk():
                links.append((_norm(ti.name), _norm(ti.linkname)))
        data = {name: (offset, size) for name, offset, size in files}
        files += [(name, *data[target]) for name, target in links if target in data]
        manifest = json.load(tf.extractfile(tf.getmember(_member(tf, "manifest.json"))))
        if not isinstance(manifest, list) or len(manifest) != 1:
            raise ValueError(f"{path}: manifest.json describes {len(manifest)} images, expected 1")
        m = manifest[0]
        config_bytes = tf.extractfile(tf.getmember(_member(tf, m["Config"]))).read()
    config = json.loads(config_bytes)
    diff_ids = tuple(config["rootfs"]["diff_ids"])
    layer_files = tuple(_norm(p) for p in m["Layers"])
    if len(layer_files) != len(diff_ids):
        raise ValueError(f"{path}: {len(layer_files)} layer files for {len(diff_ids)} diff IDs")
    tags = m.get("RepoTags") or []
    return SavedImage(path, path.stat().st_size, tuple(members),
                      "sha256:" + hashlib.sha256(config_bytes).hexdigest(), layer_files, diff_ids,
                      tuple(files), _norm(m["Config"]), tuple(str(t) for t in tags if isinstance(t, str)))


def _member(tf: tarfile.TarFile, name: str) -> str:
    for candidate in (name, f"./{name}"):
        try:
            tf.getmember(candidate)
            return candidate
        except KeyError:
            pass
    raise ValueError(f"{tf.name}: no {name} in the saved image")


def _json(value) -> bytes:
    """JSON as Go's encoding/json writes it (no spaces, keys in struct order)."""
    return json.dumps(value, separators=(",", ":")).encode()


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def blob_digest(saved: SavedImage, i: int) -> str:
    """The digest of layer ``i``'s file: its name where the save names files by digest, else
    its diff ID (the classic store's ``docker save`` writes each layer uncompressed)."""
    name = saved.layer_files[i]
    if name.startswith("blobs/sha256/") and len(name) == len("blobs/sha256/") + 64:
        return "sha256:" + name.rsplit("/", 1)[1]
    return saved.diff_ids[i]


def manifest(saved: SavedImage) -> bytes:
    files = {name: size for name, _, size in saved.files}
    return _json({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": saved.image_id, "size": files[saved.config_file]},
        "layers": [{"mediaType": LAYER_TYPE, "digest": blob_digest(saved, i), "size": files[f]}
                   for i, f in enumerate(saved.layer_files)],
    })


def identity(saved: SavedImage) -> Identity:
    return Identity(saved.image_id, "sha256:" + hashlib.sha256(manifest(saved)).hexdigest())


def full_name(name: str) -> str:
    """Docker's normalised reference: ``ddp:1`` -> ``docker.io/library/ddp:1``."""
    path, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
    first = path.split("/", 1)[0]
    if "/" in path and ("." in first or ":" in first or first == "localhost"):
        return f"{path}:{tag}"
    return f"docker.io/{path if '/' in path else 'library/' + path}:{tag}"


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


def _small(name: str, data: bytes) -> bytes:
    return _header(name, len(data)) + data + b"\0" * (_padded(len(data)) - len(data))


@dataclass(frozen=True)
class Layout:
    """A tar as segments: bytes sent as they are, or ``(start, end)`` ranges of ``path``."""

    path: Path
    segments: tuple[bytes | tuple[int, int], ...]
    left_out: int = 0
    """Leading layers whose data the tar does not carry."""

    @property
    def size(self) -> int:
        return sum(len(s) if isinstance(s, bytes) else s[1] - s[0] for s in self.segments)

    def pieces(self, offset: int = 0, piece: int = READ) -> Iterator[tuple[int, bytes]]:
        """``(offset, bytes)`` from ``offset`` to the end, at most ``piece`` bytes each."""
        at = 0
        with open(self.path, "rb") as f:
            for seg in self.segments:
                length = len(seg) if isinstance(seg, bytes) else seg[1] - seg[0]
                if at + length <= offset:
                    at += length
                    continue
                skip = max(0, offset - at)
                if isinstance(seg, bytes):
                    for k in range(skip, length, piece):
                        yield at + k, seg[k:k + piece]
                else:
                    f.seek(seg[0] + skip)
                    pos = skip
                    while pos < length:
                        data = f.read(min(piece, length - pos))
                        if not data:
                            raise RuntimeError(f"{self.path} ended early: delete it and deploy again")
                        yield at + pos, data
                        pos += len(data)
                at += length

    def chunks(self, piece: int = READ) -> Iterator[bytes]:
        return (data for _, data in self.pieces(0, piece))


def layout(saved: SavedImage, skip: int = 0, name: str | None = None) -> Layout:
    """The saved image as a tar both stores load, without the data of its first ``skip`` layers
    (a layer file also needed further up stays). ``name``: what the image is called on the node
    (default: the name it was saved under)."""
    tags = list(saved.repo_tags) or ([name] if name else [])
    name = name or (tags[0] if tags else None)
    if name and name not in tags:
        tags.insert(0, name)
    files = {n: (offset, size) for n, offset, size in saved.files}
    digests = [blob_digest(saved, i) for i in range(len(saved.layer_files))]
    keep_from = {digests[i] for i in range(skip, len(digests))}
    segments: list[bytes | tuple[int, int]] = []
    sent: set[str] = set()
    for i, (f, d) in enumerate(zip(saved.layer_files, digests)):
        if d in sent or (i < skip and d not in keep_from):
            continue
        sent.add(d)
        offset, size = files[f]
        segments += [_header(f"blobs/sha256/{d.removeprefix('sha256:')}", size), (offset, offset + _padded(size))]
    offset, size = files[saved.config_file]
    config_blob = f"blobs/sha256/{saved.image_id.removeprefix('sha256:')}"
    segments += [_header(config_blob, size), (offset, offset + _padded(size))]
    body = manifest(saved)
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    annotations = {"io.containerd.image.name": full_name(name), "org.opencontainers.image.ref.name":
                   full_name(name).rsplit(":", 1)[1]} if name else {}
    index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": [
        {"mediaType": MANIFEST_TYPE, "digest": digest, "size": len(body), **({"annotations": annotations} if name else {})}]}
    docker_manifest = [{"Config": config_blob, "RepoTags": tags,
                        "Layers": [f"blobs/sha256/{d.removeprefix('sha256:')}" for d in digests]}]
    segments += [_small(f"blobs/sha256/{digest.removeprefix('sha256:')}", body),
                 _small("index.json", _json(index)),
                 _small("manifest.json", _json(docker_manifest)),
                 _small("oci-layout", _json({"imageLayoutVersion": "1.0.0"})),
                 END_OF_ARCHIVE]
    return Layout(saved.path, tuple(_merge(segments)), skip)


def _merge(segments: Sequence[bytes | tuple[int, int]]) -> list[bytes | tuple[int, int]]:
    out: list[bytes | tuple[int, int]] = []
    for s in segments:
        if out and isinstance(s, bytes) and isinstance(out[-1], bytes):
            out[-1] = out[-1] + s
        else:
            out.append(s)
    return out
