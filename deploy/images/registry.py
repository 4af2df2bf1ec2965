"""Registry delivery (``image.transfer: registry``, or ``auto`` when ``image.name`` names a registry):
this machine pushes the image once, every node that lacks it pulls it.

1. ``docker push NAME`` from this machine's daemon; the registry answers with the manifest's digest.
2. ``docker manifest inspect REPOSITORY@DIGEST``: the registry holds that manifest and its config
   is the image just built (its ID); the layers' sizes give the pulls their totals.
3. On each node whose image ID differs: ``docker pull REPOSITORY@DIGEST`` (by digest, so a tag moved
   meanwhile cannot give another image), ``docker tag`` to NAME, then NAME must name that image
   there: its config's digest (Docker's classic store) or the pushed digest (the containerd image
   store), which bind the same image once step 2 has passed. A node that fails is named with the
   registry's message and what to check; the others finish.

Credentials are docker's own: ``docker login REGISTRY`` on this machine and, as the SSH user, on
each node. This module never sees, prints or records them.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import RemoteFailure, RuntimeFailure
from ..inventory import Inventory
from ..nodes.remote import Result, command_line, run_here
from . import image, image_cache, oci
from .delivery import Delivery, quiet
from .image import ShipOutcome

DIGEST_PLACEHOLDER = "PUSHED_DIGEST"
"""What ``--dry-run`` shows where the push's digest goes."""

# $1 = repository@digest, $2 = image.name. The pull's own lines, then "ID <what $2 names now>".
PULL = 'docker pull "$1" && docker tag "$1" "$2" && docker image inspect --format "ID {{.Id}}" "$2"'

_DIGEST = re.compile(r"\bdigest: (sha256:[0-9a-f]{64})\b")
_LAYER_LINE = re.compile(r"^([0-9a-f]{12}): (.+)$")


def repository(name: str) -> str:
    """``name`` without its tag or digest (``reg:5000/team/img:v1`` -> ``reg:5000/team/img``)."""
    name = name.split("@", 1)[0]
    head, sep, tail = name.rpartition(":")
    return head if sep and "/" not in tail else name


def pinned(name: str, digest: str) -> str:
    return f"{repository(name)}@{digest}"


def push_argv(inv: Inventory) -> list[str]:
    return ["docker", "push", inv.image.name]


def manifest_argv(ref: str) -> list[str]:
    return ["docker", "manifest", "inspect", ref]


def platform_argv(name: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", name]


def pull_argv(inv: Inventory, digest: str) -> tuple[str, ...]:
    return ("sh", "-c", PULL, "sh", pinned(inv.image.name, digest), inv.image.name)


def push_digest(output: str) -> str | None:
    """The manifest digest ``docker push`` ends with (``TAG: digest: sha256:... size: N``)."""
    found = _DIGEST.findall(output)
    return found[-1] if found else None


# What a failed push or pull says, and what the person should check. ``{host}``: the registry,
# ``{where}``: "this machine" or "the node" (run as the SSH user there).
HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("x509", "certificate", "tls: "),
     "{where} does not trust the certificate of {host}: put the registry's CA at /etc/docker/certs.d/{host}/ca.crt "
     "there"),
    (("server gave HTTP response to HTTPS client",),
     "{host} answers plain HTTP: serve it over TLS, or list it under insecure-registries in the daemon.json "
     "of {where}"),
    (("unauthorized", "authentication required", "denied", "no basic auth credentials"),
     "run `docker login {host}` on {where}"),
    (("no route to host", "connection refused", "i/o timeout", "no such host", "network is unreachable",
      "dial tcp", "timeout", "deadline exceeded", "connection reset"),
     "{where} cannot reach {host}: check its network, DNS and firewall towards the registry"),
    (("manifest unknown", "not found", "name unknown", "blob unknown"),
     "the registry does not hold the pushed image (any more): deploy again"),
)


def hint(message: str, host: str, where: str) -> str:
    low = message.lower()
    for needles, text in HINTS:
        if any(n.lower() in low for n in needles):
            return text.format(host=host, where=where)
    return f"check the docker engine of {where} and its access to {host}"


def last_error(lines: Sequence[str]) -> str:
    """The line a failed docker command explains itself with (its last error line)."""
    for line in reversed(lines):
        if "error" in line.lower() or "denied" in line.lower() or "unauthorized" in line.lower():
            return line.strip()
    rest = [line.strip() for line in lines if line.strip()]
    return rest[-1] if rest else "no output"


