"""The training image: build it here, compare IDs, ship it where it differs.

Shipping makes the ``docker save`` stream once per image, into a cache file named after the
image ID (:func:`cache_path`; written to a temporary name and renamed when complete, reused
while present). Every node that lacks the image reads that file in parallel, straight into
``docker load`` (nodes that need every layer follow the file while ``docker save`` is still
writing it), gzipped on the way when ``image.compress`` is set.

A node that already holds the first layers of the image (the previous version of the image,
after a code-only change) gets a ``docker save`` tar without those layers' files: the
classic image store skips reading a layer whose chain ID it has (moby
image/tarexport/load.go), and chain IDs depend only on the diff IDs before them, so the
longest run of leading diff IDs found among the node's images is safe to leave out.

The image ID is verified after loading; a node that cannot get the exact image is an error,
never a fallback.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import tarfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import RemoteFailure, RuntimeFailure
from .inventory import Inventory
from .remote import Remote, Result, run_here

CACHE_ENV = "DDP_DEPLOY_IMAGE_CACHE"
"""Directory for the saved image files (default ~/.cache/ddp-deploy/images)."""
WHOLE_ENV = "DDP_DEPLOY_WHOLE_IMAGE"
"""Set to 1 to send every layer, even those a node already holds."""
KEEP_CACHED = 2
"""Saved images kept in the cache: the one just shipped and the most recently used other one."""
STALE_TEMP_SECONDS = 3600
CHUNK = 1 << 20


def build_argv(inv: Inventory) -> list[str]:
    argv = ["docker", "build", "-t", inv.image.name, "-f", str(inv.dockerfile_path())]
    for k, v in inv.image.build_args.items():
        argv += ["--build-arg", f"{k}={v}"]
    return argv + [str(inv.context_path())]


def inspect_argv(name: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", "{{.Id}}", name]


def layers_argv(name: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", name]


def save_argv(inv: Inventory) -> list[str]:
    """Run once per image; its stdout becomes the cache file."""
    return ["docker", "save", inv.image.name]


# $1 = image name, then optionally a command run first (the storage directories). Prints
# PREPARED once that command succeeded, "ID <image ID of $1, or ->", then one
# "LAYERS <json list of diff IDs>" line per image the node holds.
SURVEY = r"""name=$1; shift
if [ $# -gt 0 ]; then "$@" || exit $?; fi
echo PREPARED
id=$(docker image inspect --format '{{.Id}}' "$name" 2>/dev/null) || id=-
echo "ID $id"
ids=$(docker image ls -q --no-trunc) || exit $?
[ -z "$ids" ] || docker image inspect --format 'LAYERS {{json .RootFS.Layers}}' $ids 2>/dev/null || true
"""

# $1 = image name. Loads the tar on stdin, then prints "ID <the image ID $1 now names>".
LOAD = r"""docker load || exit $?
id=$(docker image inspect --format '{{.Id}}' "$1") || exit $?
echo "ID $id"
"""


def survey_argv(inv: Inventory, before: Sequence[str] = ()) -> tuple[str, ...]:
    return ("sh", "-c", SURVEY, "sh", inv.image.name, *before)


def load_argv(inv: Inventory) -> tuple[str, ...]:
    return ("sh", "-c", LOAD, "sh", inv.image.name)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ddp-deploy" / "images")


def cache_path(image_id: str, name: str) -> Path:
    """The saved image: its ID and the name it was saved under (the name is in the tar too)."""
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return cache_dir() / f"{image_id.removeprefix('sha256:')}.{tag}.tar"


def build(inv: Inventory) -> str:
    """Build the image with the local docker and return its ID."""
    r = run_here(build_argv(inv))
    if not r.ok:
        raise RuntimeFailure(f"docker build failed: {r.summary()}", field="image",
                             hint="run the printed docker build by hand to see the full output")
    return local_id(inv)


def local_id(inv: Inventory) -> str:
    r = run_here(inspect_argv(inv.image.name))
    if not r.ok:
        raise RuntimeFailure(f"image {inv.image.name} is not in the local docker: {r.summary()}",
                             field="image.name", hint="build it, or drop --no-build")
    return r.stdout.strip()


@dataclass(frozen=True)
class NodeImages:
    node: str
    image_id: str | None
    """What the inventory's image name points to there; None where it does not exist."""
    held: tuple[tuple[str, ...], ...] = ()
    """The diff IDs of each image the node holds."""


def parse_survey(node: str, stdout: str) -> NodeImages:
    image_id, held = None, []
    for line in stdout.splitlines():
        if line.startswith("ID "):
            image_id = None if line[3:].strip() in ("", "-") else line[3:].strip()
        elif line.startswith("LAYERS "):
            try:
                layers = json.loads(line[7:])
            except ValueError:
                continue
            if isinstance(layers, list):
                held.append(tuple(str(d) for d in layers))
    return NodeImages(node, image_id, tuple(held))


def survey(
    inv: Inventory,
    remote: Remote,
    before: Sequence[str] = (),
    what: str = "preparing the nodes",
    hint: str | None = None,
) -> dict[str, NodeImages]:
    """Run ``before`` on every node (one command per node), then learn what each node holds."""
    results = remote.run_all(survey_argv(inv, before), check=False, timeout=120)
    unprepared = {n for n, r in results.items() if not r.stdout.startswith("PREPARED")}
    if unprepared and before:
        raise RemoteFailure(what, {n: r if n in unprepared else Result(n, 0) for n, r in results.items()}, hint=hint)
    if not all(r.ok for r in results.values()):
        raise RemoteFailure("image inspect", results, hint="the node's docker engine is not usable")
    return {n: parse_survey(n, r.stdout) for n, r in results.items()}


def held_prefix(diff_ids: Sequence[str], held: Iterable[Sequence[str]]) -> int:
    """How many leading layers of the image the node already holds (chain IDs are prefix-based)."""
    best = 0
    for layers in held:
        k = 0
        while k < min(len(layers), len(diff_ids)) and layers[k] == diff_ids[k]:
            k += 1
        best = max(best, k)
    return best


# ------------------------------------------------------------------ the saved tar


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


def _norm(name: str) -> str:
    return name[2:] if name.startswith("./") else name


def index_saved(path: Path) -> SavedImage:
    """Read the headers of a ``docker save`` tar (one image) without reading the layers."""
    members = []
    with tarfile.open(path, "r:") as tf:
        for ti in tf:
            end = ti.offset_data + (-(-ti.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE if ti.isreg() else 0)
            members.append((_norm(ti.name), ti.offset, end))
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
    return SavedImage(path, path.stat().st_size, tuple(members),
                      "sha256:" + hashlib.sha256(config_bytes).hexdigest(), layer_files, diff_ids)


def _member(tf: tarfile.TarFile, name: str) -> str:
    for candidate in (name, f"./{name}"):
        try:
            tf.getmember(candidate)
            return candidate
        except KeyError:
            pass
    raise ValueError(f"{tf.name}: no {name} in the saved image")


def dropped_files(saved: SavedImage, held: int) -> frozenset[str]:
    """The layer files a node holding the first ``held`` layers does not need."""
    return frozenset(saved.layer_files[:held]) - frozenset(saved.layer_files[held:])


def ranges(saved: SavedImage, drop: frozenset[str]) -> list[tuple[int, int]]:
    """Byte ranges of the file that make the tar without ``drop`` (contiguous ones merged)."""
    if not drop:
        return [(0, saved.size)]
    out: list[tuple[int, int]] = []
    for name, start, end in saved.members:
        if name in drop:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


END_OF_ARCHIVE = b"\0" * (2 * tarfile.BLOCKSIZE)


def stream_size(saved: SavedImage, drop: frozenset[str]) -> int:
    extra = len(END_OF_ARCHIVE) if drop else 0
    return sum(end - start for start, end in ranges(saved, drop)) + extra


def read_ranges(path: Path, spans: Sequence[tuple[int, int]], tail: bytes = b"") -> Iterator[bytes]:
    with open(path, "rb") as f:
        for start, end in spans:
            f.seek(start)
            left = end - start
            while left:
                data = f.read(min(CHUNK, left))
                if not data:
                    raise RuntimeError(f"{path} ended early: delete it and deploy again")
                left -= len(data)
                yield data
    if tail:
        yield tail


def without_layers(saved: SavedImage, drop: frozenset[str]) -> Iterator[bytes]:
    """The saved tar minus the members in ``drop``, byte for byte otherwise."""
    return read_ranges(saved.path, ranges(saved, drop), END_OF_ARCHIVE if drop else b"")


def gzipped(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """``gzip -1`` of the stream (docker load detects it)."""
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    for chunk in chunks:
        if out := z.compress(chunk):
            yield out
    yield z.flush()


# ------------------------------------------------------------------ the cache


class _Saver:
    """``docker save`` into a temporary file beside the cache file, renamed when complete."""

    def __init__(self, inv: Inventory, image_id: str, final: Path) -> None:
        self.final = final
        final.parent.mkdir(parents=True, exist_ok=True)
        self.temp = final.with_name(f"{final.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        self.temp.touch()
        self.done = threading.Event()
        self.error: str | None = None
        self.saved: SavedImage | None = None
        self.proc = None
        self.cancelled = False
        self.thread = threading.Thread(target=self._run, args=(inv, image_id), daemon=True, name="docker-save")
        self.thread.start()

    def _run(self, inv: Inventory, image_id: str) -> None:
        import subprocess

        try:
            with open(self.temp, "wb") as out:
                self.proc = subprocess.Popen(save_argv(inv), stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
                if self.cancelled:
                    self.proc.kill()
                _, err = self.proc.communicate()
                out.flush()
                os.fsync(out.fileno())
            if self.cancelled:
                raise RuntimeError("docker save interrupted")
            if self.proc.returncode != 0:
                raise RuntimeError(f"docker save failed: {err.decode(errors='replace').strip()}")
            saved = index_saved(self.temp)
            if saved.image_id != image_id:
                raise RuntimeError(f"{inv.image.name} changed while it was saved (now {saved.image_id}, "
                                   f"expected {image_id}): deploy again")
            os.replace(self.temp, self.final)
            self.saved = dataclasses.replace(saved, path=self.final)
        except (OSError, ValueError, KeyError, tarfile.TarError, RuntimeError) as e:
            self.error = str(e) if isinstance(e, RuntimeError) else f"cannot save the image to {self.temp}: {e}"
            self.temp.unlink(missing_ok=True)
        finally:
            self.done.set()

    def follow(self) -> Iterator[bytes]:
        """The file as ``docker save`` writes it, to its end."""
        with open(self.temp, "rb") as f:
            while True:
                finished = self.done.is_set()
                data = f.read(CHUNK)
                if data:
                    yield data
                elif finished:
                    break
                else:
                    self.done.wait(0.05)
        if self.error:
            raise RuntimeError(self.error)

    def cancel(self) -> None:
        """Ends ``docker save`` now (an interrupted deploy) and waits until its file is gone."""
        self.cancelled = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.done.wait()

    def wait(self) -> SavedImage:
        self.done.wait()
        if self.error:
            raise RuntimeError(self.error)
        return self.saved


def clean_cache(keep: Path) -> None:
    """Keep ``keep`` and the most recently used other saved images; drop stale temporary files."""
    d = keep.parent
    try:
        tars = sorted((p for p in d.glob("*.tar") if p != keep), key=lambda p: p.stat().st_mtime, reverse=True)
        for p in tars[KEEP_CACHED - 1:]:
            p.unlink(missing_ok=True)
        for p in d.glob("*.tmp"):
            if time.time() - p.stat().st_mtime > STALE_TEMP_SECONDS:
                p.unlink(missing_ok=True)
    except OSError:
        pass


# ------------------------------------------------------------------ shipping


@dataclass(frozen=True)
class ShipOutcome:
    node: str
    sent_bytes: int
    """0 when the node was already up to date."""
    layers_held: int = 0
    """Leading layers of the image the node already had (not sent)."""
    layers: int = 0


def local_layers(inv: Inventory) -> tuple[str, ...]:
    r = run_here(layers_argv(inv.image.name))
    try:
        layers = json.loads(r.stdout) if r.ok else None
    except ValueError:
        layers = None
    if not isinstance(layers, list):
        raise RuntimeFailure(f"cannot read the layers of {inv.image.name} here: {r.summary()}", field="image.name")
    return tuple(layers)


def ship(
    inv: Inventory,
    remote: Remote,
    image_id: str,
    on_progress: Callable[[str, int], None] = lambda node, n: None,
    *,
    held: Mapping[str, NodeImages] | None = None,
    on_plan: Callable[[str, int | None], None] = lambda node, total: None,
) -> dict[str, ShipOutcome]:
    """Send the image to every node whose ID differs; verify the ID afterwards.

    ``held``: :func:`survey`'s answer, when the caller already has it. ``on_plan(node, total)``
    announces the bytes a node will get (None when compressed: not known in advance).
    """
    if held is None:
        held = survey(inv, remote)
    todo = [n for n, h in held.items() if h.image_id != image_id]
    if not todo:
        return {n: ShipOutcome(n, 0) for n in held}
    diff_ids = local_layers(inv)
    whole = os.environ.get(WHOLE_ENV) == "1"
    keep = {n: 0 if whole else held_prefix(diff_ids, held[n].held) for n in todo}

    final = cache_path(image_id, inv.image.name)
    saver = None
    saved: SavedImage | None = None
    if final.exists():
        try:
            saved = index_saved(final)
        except (OSError, ValueError, KeyError, tarfile.TarError):
            saved = None
        if saved is None or saved.image_id != image_id:
            final.unlink(missing_ok=True)
            saved = None
        else:
            os.utime(final)
    if saved is None:
        try:
            saver = _Saver(inv, image_id, final)
        except OSError as e:
            raise RuntimeFailure(f"cannot write the saved image under {final.parent}: {e}",
                                 hint=f"free space there, or point {CACHE_ENV} at another directory") from e

    sent: dict[str, int] = {n: 0 for n in held}

    def source(node: str) -> Iterator[bytes]:
        if keep[node] == 0 and saved is None:
            on_plan(node, None)
            chunks = saver.follow()
        else:
            img = saved or saver.wait()
            drop = dropped_files(img, keep[node])
            on_plan(node, None if inv.image.compress else stream_size(img, drop))
            chunks = without_layers(img, drop)
        return gzipped(chunks) if inv.image.compress else chunks

    def one(node: str) -> Result:
        def count(k: int) -> None:
            sent[node] += k
            on_progress(node, k)

        try:
            r = remote.send(node, source(node), load_argv(inv), count)
        except RuntimeError as e:
            return Result(node, 1, "", str(e))
        if not r.ok:
            if keep[node] and r.connected:
                last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
                return Result(node, r.exit_code, r.stdout,
                              f"docker load refused the image without the {keep[node]} layers the node holds "
                              f"({last}); set {WHOLE_ENV}=1 to send every layer")
            return r
        got = next((line[3:].strip() for line in reversed(r.stdout.splitlines()) if line.startswith("ID ")), "")
        if got != image_id:
            return Result(node, 1, "", f"after loading, the node has {got or 'no image'}, expected {image_id}")
        return r

    try:
        results = remote.parallel(todo, one)
    except BaseException:  # Ctrl-C: no docker save left running, no partial file left in the cache
        if saver is not None:
            saver.cancel()
        raise
    finally:
        if saver is not None:
            saver.done.wait()
            if saver.saved is not None:
                clean_cache(final)
    if not all(r.ok for r in results.values()):
        raise RemoteFailure("image shipping", results, hint="the node does not have the exact image")
    return {n: ShipOutcome(n, sent[n], keep.get(n, 0), len(diff_ids)) for n in held}
