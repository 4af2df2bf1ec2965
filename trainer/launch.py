"""The image's entrypoint: torchrun options, then ``--``, then trainer flags.

``launch.py --nnodes 3 ... -- --dataset mnist`` runs
``torchrun --nnodes 3 ... -m trainer --dataset mnist``. Without ``--`` every argument is a
trainer flag and torchrun runs standalone on this machine with one process per GPU (or per
CPU core when there is none), or ``$NPROC_PER_NODE`` processes when that is set.
"""

from __future__ import annotations

import os
import sys


def torchrun_argv(args: list[str], environ: dict[str, str]) -> list[str]:
    if "--" in args:
        cut = args.index("--")
        launcher, trainer = args[:cut], args[cut + 1:]
    else:
        launcher = ["--standalone", "--nproc-per-node", environ.get("NPROC_PER_NODE", "auto")]
        trainer = args
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "trainer", *trainer]


def main() -> None:
    argv = torchrun_argv(sys.argv[1:], dict(os.environ))
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
