"""Run one call per node in parallel, and turn whatever a node's call raised into its Result."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .transport import NodeError, Result

log = logging.getLogger(__name__)
T = TypeVar("T")


def outcome(node: str, fn: Callable[..., Result], *args) -> Result:
    """``fn(*args)``, or the failed :class:`Result` that names why: the one place where an
    exception becomes a node's result, so one node's surprise never hides the others'."""
    try:
        return fn(*args)
    except NodeError as e:
        return Result(node, None, error=str(e))
    except TimeoutError:
        return Result(node, None, error="timed out")
    except (OSError, EOFError) as e:
        return Result(node, None, error=f"connection lost: {str(e) or type(e).__name__}")
    except Exception as e:
        log.debug("unexpected error on %s", node, exc_info=True)
        return Result(node, None, error=f"{type(e).__name__}: {e}")


def fan_out(work: Mapping[str, T], fn: Callable[[str, T], Result], *, max_workers: int = 32,
            on_abort: Callable[[], None] = lambda: None) -> dict[str, Result]:
    """``fn(node, work[node])`` for every node at once, one thread each (at most ``max_workers``).

    On Ctrl-C (or any exception) while threads still wait on nodes (a follow, a dead node),
    ``on_abort`` closes what they read from, so that one Ctrl-C ends them all now.
    """
    if not work:
        return {}
    pool = ThreadPoolExecutor(max_workers=min(max_workers, len(work)), thread_name_prefix="remote")
    try:
        futures = {node: pool.submit(outcome, node, fn, node, item) for node, item in work.items()}
        results = {node: f.result() for node, f in futures.items()}
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        on_abort()
        raise
    pool.shutdown()
    return results
