"""tests/procs.py: the suite's own view of this machine's processes."""

from __future__ import annotations

import os
import subprocess

from procs import alive, kill_runs_under


def test_a_run_left_under_a_test_s_directory_is_killed_and_a_neighbour_s_is_not(tmp_path):
    mine, other = tmp_path / "run", tmp_path.with_name(tmp_path.name + "-other")
    left = subprocess.Popen(["sleep", "60"], env={**os.environ, "DDP_DEPLOY_RUN": f"{mine}/nas/ckpt/here"})
    spared = subprocess.Popen(["sleep", "60"], env={**os.environ, "DDP_DEPLOY_RUN": f"{other}/nas/ckpt/here"})
    try:
        assert kill_runs_under(mine) == [left.pid]
        assert left.wait(timeout=10) == -9 and alive(spared.pid)
    finally:
        for p in (left, spared):
            p.kill()
            p.wait()
