"""Helpers for tests that run the real trainer: small configs, torchrun, MNIST-format files."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import torch
from procs import descendants_of, kill

SMALL = ["--synthetic-size", "512", "--batch-size", "16", "--eval-batch-size", "256",
         "--log-every", "4", "--epochs", "2"]
"""16 steps an epoch on 2 ranks, 32 on one. (The steps, not the samples, are what the tests count: a
step's fixed costs, the gradients' all-reduce and the optimizer, dominate a ConvNet step of 16
samples here, and half the samples of 1024 x 32 take about 45% less CPU for the same steps.)"""


def trainer_env(forked: bool = True) -> dict[str, str]:
    """The launcher's environment. ``forked``: its workers forked from a zygote, as the launcher
    does by default where no GPU can be opened (agent/zygote.py); False: started by torchrun, as
    on a GPU machine (``DDP_PREFORK=0``)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("DDP_PREFORK", None)
    if not forked:
        env["DDP_PREFORK"] = "0"
    return env


ROOT = Path(__file__).resolve().parents[1]


def torchrun_cmd(python: str, tmp: Path, *flags: str, nproc: int = 2) -> list[str]:
    """The launcher users run (torchrun in-process, standalone on this machine), then trainer flags."""
    return [python, "-m", "agent.launch", "--standalone", "--nproc-per-node", str(nproc), "--",
            "--data-dir", str(tmp / "data"), "--ckpt-dir", str(tmp / "ckpt"), *flags]


def run_torchrun(python: str, tmp: Path, *flags: str, nproc: int = 2, timeout: float = 300,
                 forked: bool = True) -> subprocess.CompletedProcess:
    """The launcher's run to its end. One that has not ended after ``timeout`` fails the test with
    its output and where each of its processes was (py-spy), then is killed with them."""
    cmd = torchrun_cmd(python, tmp, *flags, nproc=nproc)
    with subprocess.Popen(cmd, env=trainer_env(forked), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=ROOT) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = [proc.pid, *descendants_of(proc.pid)]
            stacks = "\n".join(_stack(pid) for pid in tree)
            kill(tree[::-1])
            out, err = proc.communicate()
            raise AssertionError(f"the launcher had not ended after {timeout} s: {cmd}\n--- its output:\n{out[-4000:]}\n"
                                 f"--- its errors:\n{err[-4000:]}\n--- where its processes were:\n{stacks}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _stack(pid: int) -> str:
    spy = Path(sys.executable).with_name("py-spy")
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            what = fh.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        dump = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        return f"{pid} {what}\n{dump.stdout}{dump.stderr}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{pid}: {exc}"


def metrics(ckpt_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt_dir / "final_model.pt", weights_only=True)


def write_idx_mnist(root: Path, folder: str = "MNIST", train: int = 600, test: int = 200, seed: int = 0) -> None:
    """MNIST-format IDX files (uncompressed, as torchvision keeps them after download) with a
    learnable pattern per class, so that torchvision's own reader loads them."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.rand(10, 28, 28, generator=gen)
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", train), ("t10k", test)):
        labels = torch.randint(0, 10, (n,), generator=gen)
        images = ((0.8 * patterns[labels] + 0.2 * torch.rand(n, 28, 28, generator=gen)) * 255).to(torch.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.numpy().tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.to(torch.uint8).numpy().tobytes())
