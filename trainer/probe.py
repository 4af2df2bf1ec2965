"""What the job's environment offers, printed as one ``PROBE {json}`` line.

``ddp-deploy check`` runs it before anything starts, where the job will run: in the image on
docker nodes (with the job's ``--gpus``), with the configured interpreter on host nodes (with
the job's ``CUDA_VISIBLE_DEVICES``). The operator's side judges the answer (deploy/preflight.py):
torch inside the supported range, and on GPU nodes CUDA usable on every device a process will
use. Only the standard library is imported before torch, so that a broken torch is reported
rather than crashing the probe.

    python -m trainer.probe --gpus 2 --procs 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings

INFINIBAND = "/dev/infiniband"


def probe(gpus: int, procs: int) -> dict:
    report: dict = {"python": platform.python_version(), "torch": None, "cuda_build": None,
                    "cuda_available": None, "devices": 0, "device_names": [], "nccl": None,
                    "cuda_error": None, "infiniband": sorted(os.listdir(INFINIBAND)) if os.path.isdir(INFINIBAND) else [],
                    "error": None}
    try:
        import torch
    except Exception as exc:  # a broken install is the answer, not a crash
        report["error"] = f"cannot import torch: {type(exc).__name__}: {exc}"
        return report
    report["torch"] = torch.__version__
    report["cuda_build"] = torch.version.cuda
    if gpus == 0:
        return report
    report.update(_cuda(torch, procs))
    return report


def _cuda(torch, procs: int) -> dict:
    """CUDA as the job would meet it: available, enough devices, and a kernel runs on each one
    a process will use (a driver too old for the image's CUDA fails here, not in the job)."""
    out: dict = {"cuda_available": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        said = [str(w.message).strip() for w in caught]
        out["cuda_error"] = said[0] if said else "no CUDA device visible"
        return out
    try:
        out["devices"] = torch.cuda.device_count()
        out["device_names"] = [torch.cuda.get_device_name(i) for i in range(out["devices"])]
        for i in range(min(procs, out["devices"])):
            torch.ones(1, device=f"cuda:{i}").add_(1).item()
        if torch.distributed.is_available() and torch.distributed.is_nccl_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # any CUDA failure is the answer, reported on its first line
        out["cuda_error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return out
    out["cuda_available"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs this node's processes use (0: a CPU node)")
    parser.add_argument("--procs", type=int, default=1, help="processes this node runs")
    args = parser.parse_args(argv)
    print("PROBE " + json.dumps(probe(args.gpus, args.procs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
