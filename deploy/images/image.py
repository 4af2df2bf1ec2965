"""The training image: compare IDs, ship it where it differs, judge what each node loaded.

Shipping makes the ``docker save`` stream once per image, into a cache file named after the
image ID (image_cache.py; written to a temporary name and renamed when complete, reused while
present, bounded in count and size). Every node that lacks the image reads that file in
parallel, straight into ``docker load`` (classic-store nodes that need every layer follow the
file while ``docker save`` is still writing it), gzipped on the way when ``image.compress`` is
set.

The survey learns each node's image store (Docker's classic store, or the containerd image
store of new Docker installs), the ID the image's name has there, and the diff IDs of every
image it holds. A node that already holds the first layers of the image (the previous version,
after a code-only change) gets a tar without those layers' data: chain IDs depend only on the
diff IDs before them, so the longest run of leading diff IDs among the node's images is safe
to leave out. That tar (oci.py) carries docker's ``manifest.json`` and an OCI ``index.json``
over the same blobs, because the two stores load differently: the classic store skips a layer
it has, the containerd store refuses a ``manifest.json`` whose files are missing but takes an
OCI layout whose blobs it already holds.

The two stores name the same image differently (the config's digest, the manifest's digest);
both are known from the saved file (:class:`~deploy.images.oci.Identity`) and compared exactly, and
a containerd node's ID is turned into the config's digest (:func:`resolve`) before anything
compares it with this machine's. After loading, a node's success is judged by the image it
then holds, not by ``docker load``'s exit status alone (:func:`load_problem`); a node that
cannot get the exact image is an error, never a fallback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import tarfile
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import RemoteFailure, RuntimeFailure
from ..inventory import Inventory
from ..programs import node_program
from . import oci
from .image_cache import CACHE_ENV, bound, cache_path, clean_cache, config_of, remember, report
from .oci import Identity, SavedImage, index_saved  # noqa: F401 (SavedImage: image.SavedImage, as callers name it)
from ..nodes.remote import Remote, Result, run_here

WHOLE_ENV = "DDP_DEPLOY_WHOLE_IMAGE"
"""Set to 1 to send every layer, even those a node already holds."""
CHUNK = 1 << 20
CLASSIC, CONTAINERD = "classic", "containerd"
"""The image stores: Docker's own (graph drivers, image ID = config digest) and the containerd
image store (``"features": {"containerd-snapshotter": true}``, image ID = manifest digest)."""


def layers_argv(name: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", name]


def save_argv(inv: Inventory) -> list[str]:
    """Run once per image; its stdout becomes the cache file."""
    return ["docker", "save", inv.image.name]


# What the node's docker says of the image $1: "STORE classic|containerd" (the containerd image
# store reports the driver type io.containerd.snapshotter.v1), "ID <the ID $1 names, or ->" and
# "LISTED yes|no": whether `docker image ls` shows that ID (the containerd store leaves out an
# image whose content is not all there).
IDENTIFY = node_program("docker_store.sh") + node_program("identify.sh")

# $1 = image name, then optionally a command run first (the storage directories). Prints
# PREPARED once that command succeeded, IDENTIFY's lines, then one
# "LAYERS <json list of diff IDs>" line per image the node holds.
SURVEY = node_program("survey.sh")

# $1 = image name. Loads the tar on stdin; prints docker load's output (stdout and stderr), each
# line as "LOAD <line>", then "EXIT <docker load's exit status>" and IDENTIFY's lines; exits with
# docker load's status. load_problem() judges it.
LOAD = node_program("docker_store.sh") + node_program("load.sh")


def survey_argv(inv: Inventory, before: Sequence[str] = ()) -> tuple[str, ...]:
    return ("sh", "-c", SURVEY, IDENTIFY, inv.image.name, *before)


def load_argv(inv: Inventory) -> tuple[str, ...]:
    return ("sh", "-c", LOAD, IDENTIFY, inv.image.name)


def identify_argv(inv: Inventory) -> tuple[str, ...]:
    """The node's store and the ID and completeness of the inventory's image there (launch)."""
    return ("sh", "-c", IDENTIFY, "sh", inv.image.name)


@dataclass(frozen=True)
class NodeImages:
    node: str
    image_id: str | None
    """What the inventory's image name points to there; None where it does not exist. On the
    containerd store a manifest digest until :func:`resolve` matches it to the config's."""
    held: tuple[tuple[str, ...], ...] = ()
    """The diff IDs of each image the node lists (complete ones)."""
    store: str = CLASSIC
    listed: bool = True
    """Whether the node's ``docker image ls`` shows ``image_id``: the containerd store leaves out
    an image whose content is not all there (it may still run; it cannot be saved or pushed)."""


