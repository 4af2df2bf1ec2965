"""The image's entrypoint: torchrun options, then ``--``, then trainer flags.

``python -m trainer.launch --nnodes 3 ... -- --dataset mnist`` runs
``torchrun --nnodes 3 ... -m trainer --dataset mnist``. Without ``--`` every argument is a
trainer flag and torchrun runs standalone on this machine: one process per visible GPU, or one
process on a CPU-only machine, or ``$NPROC_PER_NODE``. (``$DDP_DATA_DIR`` and ``$DDP_CKPT_DIR``,
set in the image to its volumes, are read by the trainer's config as defaults.)
"""

from __future__ import annotations

import os
import sys


def default_nproc() -> str:
    import torch

    return str(torch.cuda.device_count() or 1)


def torchrun_argv(args: list[str], environ: dict[str, str]) -> list[str]:
    if "--" in args:
        cut = args.index("--")
        launcher, trainer = args[:cut], args[cut + 1:]
    else:
        nproc = environ.get("NPROC_PER_NODE") or default_nproc()
        launcher, trainer = ["--standalone", "--nproc-per-node", nproc], args
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "trainer", *trainer]


def main() -> None:
    argv = torchrun_argv(sys.argv[1:], dict(os.environ))
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
