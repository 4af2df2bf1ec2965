"""``docker build``'s output read as steps and lines, for both of Docker's builders, told apart by
their output (:class:`BuildLog`):

- the classic builder (bookworm's docker 20.10, and any docker CLI without the buildx plugin):
  ``Step 3/5 : RUN ...``, then the step's output, then on failure one last line such as
  ``The command '/bin/sh -c ...' returned a non-zero code: 3``;
- BuildKit (buildx, or ``DOCKER_BUILDKIT=1`` with docker 20.10), asked for its ``plain``
  progress through ``BUILDKIT_PROGRESS``: ``#5 [2/4] RUN ...``, ``#5 0.123 <output>``,
  ``#5 ERROR: ...``; steps run in parallel and their lines interleave, keyed by ``#N``.

A failed build keeps the failing step's own output (its last :data:`FAILED_STEP_LINES` lines) and
names the step."""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

FAILED_STEP_LINES = 40
"""The failing step's last lines printed when a build fails."""
STDERR_LINES = FAILED_STEP_LINES // 4
"""Of those, at most this many earlier stderr lines (the classic builder's), before the last ones."""

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