def parse_survey(node: str, stdout: str) -> NodeImages:
    image_id, held, store, listed = None, [], CLASSIC, True
    for line in stdout.splitlines():
        if line.startswith("ID "):
            image_id = None if line[3:].strip() in ("", "-") else line[3:].strip()
        elif line.startswith("STORE "):
            store = CONTAINERD if line[6:].strip() == CONTAINERD else CLASSIC
        elif line.startswith("LISTED "):
            listed = line[7:].strip() == "yes"
        elif line.startswith("LAYERS "):
            try:
                layers = json.loads(line[7:])
            except ValueError:
                continue
            if isinstance(layers, list):
                held.append(tuple(str(d) for d in layers))
    return NodeImages(node, image_id, tuple(held), store, listed or image_id is None)


def survey(
    inv: Inventory,
    remote: Remote,
    before: Sequence[str] = (),
    what: str = "preparing the nodes",
    hint: str | None = None,
) -> dict[str, NodeImages]:
    """Run ``before`` on every node (one command per node), then learn what each node holds."""
    results = remote.run({n.name: survey_argv(inv, before) for n in inv.nodes}, check=False, timeout=120)
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


def identity(saved: SavedImage) -> Identity:
    """How each store names the saved image; remembered for later deploys and launches."""
    ident = oci.identity(saved)
    remember(ident)
    return ident


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


def cached(inv: Inventory, image_id: str) -> SavedImage | None:
    """The saved image from the cache when it is there and whole (marked as just used); a file
    that is not the image is removed."""
    final = cache_path(image_id, inv.image.name)
    if not final.exists():
        return None
    try:
        saved = index_saved(final)
    except (OSError, ValueError, KeyError, tarfile.TarError):
        saved = None
    if saved is None or saved.image_id != image_id:
        final.unlink(missing_ok=True)
        return None
    os.utime(final)
    identity(saved)
    return saved


def start_save(inv: Inventory, image_id: str) -> _Saver:
    final = cache_path(image_id, inv.image.name)
    try:
        return _Saver(inv, image_id, final)
    except OSError as e:
        raise RuntimeFailure(f"cannot write the saved image under {final.parent}: {e}",
                             hint=f"free space there, or point {CACHE_ENV} at another directory") from e


def saved_image(inv: Inventory, image_id: str) -> SavedImage:
    """The complete saved image: from the cache, else ``docker save`` now (waited for)."""
    saved = cached(inv, image_id)
    if saved is not None:
        return saved
    saver = start_save(inv, image_id)
    try:
        return saver.wait()
    except RuntimeError as e:
        raise RuntimeFailure(str(e), field="image") from e
    except BaseException:
        saver.cancel()
        raise


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
            identity(self.saved)
        except (OSError, ValueError, KeyError, tarfile.TarError, RuntimeError) as e:
            self.error = str(e) if isinstance(e, RuntimeError) else f"cannot save the image to {self.temp}: {e}"
            self.temp.unlink(missing_ok=True)
        finally:
            self.done.set()

    def follow(self) -> Iterator[bytes]:
        """The file as ``docker save`` writes it, to its end."""
        try:
            f = open(self.temp, "rb")
        except FileNotFoundError:  # the save ended (renamed, or failed and removed) before this node began
            self.done.wait()
            if self.error:
                raise RuntimeError(self.error) from None
            f = open(self.final, "rb")
        with f:
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


# ------------------------------------------------------------------ the stores


def holds(h: NodeImages, ident: Identity | str) -> bool:
    """Whether the ID the node shows binds exactly the image (config digest ``ident``, or the
    identity): on the classic store the config digest itself; on the containerd store a manifest
    that binds that config, as computed from the saved file or met here before (image_cache)."""
    config = ident.config if isinstance(ident, Identity) else ident
    if h.image_id is None or h.store != CONTAINERD:
        return h.image_id == config
    return (isinstance(ident, Identity) and h.image_id == ident.manifest) or config_of(h.image_id) == config


