"""torch's flight recorder, read from outside a hung process: which collective each rank is in.

py-spy tells the Python line a rank waits on; two ranks on the same line may still be in different
collectives (one a step behind). torch's flight recorder keeps each process group's collectives
with their sequence numbers, on NCCL and, on newer torch, on gloo. Only the process itself can dump
it, and a hung rank's main thread is inside a collective; but that wait releases the GIL, so a
thread of the rank's own can still answer.

Each worker of the built-in trainer runs :class:`FlightWatch` when the job has heartbeats
(agent/heartbeat/) and its torch records its backend's collectives. When ``fr-request`` in the
heartbeat directory holds a new token (``DIAGNOSE`` writes one), the thread writes
``fr-<LOCAL_RANK>`` there: one line ``TOKEN SEQ OP``, the newest collective of the default process
group (its sequence number and name, e.g. ``1234 all_reduce``). ``doctor`` and the watchdog read it beside the stacks
(deploy/observe/doctor.py). Where torch has no recorder for the backend (gloo before torch 2.7, say),
nothing is written and the stacks alone tell.
"""

from __future__ import annotations

import json
import os
import re
import threading

from agent import torch_private
from agent.contract import HEARTBEAT_DIR_ENV

REQUEST = "fr-request"
"""The file in the heartbeat directory whose change asks every worker for its newest collective."""
BUFFER = "256"
"""Entries the recorder keeps per process: only the newest is read."""
BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""The recorder's size: its name on newer torch, and on torch 2.5 (NCCL alone; newer torch warns on it)."""
_OP = re.compile(r"[a-z_]{1,40}")
_TOKEN = re.compile(r"[0-9A-Za-z_.-]{1,40}")


def dumper(backend: str | None):
    """torch's dump of its flight recorder for ``backend`` as JSON, or None where this torch has none."""
    return torch_private.flight_dump(backend)


def enable(backend: str | None, environ=os.environ) -> bool:
    """Before the process group exists, in a job with heartbeats: let torch record its collectives
    (unless the job set its own size). True where they will be readable."""
    if not environ.get(HEARTBEAT_DIR_ENV) or dumper(backend) is None:
        return False
    environ.setdefault(buffer_env(), BUFFER)
    return True


def buffer_env() -> str:
    """The variable this torch reads for the recorder's size."""
    return BUFFER_ENVS[0] if torch_private.flight_dump("gloo") is not None else BUFFER_ENVS[1]  # any backend's


def newest(dump: str) -> tuple[int, str] | None:
    """(sequence number, name) of the default process group's newest collective in a dump."""
    try:
        entries = json.loads(dump).get("entries") or []
    except (ValueError, AttributeError):
        return None
    found = None
    for e in entries:
        if not isinstance(e, dict):
            continue
        group = e.get("process_group") or ["0"]
        seq, name = e.get("collective_seq_id"), str(e.get("profiling_name", "")).rsplit(":", 1)[-1]
        if str(group[0]) != "0" or not isinstance(seq, int) or not _OP.fullmatch(name):
            continue
        if found is None or seq > found[0]:
            found = (seq, name)
    return found


class FlightWatch:
    """A worker's thread that answers ``fr-request`` (see the module's docstring): the request holds a
    token (a word the asker chose), the answer ``fr-<LOCAL_RANK>`` is ``TOKEN SEQ OP`` (``TOKEN none``
    where the recorder had nothing). Written at its start as ``- none``: the asker waits for the
    ranks that have such a file only."""

    def __init__(self, directory: str, local_rank: int, dump, every: float = 0.2) -> None:
        self.request = os.path.join(directory, REQUEST)
        self.answer = os.path.join(directory, f"fr-{local_rank}")
        self.dump, self.every = dump, every
        self._seen = self._token()
        self._stop = threading.Event()
        self._write("- none\n")

    @classmethod
    def start_for(cls, directory: str | None, local_rank: int, backend: str | None) -> "FlightWatch | None":
        dump = dumper(backend)
        if not directory or dump is None:
            return None
        watch = cls(directory, local_rank, dump)
        threading.Thread(target=watch.run, name="flight-recorder", daemon=True).start()
        return watch

    def _token(self) -> str | None:
        try:
            with open(self.request, "rb") as fh:
                word = fh.read(64).split(b"\n")[0].decode("ascii", "replace").strip()
        except OSError:
            return None
        return word if _TOKEN.fullmatch(word) else None

    def _write(self, line: str) -> None:
        tmp = f"{self.answer}.tmp"
        try:
            with open(tmp, "w") as fh:
                fh.write(line)
            os.replace(tmp, self.answer)
        except OSError:
            pass

    def check(self) -> bool:
        """One look; True when it answered a new request."""
        token = self._token()
        if token is None or token == self._seen:
            return False
        self._seen = token
        try:
            found = newest(self.dump(True, False))  # collectives, completed ones too
        except Exception:  # noqa: BLE001 (torch's dump may refuse; the stacks still tell)
            found = None
        self._write(f"{token} {found[0]} {found[1]}\n" if found else f"{token} none\n")
        return True

    def run(self) -> None:
        while not self._stop.wait(self.every):
            self.check()

    def close(self) -> None:
        self._stop.set()
