"""The training image: build it here, compare IDs, ship it where it differs.

Shipping is ``docker save IMAGE [| gzip -1]`` on this machine streamed into ``docker load``
on the node (which detects gzip itself). An image ID is verified after loading; a node that
cannot get the exact image is an error, never a fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import RemoteFailure, RuntimeFailure
from .inventory import Inventory
from .remote import Remote, Result, local_pipeline, run_here  # noqa: F401 (run_here re-exported)


def build_argv(inv: Inventory) -> list[str]:
    argv = ["docker", "build", "-t", inv.image.name, "-f", str(inv.dockerfile_path())]
    for k, v in inv.image.build_args.items():
        argv += ["--build-arg", f"{k}={v}"]
    return argv + [str(inv.context_path())]


def inspect_argv(name: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", "{{.Id}}", name]


def save_stages(inv: Inventory) -> list[list[str]]:
    stages = [["docker", "save", inv.image.name]]
    if inv.image.compress:
        stages.append(["gzip", "-1"])
    return stages


LOAD_ARGV = ("docker", "load")


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


def node_ids(inv: Inventory, remote: Remote) -> dict[str, str | None]:
    """Image ID on each node; None where the node does not have the image."""
    results = remote.run_all(inspect_argv(inv.image.name), check=False)
    unreachable = {n: r for n, r in results.items() if not r.connected}
    if unreachable:
        raise RemoteFailure("image inspect", results)
    return {n: (r.stdout.strip() if r.ok else None) for n, r in results.items()}


@dataclass(frozen=True)
class ShipOutcome:
    node: str
    sent_bytes: int
    """0 when the node was already up to date."""


def ship(
    inv: Inventory,
    remote: Remote,
    image_id: str,
    on_progress: Callable[[str, int], None] = lambda node, n: None,
) -> dict[str, ShipOutcome]:
    """Send the image to every node whose ID differs; verify the ID afterwards."""
    have = node_ids(inv, remote)
    todo = [n for n, i in have.items() if i != image_id]
    sent: dict[str, int] = {n: 0 for n in have}

    def one(node: str) -> Result:
        def count(k: int) -> None:
            sent[node] += k
            on_progress(node, k)

        try:
            r = remote.send(node, local_pipeline(save_stages(inv)), LOAD_ARGV, count)
        except RuntimeError as e:
            return Result(node, 1, "", str(e))
        if not r.ok:
            return r
        got = remote.run({node: inspect_argv(inv.image.name)}, check=False)[node]
        if got.stdout.strip() != image_id:
            return Result(node, 1, "", f"after loading, the node has {got.stdout.strip() or 'no image'}, "
                                       f"expected {image_id}")
        return r

    results = remote.parallel(todo, one)
    if not all(r.ok for r in results.values()):
        raise RemoteFailure("image shipping", results, hint="the node does not have the exact image")
    return {n: ShipOutcome(n, sent[n]) for n in have}
