"""A user program that hangs, for the stall tests on this machine and on the cluster."""

from __future__ import annotations

# A job that hangs: global rank ``rank`` stops taking part (it sleeps, or does ``fault``: one line)
# before the all-reduce of step 5, the others wait in it. Every rank writes the documented one-line
# heartbeat (README, "When a job hangs") after each step, rank 0 a METRICS line. Its fault is line 7,
# the all-reduce line 8.
HANGS = """\
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, t = dist.get_rank(), torch.zeros(1)
for step in range(1, 100000):
    if step == 5 and rank == {rank}:
        {fault}
    dist.all_reduce(t)
    open(f"{{os.environ['DDP_HEARTBEAT_DIR']}}/{{os.environ['LOCAL_RANK']}}", "w").write(f"{{step}} {{os.environ['RANK']}}\\n")
    if rank == 0:
        print('METRICS {{"kind": "train", "step": %d}}' % step, flush=True)
    time.sleep({pause})
"""


def hanging_program(rank: int, pause: float, fault: str = "time.sleep(3600)", own_beat: bool = True) -> str:
    """:data:`HANGS` with the rank that hangs, how (one line) and the pause between steps; without
    ``own_beat``, it writes no heartbeat and prints nothing (its lines keep their numbers): a
    program that knows nothing of this bundle, which the launcher's progress hook beats for."""
    program = HANGS.format(rank=rank, pause=pause, fault=fault)
    if not own_beat:
        lines = program.splitlines(keepends=True)
        lines[8:11] = ["    # no heartbeat of its own\n", "    # and no output\n", "    pass\n"]
        program = "".join(lines)
    return program