@dataclass(frozen=True)
class Manifest:
    """What the registry holds under the pushed digest."""

    digest: str
    config: str | None
    """The config's digest: the image ID on Docker's classic store. For an index, that of the
    manifest of this machine's platform (None when it has none)."""
    sizes: tuple[tuple[str, int], ...] = ()
    """(layer blob digest, compressed size), in layer order."""
    children: tuple[tuple[str, str], ...] = ()
    """An index's manifests: (digest, "os/architecture")."""

    @property
    def total(self) -> int:
        return sum(s for _, s in self.sizes)


def parse_manifest(digest: str, text: str) -> Manifest:
    doc = json.loads(text)
    layers = doc.get("layers") if isinstance(doc, dict) else None
    config = doc.get("config", {}).get("digest") if isinstance(doc, dict) else None
    sizes = tuple((str(x["digest"]), int(x["size"])) for x in layers or ())
    children = tuple((str(m["digest"]), f"{m.get('platform', {}).get('os')}/{m.get('platform', {}).get('architecture')}")
                     for m in (doc.get("manifests") or ()))
    if not sizes and not children:
        raise ValueError("neither layers nor manifests")
    return Manifest(digest, config, sizes, children)


@dataclass
class PullProgress:
    """Turns ``docker pull``'s lines (one per layer and status change) into bytes and a stage.

    The pull names each layer by the first 12 hex digits of its blob digest; the manifest gives
    that blob's size. A layer the node already has ("Already exists") is left out of the total.
    """

    sizes: Mapping[str, int]
    """short layer ID -> compressed size."""
    downloaded: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    image_id: str | None = None

    @classmethod
    def of(cls, manifest: Manifest) -> "PullProgress":
        return cls({d.removeprefix("sha256:")[:12]: s for d, s in manifest.sizes})

    @property
    def total(self) -> int:
        return sum(s for k, s in self.sizes.items() if k not in self.held)

    @property
    def done(self) -> int:
        return sum(self.sizes.get(k, 0) for k in self.downloaded)

    @property
    def stage(self) -> str:
        waiting = set(self.sizes) - self.held - self.downloaded
        return "loading" if self.downloaded and not waiting else "pulling"

    def feed(self, line: str) -> bool:
        """Take one line; True when it changed the bytes or the stage."""
        line = line.strip()
        if line.startswith("ID "):
            self.image_id = line[3:].strip()
            return False
        m = _LAYER_LINE.match(line)
        if not m or m.group(1) not in self.sizes:
            return False
        layer, status = m.groups()
        if status == "Already exists":
            self.held.add(layer)
        elif status in ("Download complete", "Pull complete") and layer not in self.downloaded:
            self.downloaded.add(layer)
        else:
            return False
        return True


