"""The training image's build here, for the nodes' platform (deploy/images/platforms.py), shown as
it runs.

``docker build`` runs with its output read line by line (:func:`run_build`, deploy/images/
build_log.py) and told to a view as steps and lines (:class:`QuietView`'s methods; the CLI's shows
the step that runs and a short tail of its output, deploy/cli/build_view.py), and the whole output
goes to a file (:func:`log_path`).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import RuntimeFailure
from ..inventory import Inventory
from ..nodes.remote import command_line, run_here
from .build_log import BuildFailure, BuildLog, Step, clean, plain
from .platforms import CROSS_BUILD, OTHER_PLATFORM, inspect_argv

LOG_ENV = "DDP_DEPLOY_BUILD_LOG"
"""The whole output of the last build (default: build.log beside the debug log)."""

NODES_PLATFORM = "<the nodes' os/arch>"
"""Stands for the nodes' platform in the dry run (read from the nodes when deploy runs)."""


# ------------------------------------------------------------------ commands


def build_argv(inv: Inventory, platform: str | None = None) -> list[str]:
    argv = ["docker", "build"]
    if platform:
        argv += ["--platform", platform]
    argv += ["-t", inv.image.name, "-f", str(inv.dockerfile_path())]
    for k, v in inv.image.build_args.items():
        argv += ["--build-arg", f"{k}={v}"]
    return argv + [str(inv.context_path())]


def dry_run_line(inv: Inventory) -> str:
    """The build's command line, the nodes' platform (read when deploy runs) as a placeholder."""
    argv = build_argv(inv)
    return f"{command_line(argv[:2])} --platform {NODES_PLATFORM} {command_line(argv[2:])}"


def log_path() -> Path:
    if os.environ.get(LOG_ENV):
        return Path(os.environ[LOG_ENV])
    debug = os.environ.get("DDP_DEPLOY_LOG")
    return Path(debug).with_name("build.log") if debug else Path.home() / ".cache" / "ddp-deploy" / "build.log"


# ------------------------------------------------------------------ what the operator sees


class QuietView:
    """What a build shows as it runs: here nothing (a program's build, through the Python API);
    the CLI shows it through its own view of the same methods (deploy/cli/build_view.py)."""

    shows = False
    """Whether a failed step's output was shown (``failed``) where the error can point to it."""

    def __enter__(self) -> "QuietView":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def started(self, step: Step) -> None:
        """A step has started."""

    def line(self, step: Step, text: str) -> None:
        """A line of ``step``'s own output."""

    def failed(self, failure: BuildFailure, log: Path) -> None:
        """The build failed: what it said, its whole log in ``log``."""

    def done(self, log: BuildLog, seconds: float, path: Path) -> None:
        """The build ended well."""


# ------------------------------------------------------------------ running it


def run_build(argv: Sequence[str], view: QuietView, path: Path) -> BuildLog:
    """Run ``docker build``, showing it on ``view`` and keeping its whole output in ``path``;
    a failed build raises, naming the failing step (whose output ``view`` printed)."""
    log = BuildLog()
    start = time.monotonic()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        keep = open(path, "w", buffering=1)  # line by line: `tail -f` follows the build
    except OSError as e:
        raise RuntimeFailure(f"cannot write the build log {path}: {e}", hint=f"point {LOG_ENV} at a writable file") from e
    env = {**os.environ, "BUILDKIT_PROGRESS": "plain"}
    with keep:
        keep.write(f"$ {command_line(argv)}\n")
        try:
            proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)
        except OSError as e:
            raise RuntimeFailure(f"cannot run docker build here: {e}",
                                 hint="install the docker CLI on this machine, or use job.runtime: host") from e
        try:
            with view:
                for raw in proc.stdout:
                    text = clean(raw)
                    keep.write(plain(text) + "\n")
                    known = len(log.steps)
                    step = log.feed(text)
                    if step is not None and len(log.steps) > known:
                        view.started(step)
                    if step is not None and log.added is not None:
                        view.line(step, log.added)
            code = proc.wait()
        except BaseException:  # Ctrl-C: the build's client ends, and with it the build
            proc.kill()
            proc.wait()
            raise
    if code != 0:
        failure = log.failure(code)
        view.failed(failure, path)
        where = f"at {_short(failure.step)}" if failure.step else "before its first step"
        cross = f"; {CROSS_BUILD}" if OTHER_PLATFORM in failure.error else ""
        raise RuntimeFailure(f"docker build failed {where}: {_short(failure.summary(), 300)}",
                             hint=("its output is above; " if failure.output and view.shows else "")
                             + f"the whole build log: {path}{cross}")
    view.done(log, time.monotonic() - start, path)
    return log


def _short(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def build(inv: Inventory, platform: str | None, view: QuietView | None = None) -> str:
    """Build the image with the local docker for ``platform`` and return its ID; ``view`` shows it."""
    run_build(build_argv(inv, platform), view or QuietView(), log_path())
    return local_id(inv)


def local_id(inv: Inventory) -> str:
    r = run_here(inspect_argv(inv.image.name, "{{.Id}}"))
    if not r.ok:
        raise RuntimeFailure(f"image {inv.image.name} is not in the local docker: {r.summary()}",
                             field="image.name", hint="build it, or drop --no-build")
    return r.stdout.strip()

