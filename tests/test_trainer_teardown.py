"""trainer/dist.py's teardown: leaving the process group, bounded. A rank whose teardown hangs
(here torch's destroy_process_group never returning; under torch 2.5 a finished run's worker once
never ended after its last barrier) ends with the code it was about to end with and says so, instead of
showing as running while the rest of the job waits on it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A one-rank gloo group; argv: the teardown's bound (s), how destroy_process_group ends (returns,
# hangs, or hangs holding the GIL), the code a hung teardown ends with. Prints "LEFT" once teardown
# returned, "STILL" once past the bound.
PROGRAM = textwrap.dedent("""
    import ctypes, sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    import torch.distributed as dist
    from trainer import dist as tdist
    bound, how, code = float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    tdist.TEARDOWN_S, tdist.BACKSTOP_S = bound, 1.0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if how == "hangs":
        dist.destroy_process_group = lambda *a, **k: time.sleep(600)
    elif how == "holds":  # a C call made with the GIL held: no Python thread runs while it lasts
        dist.destroy_process_group = lambda *a, **k: ctypes.PyDLL(None).sleep(600)
    env = tdist.DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                        backend="gloo")
    print("TEARING DOWN", flush=True)
    tdist.teardown(env, finished=True, hung_exit=code)
    print("LEFT", flush=True)
    time.sleep(bound * 1.5)  # past the bound: a teardown that returned is not ended by its watch
    print("STILL", flush=True)
""")


def _teardown(bound: float, how: str, code: int) -> tuple[subprocess.CompletedProcess, float]:
    p = subprocess.Popen([sys.executable, "-c", PROGRAM, str(ROOT), str(bound), how, str(code)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "TEARING DOWN\n", p.stderr.read()
    began = time.monotonic()
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), time.monotonic() - began


# how the hang ends the rank: the Python watch at the bound; where the hang holds the GIL, no Python
# thread runs while it lasts and the C library's timers end it BACKSTOP_S (1 s here) later
HANGS = {"hangs": (2.0, ""), "holds": (3.0, " (holding the interpreter)")}


@pytest.mark.parametrize("how", list(HANGS))
@pytest.mark.parametrize("code", [0, 75])
def test_a_rank_whose_teardown_hangs_ends_after_the_bound_with_its_code_and_says_so(code, how):
    """A rank whose teardown hangs ends after the bound, with the code it was ending with, and says so."""
    after, said = HANGS[how]
    r, took = _teardown(2.0, how, code)
    assert r.returncode == code, r.stderr
    assert "LEFT" not in r.stdout
    assert (f"trainer: rank 0: leaving the process group took over {after:g} s (hung in torch's teardown{said}): "
            f"this process ends without it, with exit {code}") in r.stderr
    assert took >= after


def test_a_teardown_that_returns_leaves_the_process_running_past_the_bound():
    r, _ = _teardown(1.0, "returns", 9)
    assert (r.returncode, r.stdout.split()) == (0, ["LEFT", "STILL"]), r.stderr
    assert "hung" not in r.stderr
