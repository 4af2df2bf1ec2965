"""How the job's lines look in a node's log; no torch here (the deploy tool reads them too).

Rank 0 prints each metrics record as ``METRICS {json}``. On a fleet, torchrun echoes every
worker's line with its global rank in front (trainer.launch tees them): ``[rank3]: ...``, twice
on an uncaught exception's lines, which torch prefixes as well.
"""

from __future__ import annotations

import json
import re

PREFIX = "METRICS "
RUN_ID_ENV = "DDP_LAUNCH_ID"
"""Set by ``ddp-deploy launch`` on every node: this launch's run id, new at every launch
(``ddp-deploy runs`` lists them; ``DDP_RUN_ID``, the rendezvous id, stays the same across
relaunches). The trainer tags each metrics record with it (``"run"``) and names the run's
TensorBoard directory after it."""
LOG_DIR_ENV = "DDP_DEPLOY_LOG_DIR"
"""Set by ``ddp-deploy launch`` for a container: the node's directory of the run on the shared
volume, where the launcher keeps a copy of its output (``log``) and its exit codes (``exits``)."""
RANK_PREFIXES = re.compile(r"^(?:\[rank(\d+)\]: ?)+")


def printed(text: str) -> list[dict]:
    """The records in printed output, in order: ``METRICS`` lines, with or without the rank in front."""
    out = []
    for line in text.splitlines():
        line = RANK_PREFIXES.sub("", line, count=1)
        if line.startswith(PREFIX):
            out.append(json.loads(line[len(PREFIX):]))
    return out
