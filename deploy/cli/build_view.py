"""A build as the operator sees it (deploy/images/build.py runs it and tells its view)."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.text import Text

from ..images.build import QuietView
from ..images.build_log import BuildFailure, BuildLog, Step

if TYPE_CHECKING:
    from rich.live import Live

TAIL_LINES = 5
"""Lines of the running step shown under it on a terminal."""


class TerminalView(QuietView):
    """The running step and its last lines, redrawn in place on a terminal; elsewhere (CI logs,
    pipes) one line per Dockerfile step as it starts."""

    shows = True

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.live: Live | None = None
        self.lock = threading.Lock()
        self.step: Step | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.since = time.monotonic()

    def __enter__(self) -> "TerminalView":
        if self.console.is_terminal:
            from rich.live import Live  # a live display: only on a terminal, only while building

            self.live = Live(console=self.console, transient=True, refresh_per_second=8,
                             get_renderable=self._render)
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()

    def started(self, step: Step) -> None:
        with self.lock:
            self.step, self.since = step, time.monotonic()
            self.tail.clear()
        if self.live is None and step.instruction:
            self.console.print(Text(f"build {step.name}"), soft_wrap=True)

    def line(self, step: Step, text: str) -> None:
        """A line of ``step``'s own output."""
        with self.lock:
            if step is not self.step:
                self.step, self.since = step, time.monotonic()
                self.tail.clear()
            self.tail.append(text)

    def _render(self) -> Group:
        with self.lock:
            step, tail, since = self.step, list(self.tail), self.since
        head = Text(f"building {step.name if step else '...'}", no_wrap=True, overflow="ellipsis")
        head.append(f"  {time.monotonic() - since:.0f} s", style="dim")
        return Group(head, *(Text(f"  {line}", style="dim", no_wrap=True, overflow="ellipsis") for line in tail))

    def failed(self, failure: BuildFailure, log: Path) -> None:
        if failure.step is None:
            return
        earlier = f"; {failure.omitted} more lines in {log}" if failure.omitted else ""
        said = f"its output{earlier}:" if failure.output else "no output"
        self.console.print(Text(f"build failed at {failure.step} ({failure.summary()}), {said}"), soft_wrap=True)
        for line in failure.output:
            self.console.print(Text(f"  | {line}"), soft_wrap=True)

    def done(self, log: BuildLog, seconds: float, path: Path) -> None:
        steps = [s for s in log.steps.values() if s.instruction]
        cached = sum(s.cached for s in steps)
        by = {"classic": " by the classic builder", "buildkit": " by BuildKit"}.get(log.kind or "", "")
        self.console.print(Text(f"built in {seconds:.1f} s{by}: {len(steps)} steps, {cached} from the cache "
                                f"(log: {path})"), soft_wrap=True)
