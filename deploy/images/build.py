"""The training image's build here, for the nodes' platform, shown as it runs.

``docker build`` runs with its output read line by line (:func:`run_build`) and told to a view as
steps and lines (:class:`QuietView`'s methods; the CLI's shows the step that runs and a short
tail of its output, deploy/cli/build_view.py), the whole output goes to a file (:func:`log_path`),
and a failed build keeps the failing step's own output (its last :data:`FAILED_STEP_LINES` lines)
and names the step.

Both of Docker's builders are read (:class:`BuildLog`), told apart by their output:

- the classic builder (bookworm's docker 20.10, and any docker CLI without the buildx plugin):
  ``Step 3/5 : RUN ...``, then the step's output, then on failure one last line such as
  ``The command '/bin/sh -c ...' returned a non-zero code: 3``;
- BuildKit (buildx, or ``DOCKER_BUILDKIT=1`` with docker 20.10), asked for its ``plain``
  progress through ``BUILDKIT_PROGRESS``: ``#5 [2/4] RUN ...``, ``#5 0.123 <output>``,
  ``#5 ERROR: ...``; steps run in parallel and their lines interleave, keyed by ``#N``.

The platform: every node's (``docker version``'s ``Server.Os/Server.Arch``; ``uname -sm`` on the
host runtime, in Docker's names) must be the same (one image serves one platform), the build
passes it as ``--platform`` (accepted by both builders; the classic builder cannot build for
another architecture than its daemon's, and may even tag its own), and the image's own platform
(``docker image inspect``) must equal the nodes' before anything is shipped: an image of another
architecture would only fail later with "exec format error" in the job's restart loop.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RuntimeFailure
from ..inventory import Inventory
from ..nodes.remote import Remote, command_line, run_here

LOG_ENV = "DDP_DEPLOY_BUILD_LOG"
"""The whole output of the last build (default: build.log beside the debug log)."""
FAILED_STEP_LINES = 40
"""The failing step's last lines printed when a build fails."""
STDERR_LINES = FAILED_STEP_LINES // 4
"""Of those, at most this many earlier stderr lines (the classic builder's), before the last ones."""

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


def inspect_argv(name: str, fmt: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", fmt, name]


IMAGE_PLATFORM = "{{.Os}}/{{.Architecture}}"

NODE_PLATFORM_ARGV = {
    "docker": ("docker", "version", "--format", "{{.Server.Os}}/{{.Server.Arch}}"),
    "host": ("uname", "-sm"),
}
"""What tells a node's platform, by runtime: the engine's for containers, the kernel's otherwise."""


def node_platform_argv(inv: Inventory) -> tuple[str, ...]:
    return NODE_PLATFORM_ARGV[inv.job.runtime]


def log_path() -> Path:
    if os.environ.get(LOG_ENV):
        return Path(os.environ[LOG_ENV])
    debug = os.environ.get("DDP_DEPLOY_LOG")
    return Path(debug).with_name("build.log") if debug else Path.home() / ".cache" / "ddp-deploy" / "build.log"


# ------------------------------------------------------------------ platforms

UNAME_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm",
              "armv6l": "arm", "i386": "386", "i686": "386", "ppc64le": "ppc64le", "s390x": "s390x",
              "riscv64": "riscv64"}
"""``uname -m`` -> Docker's (Go's) architecture names."""

_PLATFORM = re.compile(r"[a-z0-9]+/[a-z0-9]+")


def parse_platform(text: str) -> str | None:
    """``linux/amd64`` (docker) or ``Linux x86_64`` (uname -sm) -> ``linux/amd64``; None if neither."""
    text = text.strip()
    if _PLATFORM.fullmatch(text):
        return text
    words = text.split()
    if len(words) == 2 and words[1] in UNAME_ARCH:
        return f"{words[0].lower()}/{UNAME_ARCH[words[1]]}"
    return None


def node_platforms(inv: Inventory, remote: Remote) -> dict[str, str]:
    """Every node's platform (one short command each)."""
    argv = node_platform_argv(inv)
    results = remote.run_all(argv, what="reading the platform", timeout=60,
                             hint=f"`{' '.join(argv)}` must work on the node")
    out, bad = {}, {}
    for node, r in results.items():
        platform = parse_platform(r.stdout)
        if platform is None:
            bad[node] = r
        out[node] = platform
    if bad:
        raise RuntimeFailure(f"cannot tell the platform of {', '.join(bad)} from "
                             f"`{' '.join(argv)}`: {next(iter(bad.values())).stdout.strip()!r}")
    return out


def mixed(platforms: Mapping[str, str]) -> str | None:
    """None when every node has the same platform, else the nodes of each, in one line."""
    by: dict[str, list[str]] = {}
    for node, platform in platforms.items():
        by.setdefault(platform, []).append(node)
    if len(by) < 2:
        return None
    return "; ".join(f"{', '.join(nodes)}: {platform}" for platform, nodes in by.items())


