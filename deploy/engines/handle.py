"""A job and its runs as objects a program holds, the same for an SSH fleet and for Slurm.

``api("hosts.yaml")`` (deploy/engines/choose.py) gives the job of an inventory (a
:class:`~deploy.engines.fleet.Fleet` or a :class:`~deploy.engines.slurmjob.SlurmJob`, whichever it
needs); used in ``with``, it keeps its connections to the nodes (or the login node) open until the
block ends, instead of one per call.
``job.launch()`` returns a :class:`Run`: its status, its end as an :class:`Outcome` (a failure is
data, not an exception), its log lines as an iterator, its stop and its diagnosis::

    from deploy.engines.choose import api

    with api("hosts.yaml") as job:
        print(job.plan())              # what launch runs (the SSH fleet's plan; Slurm's batch script)
        run = job.launch()
        print(run.wait().state)        # finished, failed, stopped, lost, or running (past the timeout)
        for line in run.logs(tail=20):
            print(line.node, line.rank, line.text)

(docs/fleet.md has the whole example, which a test runs.)
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import JobStopped, LostContact, RuntimeFailure, StillRunning
from ..nodes.remote import Remote


class JobApi:
    """What the SSH fleet's and Slurm's APIs share: one connection to the job's machines, kept from
    ``with`` to its end (a call outside a ``with``, or from another thread, opens its own and
    closes it), and the job's runs as :class:`Run` handles."""

    inv = None
    _remote: Remote | None = None
    _owner: int | None = None

    def __enter__(self):
        if self._remote is not None:
            raise RuntimeError("already connected: one `with` at a time")
        remote = Remote(self.inv)
        self._remote, self._owner = remote.__enter__(), threading.get_ident()
        return self

    def __exit__(self, *exc) -> None:
        remote, self._remote = self._remote, None
        if remote is not None:
            remote.__exit__(*exc)

    @contextlib.contextmanager
    def connected(self) -> Iterator[Remote]:
        if self._remote is not None and self._owner == threading.get_ident():
            yield self._remote
            return
        with Remote(self.inv) as remote:
            yield remote

    def run(self, run_id: str | None = None) -> "Run":
        """A kept run (by its id, or the newest), to follow, read or stop; a RuntimeFailure where
        the job has none of that id."""
        kept = self.runs()
        found = [r for r in kept if run_id is None or r.id == run_id]
        if not found:
            raise RuntimeFailure(f"job {self.inv.job.name} has no kept run {run_id or ''}".rstrip(),
                                 hint="`ddp-deploy runs` lists them")
        return Run(self, found[-1].id)


@dataclass(frozen=True)
class Outcome:
    """How a run ended: ``finished`` (what the verdict says of it), ``failed`` (the first failure,
    or that nothing shows it trained), ``stopped`` (by ``stop``), ``running`` (still, past the
    timeout), ``lost`` (too many nodes stopped answering)."""

    state: str
    detail: str
    hint: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "finished"


LOG_QUEUE = 10_000
"""Log lines read ahead of the program that iterates over them (a log can outgrow memory)."""


class Run:
    """One run of the job: its id, and what a program asks of it. ``job`` is the Fleet or
    SlurmJob it belongs to (their verbs are the same)."""

    def __init__(self, job, run_id: str, started=None) -> None:
        self.job, self.id = job, run_id
        self.started = started
        """What the launch said of it (the fleet's Started, Slurm's Submitted); None for a kept run."""

    def __repr__(self) -> str:
        return f"Run({self.job.inv.job.name!r}, {self.id!r})"

    def status(self) -> dict:
        """Every node's state now (running, exited(N), stalled, unreachable, ...)."""
        return self.job.states()

    def wait(self, timeout: float | None = None) -> Outcome:
        """Its end, once every node's part has ended (or ``timeout`` seconds have passed)."""
        try:
            final = self.job.wait(timeout=timeout)
            return Outcome("finished", self.job.verdict(final))
        except JobStopped as e:
            return Outcome("stopped", str(e), e.hint)
        except StillRunning as e:
            return Outcome("running", str(e), e.hint)
        except LostContact as e:
            return Outcome("lost", str(e), e.hint)
        except RuntimeFailure as e:
            return Outcome("failed", str(e), e.hint)

    def logs(self, *, tail: int | None = None, nodes: tuple[str, ...] = (), ranks: tuple[int, ...] = (),
             follow: bool = False) -> Iterator:
        """Its log lines (node, rank, text; secrets masked) as they are read, none held but the
        next :data:`LOG_QUEUE`; ``follow``: until the job ends or the iteration stops."""
        lines: queue.Queue = queue.Queue(LOG_QUEUE)
        done = object()
        failed: list[BaseException] = []
        stopping = threading.Event()

        def put(line) -> None:
            while not stopping.is_set():
                try:
                    lines.put(line, timeout=0.5)
                    return
                except queue.Full:
                    continue
            raise _Abandoned

        def read() -> None:
            try:
                self.job.logs(tail=tail, nodes=nodes, ranks=ranks, run=self.id, follow=follow, on_line=put)
            except _Abandoned:
                pass
            except BaseException as e:  # raised in the iterating thread, below
                failed.append(e)
            finally:
                with contextlib.suppress(_Abandoned):
                    put(done)

        reader = threading.Thread(target=read, name=f"logs-{self.id}", daemon=True)
        reader.start()
        try:
            while (line := lines.get()) is not done:
                yield line
        finally:
            stopping.set()
        if failed:
            raise failed[0]

    def stop(self, *, now: bool = False):
        """Ends it: SIGTERM and a checkpoint first (``now``: at once); each node's answer."""
        return self.job.stop(now=now)

    def doctor(self):
        """What every rank is doing, grouped by where they wait (a hung job)."""
        return self.job.doctor()


class _Abandoned(Exception):
    """The program stopped iterating: the reader ends."""