class Registry(Delivery):
    name = "registry"

    @property
    def host(self) -> str:
        return self.inv.image.registry or "docker.io"

    def describe(self, nodes):
        inv = self.inv
        ref = pinned(inv.image.name, DIGEST_PLACEHOLDER)
        lines = [f"[local] {command_line(push_argv(inv))}  (to {self.host}, with this machine's `docker login`; "
                 f"the registry answers with the manifest's digest, {DIGEST_PLACEHOLDER} below)",
                 f"[local] {command_line(manifest_argv(ref))}  (the registry holds it: its config is the built "
                 "image's ID)"]
        return lines + [f"[{n}] {command_line(pull_argv(inv, DIGEST_PLACEHOLDER))}  (pull by digest, tag as "
                        f"{inv.image.name}; its image ID must be the built one)" for n in nodes]

    def ship(self, remote, image_id, held, report=quiet):
        held = image.resolve(held, image_id)  # a containerd node on a digest pushed from here before
        todo = [n for n, h in held.items() if h.image_id != image_id]
        if not todo:
            return {n: ShipOutcome(n, 0) for n in held}
        report(self.host, "pushing", 0, None)  # the registry's line first, then the nodes waiting for it
        for n in todo:
            report(n, "waiting", 0, None)
        manifest = self.push(image_id, report)
        # the containerd store names the pulled image by this digest: later surveys and launch
        # read it as the config it binds (checked by push), as for an image sent from here
        image_cache.remember(oci.Identity(manifest.config or image_id, manifest.digest))
        lines: dict[str, list[str]] = {n: [] for n in todo}
        progress = {n: PullProgress.of(manifest) for n in todo}
        lock = threading.Lock()

        def on_line(node: str, line: str) -> None:
            with lock:
                lines[node].append(line)
                p = progress[node]
                if p.feed(line):
                    report(node, p.stage, p.done, p.total or None)

        for n in todo:
            report(n, "pulling", 0, progress[n].total or None)
        argv = pull_argv(self.inv, manifest.digest)
        results = remote.stream({n: argv for n in todo}, on_line)
        accepted = tuple({image_id, manifest.digest, manifest.config} - {None})
        outcome = {n: self._checked(n, results[n], lines[n], progress[n], accepted) for n in todo}
        for n, r in outcome.items():
            p = progress[n]
            report(n, "verified" if r.ok else "failed", p.done, p.total or None)
        if not all(r.ok for r in outcome.values()):
            raise RemoteFailure(f"image pull from {self.host}", {**{n: Result(n, 0) for n in held}, **outcome})
        return {n: ShipOutcome(n, progress[n].done, len(progress[n].held), len(manifest.sizes))
                if n in progress else ShipOutcome(n, 0) for n in held}

    def _checked(self, node: str, r: Result, lines: list[str], p: PullProgress, accepted: tuple[str, ...]) -> Result:
        """The node's outcome: the pull's own message with a hint, or the image it now names checked.
        ``accepted``: the built image's ID, the config's digest (the image ID on Docker's classic
        store) and the pushed digest (the ID on the containerd image store); each binds the exact
        image, as the manifest under that digest was checked to be the built image after the push."""
        if not r.connected:
            return r
        if not r.ok:
            msg = last_error(lines)
            return Result(node, r.exit_code, "", f"{msg} ({hint(msg, self.host, 'the node')})")
        if p.image_id not in accepted:
            return Result(node, 1, "", f"after pulling, {self.inv.image.name} is {p.image_id or 'no image'} there, "
                                       f"expected {' or '.join(sorted(accepted))}")
        return r

    def push(self, image_id: str, report) -> Manifest:
        """Push once from this machine's daemon; the manifest the registry then holds, checked.
        ``docker push`` prints no byte counts where its output is not a terminal: the registry's line
        shows the stage until the push is done, then the image's size there."""
        inv, host = self.inv, self.host
        report(host, "pushing", 0, None)
        r = run_here(push_argv(inv))
        out = (r.stdout + r.stderr).splitlines()
        digest = push_digest(r.stdout)
        if not r.ok or digest is None:
            report(host, "failed", 0, None)
            msg = last_error(out) if not r.ok else f"no digest in its output ({last_error(out)})"
            raise RuntimeFailure(f"docker push {inv.image.name} failed: {msg}", field="image.name",
                                 hint=hint(msg, host, "this machine"))
        try:
            manifest = self._read_manifest(digest)
        except RuntimeFailure:
            report(host, "failed", 0, None)
            raise
        if manifest.config is not None and image_id not in (manifest.config, digest):
            report(host, "failed", 0, None)
            raise RuntimeFailure(f"{host} holds {pinned(inv.image.name, digest)} with config {manifest.config}, "
                                 f"not the image built here ({image_id})", field="image.name",
                                 hint="deploy again; if it persists, check what else pushes to that repository")
        report(host, "verified", manifest.total, manifest.total)
        return manifest

    def _read_manifest(self, digest: str) -> Manifest:
        """The manifest under ``digest``; for an index, the image manifest of this machine's platform
        (the one the image was built for), whose layers the nodes pull."""
        ref = pinned(self.inv.image.name, digest)
        r = run_here(manifest_argv(ref), timeout=120)
        try:
            manifest = parse_manifest(digest, r.stdout) if r.ok else None
        except (ValueError, KeyError, TypeError, AttributeError):
            manifest = None
        if manifest is None:
            msg = r.summary() if not r.ok else "not a manifest"
            raise RuntimeFailure(f"cannot read back {ref} from {self.host}: {msg}", field="image.name",
                                 hint=hint(msg, self.host, "this machine"))
        if manifest.config is not None or not manifest.children:
            return manifest
        platform = run_here(platform_argv(self.inv.image.name)).stdout.strip()
        child = next((d for d, p in manifest.children if p == platform), None)
        if child is None:
            return manifest
        inner = self._read_manifest(child)
        return Manifest(digest, inner.config, inner.sizes, manifest.children)