def resolve(held: Mapping[str, NodeImages], ident: Identity | str) -> dict[str, NodeImages]:
    """Each node's answer with a containerd node's ID turned into the config's digest where it
    binds exactly this image and its content is all there; then ``image_id`` compares alike on
    both stores (an incomplete copy keeps its manifest digest: it is shipped again)."""
    config = ident.config if isinstance(ident, Identity) else ident
    return {n: dataclasses.replace(h, image_id=config)
            if h.store == CONTAINERD and h.listed and holds(h, ident) else h for n, h in held.items()}


def resolved(inv: Inventory, held: Mapping[str, NodeImages], image_id: str
             ) -> tuple[dict[str, NodeImages], SavedImage | None]:
    """:func:`resolve` with the identity of ``image_id`` from wherever it is known: the record a
    save left, the saved file, or (only where a containerd node holds some image of that name and
    nothing here tells how that store names this one) ``docker save`` now. Returns the resolved
    answers and the saved image when it was read or made."""
    saved = cached(inv, image_id)
    if saved is None and any(h.store == CONTAINERD and h.image_id and config_of(h.image_id) is None
                             for h in held.values()):
        saved = saved_image(inv, image_id)
    return resolve(held, oci.identity(saved) if saved is not None else image_id), saved


def layers_to_skip(node_images: NodeImages, diff_ids: Sequence[str]) -> int:
    """How many leading layers may be left out of what ``node_images.node`` is sent: the longest
    run it holds, on either store (the tar of oci.layout loads on both); none with
    DDP_DEPLOY_WHOLE_IMAGE=1, nor where the node's copy of the image's name is incomplete (its
    layers' content came from elsewhere: a registry, a local build)."""
    if os.environ.get(WHOLE_ENV) == "1" or _incomplete(node_images):
        return 0
    return held_prefix(diff_ids, node_images.held)


def _incomplete(h: NodeImages) -> bool:
    return h.store == CONTAINERD and h.image_id is not None and not h.listed


def how_sent(node_images: NodeImages, skip: int) -> str:
    """What deploy says of a node it ships to beyond the bytes: its store and why every layer."""
    if os.environ.get(WHOLE_ENV) == "1":
        why = f"every layer ({WHOLE_ENV}=1)"
    elif _incomplete(node_images):
        why = ("every layer: the copy it holds lacks content (the containerd store does not list it), "
               "so no layer it holds counts")
    else:
        why = ""
    if node_images.store != CONTAINERD:
        return why
    what = f"an OCI layout without the {skip} layers it holds" if skip else "an OCI layout"
    return f"containerd image store: {what}" + (f"; {why}" if why else "")


ERROR_LINE = re.compile(r"^(error|failed|unexpected eof)\b|\berror:", re.IGNORECASE)
"""A line of docker load's output that reports a failure (``Error unpacking image ...`` comes
with exit status 0 from the containerd store of Docker 27 and later)."""


@dataclass(frozen=True)
class LoadReport:
    """What the LOAD script printed: docker load's lines, its exit status, then the node's image."""

    lines: tuple[str, ...]
    exit: int | None
    node: NodeImages


def parse_load(node: str, stdout: str) -> LoadReport:
    lines, status = [], None
    for line in stdout.splitlines():
        if line.startswith("LOAD "):
            lines.append(line[5:])
        elif line.startswith("EXIT ") and line[5:].strip().lstrip("-").isdigit():
            status = int(line[5:])
    return LoadReport(tuple(lines), status, parse_survey(node, stdout))


def load_problem(node_images: NodeImages, load_stdout: str, image_id: str | Identity) -> str | None:
    """Why the node does not hold exactly the image after LOAD (None: it does). Judged by the
    image the node's docker then names and lists, not by docker load's exit status alone: an
    error line with exit status 0 fails, and so does a load that exited 0 but left an image
    whose content is not all there. ``image_id``: the identity of the image sent, or its config
    digest (a containerd node's manifest is then looked up among those met here)."""
    said = parse_load(node_images.node, load_stdout)
    got = said.node
    last = said.lines[-1] if said.lines else "no output"
    if said.exit is None:
        return "the load ended without a word from docker load (connection lost, or the node's shell failed)"
    if said.exit != 0:
        return f"docker load failed (exit {said.exit}): {last}"
    errors = [line for line in said.lines if ERROR_LINE.search(line)]
    if errors:
        return f"docker load exited 0 but reported an error: {errors[-1]}"
    store = got.store if "STORE " in load_stdout else node_images.store
    if not holds(dataclasses.replace(got, store=store), image_id):
        want = image_id.on(store) if isinstance(image_id, Identity) else image_id
        return f"after loading, the node ({store} store) has {got.image_id or 'no image'}, expected {want}"
    if not got.listed and store == CONTAINERD:
        return ("loaded, but the node's containerd store does not list the image: the content of layers left "
                "out is not there (its copy came from a registry or a local build); the next deploy sends every layer")
    if not got.listed:
        return f"loaded, but the node's {store} store does not list the image {got.image_id}"
    return None


