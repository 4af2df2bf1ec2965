"""What `deploy` does before a launch, one class per runtime: the shared directories on every
node, then the image (docker: build here, ship where its ID differs) or the interpreter (host:
this package and torch importable with train.python). ``dry_run`` lists the same steps as text.

The image is built for the nodes' platform and compared with it before anything is shipped
(deploy/images/build.py)."""

from __future__ import annotations

from collections.abc import Callable

from ..inventory import Inventory
from ..job import plan
from ..job.runtime import DockerRuntime, HostRuntime
from ..nodes.remote import Remote, command_line
from . import build as builder
from . import image, platforms as platform_of, ways

Echo = Callable[[str], None]

DIRS_FAILED = {"what": "creating the storage directories",
               "hint": "the ssh user must be root or own the parent directories"}


class Deployer:
    def __init__(self, inv: Inventory) -> None:
        self.inv = inv
        self.make_dirs = plan.make_dirs_argv(inv)

    def dry_run(self, build: bool) -> list[str]:
        raise NotImplementedError

    def run(self, remote: Remote, echo: Echo, *, build: bool, ship, view: builder.QuietView | None = None) -> dict[str, str]:
        """``ship(image_id, held) -> {node: outcome}`` sends the image with the caller's progress display;
        ``view`` shows the build (deploy/images/build.py). What each node has now, as a line (also echoed)."""
        raise NotImplementedError

    def _dirs_ready(self, echo: Echo) -> None:
        s = self.inv.storage
        echo(f"directories ready: {s.data.host}, {s.checkpoints.host}")


class ImageDeployer(Deployer):
    def dry_run(self, build):
        inv = self.inv
        lines = [f"[{n.name}] {command_line(platform_of.node_platform_argv(inv))}" for n in inv.nodes]
        lines.append(f"[all] the nodes must be of one platform, {builder.NODES_PLATFORM}")
        lines += [f"[{n.name}] {command_line(image.survey_argv(inv, self.make_dirs))}" for n in inv.nodes]
        if build:  # the directories and the image ID and layers each node holds, then the build
            lines.append(f"[local] {builder.dry_run_line(inv)}")
        lines.append(f"[local] {command_line(platform_of.inspect_argv(inv.image.name, platform_of.IMAGE_PLATFORM))}: "
                     f"must be {builder.NODES_PLATFORM}, else nothing is shipped")
        way = ways.for_inventory(inv)
        lines.append(f"[all] the nodes whose image ID differs get it by {way.name} (image.transfer: "
                     f"{inv.image.transfer}); with all of them:")
        return lines + way.describe([n.name for n in inv.nodes])

    def run(self, remote, echo, *, build, ship, view=None):
        inv = self.inv
        platforms = platform_of.node_platforms(inv, remote)
        platform = platform_of.one_platform(platforms)
        held = image.survey(inv, remote, self.make_dirs, **DIRS_FAILED)
        self._dirs_ready(echo)
        echo("image stores: " + ", ".join(f"{n} {h.store}" for n, h in held.items()))
        image_id = builder.build(inv, platform, view) if build else builder.local_id(inv)
        platform_of.refuse_other_platform(inv, platforms, built=build)
        echo(f"image {inv.image.name} = {image_id} ({platform}, the nodes' platform)")
        done = {}
        for n, o in ship(image_id, held).items():
            kept = f" ({o.layers_held} of {o.layers} layers were there)" if o.layers_held else ""
            note = f"; {o.note}" if o.note and o.sent_bytes else ""
            done[n] = f"shipped {o.sent_bytes / 1e6:.1f} MB{kept}{note}" if o.sent_bytes else "up to date"
            echo(f"{n}: {done[n]}")
        echo(image.cache_report())
        return done


class InterpreterDeployer(Deployer):
    def dry_run(self, build):
        nodes = self.inv.nodes
        return ([f"[{n.name}] {command_line(self.make_dirs)}" for n in nodes]
                + [f"[{n.name}] {command_line(plan.python_check_argv(self.inv))}" for n in nodes])

    def run(self, remote, echo, *, build, ship, view=None):
        inv = self.inv
        remote.run({n.name: self.make_dirs for n in inv.nodes}, **DIRS_FAILED)
        self._dirs_ready(echo)
        res = remote.run({n.name: plan.python_check_argv(inv) for n in inv.nodes}, what="python check",
                         hint=f"install this package for {inv.python_path()} on the node (train.python)")
        done = {n: f"{inv.python_path()} has the node agent and torch {r.stdout.strip()}" for n, r in res.items()}
        for n, line in done.items():
            echo(f"{n}: {line}")
        return done


DEPLOYERS = {DockerRuntime.name: ImageDeployer, HostRuntime.name: InterpreterDeployer}


def deployer(inv: Inventory) -> Deployer:
    return DEPLOYERS[inv.job.runtime](inv)
