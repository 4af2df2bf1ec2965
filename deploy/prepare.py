"""What `deploy` does before a launch, one class per runtime: the shared directories on every
node, then the image (docker: build here, ship where its ID differs) or the interpreter (host:
this package and torch importable with train.python). ``dry_run`` lists the same steps as text."""

from __future__ import annotations

from collections.abc import Callable

from . import image, plan
from .inventory import Inventory
from .remote import Remote, command_line
from .runtime import DockerRuntime, HostRuntime

Echo = Callable[[str], None]

DIRS_FAILED = {"what": "creating the storage directories",
               "hint": "the ssh user must be root or own the parent directories"}


class Deployer:
    def __init__(self, inv: Inventory) -> None:
        self.inv = inv
        self.make_dirs = plan.make_dirs_argv(inv)

    def dry_run(self, build: bool) -> list[str]:
        raise NotImplementedError

    def run(self, remote: Remote, echo: Echo, *, build: bool, ship) -> None:
        """``ship(image_id, held) -> {node: outcome}`` sends the image with the caller's progress display."""
        raise NotImplementedError

    def _dirs_ready(self, echo: Echo) -> None:
        s = self.inv.storage
        echo(f"directories ready: {s.data.host}, {s.checkpoints.host}")


class ImageDeployer(Deployer):
    def dry_run(self, build):
        inv = self.inv
        lines = [f"[{n.name}] {command_line(image.survey_argv(inv, self.make_dirs))}" for n in inv.nodes]
        if build:  # the directories and the image ID and layers each node holds, then the build
            lines.append(f"[local] {command_line(image.build_argv(inv))}")
        cached = image.cache_path("IMAGE_ID", inv.image.name)
        lines.append(f"[local] unless {cached} exists: {command_line(image.save_argv(inv))} > {cached}")
        gz = " | gzip -1" if inv.image.compress else ""
        lines += [f"[{n.name}] if its image ID differs: {cached} without the leading layers {n.name} holds{gz} "
                  f"| {n.name}: {command_line(image.load_argv(inv))}" for n in inv.nodes]
        return lines

    def run(self, remote, echo, *, build, ship):
        inv = self.inv
        held = image.survey(inv, remote, self.make_dirs, **DIRS_FAILED)
        self._dirs_ready(echo)
        image_id = image.build(inv) if build else image.local_id(inv)
        echo(f"image {inv.image.name} = {image_id}")
        for n, o in ship(image_id, held).items():
            kept = f" ({o.layers_held} of {o.layers} layers were there)" if o.layers_held else ""
            echo(f"{n}: " + (f"shipped {o.sent_bytes / 1e6:.1f} MB{kept}" if o.sent_bytes else "up to date"))


class InterpreterDeployer(Deployer):
    def dry_run(self, build):
        nodes = self.inv.nodes
        return ([f"[{n.name}] {command_line(self.make_dirs)}" for n in nodes]
                + [f"[{n.name}] {command_line(plan.python_check_argv(self.inv))}" for n in nodes])

    def run(self, remote, echo, *, build, ship):
        inv = self.inv
        remote.run_all(self.make_dirs, **DIRS_FAILED)
        self._dirs_ready(echo)
        res = remote.run_all(plan.python_check_argv(inv), what="python check",
                             hint=f"install this package for {inv.python_path()} on the node (train.python)")
        for n, r in res.items():
            echo(f"{n}: {inv.python_path()} has trainer and torch {r.stdout.strip()}")


DEPLOYERS = {DockerRuntime.name: ImageDeployer, HostRuntime.name: InterpreterDeployer}


def deployer(inv: Inventory) -> Deployer:
    return DEPLOYERS[inv.job.runtime](inv)