def comparable_id(node_images: NodeImages) -> str | None:
    """The node's image as the config's digest, the same on both stores (launch compares nodes);
    a containerd node's manifest digest stays as it is where this machine never saved that
    image. None where the node has no usable image of that name."""
    h = node_images
    if h.image_id is None or not h.listed:
        return None
    if h.store == CONTAINERD:
        return config_of(h.image_id) or h.image_id
    return h.image_id


# ------------------------------------------------------------------ shipping


@dataclass(frozen=True)
class ShipOutcome:
    node: str
    sent_bytes: int
    """0 when the node was already up to date."""
    layers_held: int = 0
    """Leading layers of the image the node already had (not sent)."""
    layers: int = 0
    note: str = ""
    """What else deploy says of this node: its store, and why it got every layer."""


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
    """Send the image to every node whose ID differs; judge what each then holds.

    A classic-store node that needs every layer gets ``docker save``'s own tar (followed while it
    is written); the others get :func:`oci.layout` without the layers they hold.
    ``held``: :func:`survey`'s answer, when the caller already has it. ``on_plan(node, total)``
    announces the bytes a node will get (None when compressed, or still being saved).
    """
    bound()  # a bad DDP_DEPLOY_IMAGE_CACHE_GB is refused before anything is sent
    if held is None:
        held = survey(inv, remote)
    final = cache_path(image_id, inv.image.name)
    saver = None
    held, saved = resolved(inv, held, image_id)
    ident = oci.identity(saved) if saved is not None else None
    todo = [n for n, h in held.items() if h.image_id != image_id]
    if not todo:
        return {n: ShipOutcome(n, 0) for n in held}
    diff_ids = local_layers(inv)
    keep = {n: layers_to_skip(held[n], diff_ids) for n in todo}
    raw = {n for n in todo if keep[n] == 0 and held[n].store == CLASSIC}
    if saved is None:
        saver = start_save(inv, image_id)

    sent: dict[str, int] = {n: 0 for n in held}

    def source(node: str) -> Iterator[bytes]:
        if node in raw and saved is None:
            on_plan(node, None)
            chunks = saver.follow()
        elif node in raw:
            on_plan(node, None if inv.image.compress else saved.size)
            chunks = without_layers(saved, frozenset())
        else:
            tar = oci.layout(saved or saver.wait(), keep[node], inv.image.name)
            on_plan(node, None if inv.image.compress else tar.size)
            chunks = tar.chunks(CHUNK)
        return gzipped(chunks) if inv.image.compress else chunks

    def one(node: str) -> Result:
        def count(k: int) -> None:
            sent[node] += k
            on_progress(node, k)

        try:
            r = remote.send(node, source(node), load_argv(inv), count)
        except RuntimeError as e:
            return Result(node, 1, "", str(e))
        if not r.connected:
            return r
        done = saver.saved if saver is not None else None
        problem = load_problem(held[node], r.stdout, ident or (oci.identity(done) if done else image_id))
        if problem is None:
            return Result(node, 0, r.stdout)
        said = parse_load(node, r.stdout)
        if keep[node] and said.exit not in (0, None):
            problem = (f"docker load refused the image without the {keep[node]} layers the node holds "
                       f"({said.lines[-1] if said.lines else f'exit {said.exit}'}); set {WHOLE_ENV}=1 to send every layer")
        return Result(node, 1, "", problem)

    try:
        results = remote.parallel(todo, one)
    except BaseException:  # Ctrl-C: no docker save left running, no partial file left in the cache
        if saver is not None:
            saver.cancel()
        raise
    finally:
        if saver is not None:
            saver.done.wait()
        if final.exists():
            clean_cache(final)
    if not all(r.ok for r in results.values()):
        raise RemoteFailure("image shipping", results, hint="the node does not have the exact image")
    return {n: ShipOutcome(n, sent[n], keep.get(n, 0), len(diff_ids),
                           how_sent(held[n], keep[n]) if n in keep else "") for n in held}


def cache_report() -> str:
    """deploy's line on the image cache: size used and bound, what was evicted."""
    return report().line()
