"""How the image travels to the nodes that lack it: one class per way (``image.transfer``).

- :class:`Star` (image.py): this machine sends one copy per node. Its uplink carries N copies.
- :class:`~deploy.images.chain.Chain`: this machine sends one copy to the first node; each node stores,
  verifies and loads what it gets and forwards it to the next, so the uplink carries one copy
  whatever N is, and the time is about that of one node.
- :class:`~deploy.images.registry.Registry`: push once to the registry ``image.name`` names; every node
  pulls it.

Every way reports per node through ``report(node, stage, done, total)`` (bytes so far and the
expected total, None when unknown) and ends with the image ID verified on every node it shipped
to, or a :class:`~deploy.errors.RemoteFailure` naming the nodes that did not get it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..inventory import Inventory
from ..nodes.remote import Remote, command_line
from . import image

Report = Callable[[str, str, int, "int | None"], None]
"""``report(node, stage, bytes done, total bytes or None)``."""

STAGES = ("waiting", "pushing", "receiving", "forwarding", "pulling", "loading", "verified", "failed")


def quiet(node: str, stage: str, done: int, total: int | None) -> None:
    pass


def saved_line(inv: Inventory) -> str:
    """The dry-run line for the saved image both star and chain read from."""
    cached = image.cache_path("IMAGE_ID", inv.image.name)
    return f"[local] unless {cached} exists: {command_line(image.save_argv(inv))} > {cached}"


class Delivery:
    name = ""

    def __init__(self, inv: Inventory) -> None:
        self.inv = inv

    def describe(self, nodes: list[str]) -> list[str]:
        """What ``--dry-run`` prints: how the image would reach ``nodes`` (those lacking it)."""
        raise NotImplementedError

    def ship(self, remote: Remote, image_id: str, held: Mapping[str, image.NodeImages],
             report: Report = quiet) -> dict[str, image.ShipOutcome]:
        raise NotImplementedError


class Star(Delivery):
    name = "star"

    def describe(self, nodes):
        inv = self.inv
        cached = image.cache_path("IMAGE_ID", inv.image.name)
        gz = " | gzip -1" if inv.image.compress else ""
        return [saved_line(inv)] + [f"[{n}] star: {cached} without the leading layers {n} holds{gz} "
                f"| {n}: {command_line(image.load_argv(inv))}" for n in nodes]

    def ship(self, remote, image_id, held, report=quiet):
        done: dict[str, int] = {}
        totals: dict[str, int | None] = {}

        def on_plan(node: str, total: int | None) -> None:
            done[node], totals[node] = 0, total
            report(node, "receiving", 0, total)

        def on_progress(node: str, k: int) -> None:
            done[node] += k
            report(node, "receiving" if done[node] != totals[node] else "loading", done[node], totals[node])

        out = image.ship(self.inv, remote, image_id, on_progress, held=held, on_plan=on_plan)
        for n, o in out.items():
            if o.sent_bytes:
                report(n, "verified", o.sent_bytes, o.sent_bytes)
        return out