def one_platform(platforms: Mapping[str, str]) -> str:
    """The nodes' one platform; nodes of several are refused (one image serves one platform)."""
    kinds = mixed(platforms)
    if kinds:
        raise RuntimeFailure(f"the nodes are of different platforms ({kinds}) and one image serves one "
                             "platform", hint="run the job on nodes of one platform: leave the others out "
                                              "with --without NODE, or give each platform its own hosts.yaml")
    return next(iter(platforms.values()))


def image_platform(name: str) -> str:
    r = run_here(inspect_argv(name, IMAGE_PLATFORM))
    platform = parse_platform(r.stdout) if r.ok else None
    if platform is None:
        raise RuntimeFailure(f"cannot read the platform of {name} here: {r.summary()}", field="image.name")
    return platform


def local_platform() -> str | None:
    """This machine's docker engine's platform (what its classic builder builds for)."""
    r = run_here(NODE_PLATFORM_ARGV["docker"])
    return parse_platform(r.stdout) if r.ok else None


CROSS_BUILD = ("building for another architecture needs BuildKit (the docker buildx plugin) and qemu "
               "registered with binfmt_misc (`docker run --privileged --rm tonistiigi/binfmt --install all`, "
               "or the qemu-user-static package), or a build machine of the nodes' platform")


OTHER_PLATFORM = "does not match the specified platform"
"""The classic builder's error for a --platform other than its daemon's."""


def refuse_other_platform(inv: Inventory, platforms: Mapping[str, str], *, built: bool) -> str:
    """The image's platform, when it is every node's; else refused naming the nodes and both
    platforms (nothing has been shipped yet)."""
    have = image_platform(inv.image.name)
    wrong = [n for n, p in platforms.items() if p != have]
    if not wrong:
        return have
    want = platforms[wrong[0]]
    if built:
        here = local_platform()
        hint = (f"docker build --platform {want} gave an image of {have}"
                + (f" (this machine's docker is {here})" if here else "") + f": {CROSS_BUILD}")
    else:
        hint = f"drop --no-build: deploy builds it with --platform {want}; {CROSS_BUILD}"
    raise RuntimeFailure(f"image {inv.image.name} is {have} but {', '.join(wrong)} "
                         f"{'is' if len(wrong) == 1 else 'are'} {want}: nothing shipped", hint=hint)


# ------------------------------------------------------------------ reading the output

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_RED, _RESET = "\x1b[91m", "\x1b[0m"
"""How the classic builder marks what a step wrote to stderr (even into a pipe)."""
_CLASSIC_STEP = re.compile(r"Step (\d+)/(\d+) : (.*)")
_CLASSIC_NOISE = re.compile(r" ---> (Running in [0-9a-f]+|[0-9a-f]{12}|Using cache)$|Removing intermediate container ")
_CLASSIC_AFTER = re.compile(r"Successfully (built|tagged) ")
_BUILDKIT = re.compile(r"#(\d+) (.*)")
_STAMP = re.compile(r"\d+\.\d+(?: |$)")
_EXIT = re.compile(r"(?:exit code: |returned a non-zero code: )(\d+)\s*$")


def clean(raw: bytes) -> str:
    """One line of output as text: only what a carriage return left shown (colours stay: they
    mark the classic builder's stderr; :func:`plain` drops them)."""
    text = raw.decode(errors="replace").rstrip("\r\n")
    if "\r" in text:
        text = next((part for part in reversed(text.split("\r")) if part), "")
    return text


def plain(text: str) -> str:
    return _ANSI.sub("", text)


@dataclass
class Step:
    key: str
    """``#5`` (BuildKit) or ``3/5`` (classic)."""
    name: str
    """``[2/4] RUN ...``, ``[internal] load ...``; the classic builder's ``[3/5] RUN ...``."""
    lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=FAILED_STEP_LINES + 1))
    """The last lines of output as (number, text) (one more than shown: the classic builder's
    error line comes last)."""
    stderr: collections.deque = field(default_factory=lambda: collections.deque(maxlen=STDERR_LINES))
    """The last lines the classic builder marked as the step's stderr, as (number, text): they
    can arrive well before the stdout written before them, out of the last lines' reach."""
    count: int = 0
    """Lines of output in all."""
    cached: bool = False
    error: str | None = None

    @property
    def instruction(self) -> bool:
        """A Dockerfile instruction, not the builder's own work (``[internal]``, exporting)."""
        return self.name.startswith("[") and not self.name.startswith("[internal]")

    def add(self, text: str, stderr: bool = False) -> str:
        self.lines.append((self.count, text))
        if stderr:
            self.stderr.append((self.count, text))
        self.count += 1
        return text

    def drop_last(self) -> None:
        """The last line was the builder's error, not the step's output."""
        number, _ = self.lines.pop()
        if self.stderr and self.stderr[-1][0] == number:
            self.stderr.pop()
        self.count -= 1

    def shown(self) -> tuple[list[str], int]:
        """At most FAILED_STEP_LINES lines: its stderr lines that came before the last lines
        (then ``…``), then its last lines; and how many lines are not shown."""
        last = list(self.lines)[-FAILED_STEP_LINES:]
        first = last[0][0] if last else self.count
        early = [text for number, text in self.stderr if number < first]
        if not early:
            return [text for _, text in last], self.count - len(last)
        last = last[len(early) + 1:]
        return [*early, "…", *(text for _, text in last)], self.count - len(early) - len(last)


