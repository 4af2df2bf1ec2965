"""trainer/stopping.py with real gloo ranks: the stop flag's group gives up within the job's own
--dist-timeout, so a rank whose peer went silent leaves instead of waiting out torch's default."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# rank 1 joins the job and the flag's group, then goes silent; rank 0 asks the flag's question (in
# flight, as after every step) and waits for the answer
RANK = """
import os, sys, time
import torch
from trainer.dist import setup
from trainer.stopping import StopSignal
env = setup("cpu", "gloo", 10)
stop = StopSignal()
stop.join(env, 10)
if env.rank == 1:
    time.sleep(600)  # as a node whose link went down: its sockets open, nothing on them
time.sleep(1)
stop.requested(env)
started = time.monotonic()
try:
    stop.settle()  # the question in flight, as the run's end waits for it
except Exception as exc:
    print("settle raised", type(exc).__name__, flush=True)
print(f"left after {time.monotonic() - started:.1f} s", flush=True)
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_a_rank_whose_peer_went_silent_mid_stop_flag_question_leaves_in_dist_timeout():
    """A rank whose peer went silent with the stop flag's question in flight leaves within the dist
    timeout."""
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    started = time.monotonic()
    try:
        out, _ = procs[0].communicate(timeout=150)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    took = time.monotonic() - started
    assert "left after" in out, out[-3000:]
    # torch's default for a group made without a timeout is 30 min; the job's is 10 s here
    assert took < 120, out[-3000:]
