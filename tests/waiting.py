"""Waiting on an event in a test: a predicate polled until it holds, or a failure naming what never came."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5):
    """``predicate()``'s first true value; an AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(interval)