@dataclass(frozen=True)
class BuildFailure:
    step: str | None
    """The failing step's name; None when the build failed before any step (its context, its options)."""
    output: tuple[str, ...]
    """The step's last lines of output (after its earlier stderr lines and ``…``, if any)."""
    omitted: int
    """Lines of the step not in ``output``."""
    error: str
    exit_code: int

    def summary(self) -> str:
        """``exit code 3`` for a command that failed, else the builder's own error."""
        m = _EXIT.search(self.error)
        return f"exit code {m[1]}" if m else self.error


class BuildLog:
    """``docker build``'s output -> its steps and, when it failed, the failing one; either builder."""

    def __init__(self) -> None:
        self.kind: str | None = None
        """``classic`` or ``buildkit``, from the first line that tells."""
        self.steps: dict[str, Step] = {}
        self.current: Step | None = None
        """The step the last line belonged to."""
        self.outside: collections.deque[str] = collections.deque(maxlen=FAILED_STEP_LINES)
        """The last lines that belong to no step (preamble, BuildKit's closing error summary)."""
        self.last = ""
        self.red = False
        """Inside the classic builder's stderr colour."""
        self.added: str | None = None
        """What the last line added to its step's output (None: it was the builder's own)."""

    def feed(self, line: str) -> Step | None:
        """One line (colours and all); returns the step it belongs to (None if none), a new one
        when it starts one."""
        self.added = None
        stderr = self._colour(line)
        text = plain(line)
        if text.strip():
            self.last = text
        if self.kind is None:
            if _CLASSIC_STEP.match(text):
                self.kind = "classic"
            elif _BUILDKIT.match(text):
                self.kind = "buildkit"
        if self.kind == "classic":
            return self._classic(text, stderr)
        if self.kind == "buildkit":
            return self._buildkit(text)
        self.outside.append(text)
        return None

    def _colour(self, line: str) -> bool:
        """Whether any of the line was written in the stderr colour (which may span lines)."""
        red = False
        for part in re.split(r"(\x1b\[[0-9;?]*[A-Za-z])", line):
            if part == _RED:
                self.red = True
            elif part == _RESET:
                self.red = False
            elif part and not _ANSI.fullmatch(part):
                red |= self.red and bool(part.strip())
        return red

    def _classic(self, text: str, stderr: bool) -> Step | None:
        m = _CLASSIC_STEP.match(text)
        if m:
            self.current = self.steps[f"{m[1]}/{m[2]}"] = Step(f"{m[1]}/{m[2]}", f"[{m[1]}/{m[2]}] {m[3]}")
            return self.current
        if _CLASSIC_AFTER.match(text) or self.current is None:
            self.outside.append(text)
            return None
        if _CLASSIC_NOISE.match(text):
            self.current.cached |= text.endswith("Using cache")
        elif text.strip():
            self.added = self.current.add(text, stderr)
        return self.current

    def _buildkit(self, text: str) -> Step | None:
        m = _BUILDKIT.match(text)
        if not m:
            if text.strip():
                self.outside.append(text)
            return None
        key, rest = f"#{m[1]}", m[2]
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = Step(key, rest)
        elif rest in ("CACHED",):
            step.cached = True
        elif rest.startswith("ERROR: "):
            step.error = rest[len("ERROR: "):]
        elif rest.startswith("sha256:") or rest.startswith("DONE ") or rest in ("CANCELED", "...", step.name):
            pass
        else:
            stamp = _STAMP.match(rest)
            self.added = step.add(rest[stamp.end():] if stamp else rest)
        self.current = step
        return step

    def failure(self, exit_code: int) -> BuildFailure:
        """What failed, once the build exited with ``exit_code`` (not 0)."""
        if self.kind == "buildkit":  # the step that says ERROR; the closing summary's last ERROR line
            step = next((s for s in self.steps.values() if s.error is not None), None)
            closing = [line for line in self.outside if line.strip()]
            errors = [line[len("ERROR: "):] for line in closing if line.startswith("ERROR: ")]
            error = (errors or closing or [step.error if step else ""])[-1]
        else:  # the step that ran last; the builder's error is the last line
            step = self.current
            error = self.last.strip()
            if step is not None and step.lines and step.lines[-1][1] == self.last:
                step.drop_last()
        error = error or f"docker build exited with {exit_code}"
        if step is None:
            return BuildFailure(None, (), 0, error, exit_code)
        shown, omitted = step.shown()
        return BuildFailure(step.name, tuple(shown), omitted, error, exit_code)


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

