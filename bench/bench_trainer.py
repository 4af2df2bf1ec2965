"""Training throughput, side by side in one process, same model, batch size and device:

  (a) our trainer as ddp-deploy starts it, as a job of one process (tensors on the device, metrics
      reduced once per interval, a heartbeat per step, torch's flight recorder on; no DDP and no stop
      flag to agree on: a job of one process has no peers),
  (b) the tutorials' loop (torchvision MNIST files -> ToTensor/Normalize per sample -> DataLoader,
      DDP, loss.item() and an all-reduce of the loss every step),
  (c) a bare loop over tensors already normalised on the device (no DDP, no metrics): the limit.

Run: python bench/bench_trainer.py [--device cpu|cuda] [--rounds 3] [--steps 100] [--smoke]
It prints samples/s for each and the ratios a/c and a/b, and writes a JSON record to
bench/results/ (not with --smoke: tiny sizes, nothing written, which only proves that it runs; the
test suite runs it so, so that it cannot rot). Rounds are interleaved (a, b, c, a, b, c, ...); the ratios are the medians of
the per-round ratios, so that the machine's drift between rounds cancels out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import data, flight  # noqa: E402
from trainer.__main__ import make_context, torch_seed_per_rank  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.dist import setup  # noqa: E402
from agent.contract import HEARTBEAT_DIR_ENV  # noqa: E402
from trainer.loop import Position, train  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.stopping import StopSignal  # noqa: E402

MODEL, BATCH, TRAIN_SIZE = "convnet", 128, 32768


def ours(root: Path, device: str, steps: int, warmup: int) -> float:
    """Samples/s of the trainer's own loop, from its metrics intervals after the warm-up one."""
    ckpt = Path(tempfile.mkdtemp(dir=root))
    cfg = TrainConfig(dataset="synthetic", synthetic_size=TRAIN_SIZE, model=MODEL, batch_size=BATCH,
                      epochs=1, max_steps=warmup + steps, log_every=warmup if warmup else steps,
                      scheduler="constant", data_dir=str(root / "data"), ckpt_dir=str(ckpt), device=device)
    env = setup(cfg.device, cfg.backend)
    stop = StopSignal()
    stop.join(env)
    ctx = make_context(cfg, env, stop)
    torch_seed_per_rank(cfg, env)
    train(ctx, Position())
    intervals = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in intervals if r["kind"] == "train"][1:]
    samples = sum(r["samples_per_s"] * r["step_time_s"] * warmup for r in timed)
    seconds = sum(r["step_time_s"] * warmup for r in timed)
    return samples / seconds


def _write_idx(root: Path, images: torch.Tensor, labels: torch.Tensor) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    n = labels.numel()
    (raw / "train-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.numpy().tobytes())
    (raw / "train-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.to(torch.uint8).numpy().tobytes())
    for name, magic in (("t10k-images-idx3-ubyte", 2051), ("t10k-labels-idx1-ubyte", 2049)):
        header = struct.pack(">IIII", magic, 1, 28, 28) if magic == 2051 else struct.pack(">II", magic, 1)
        (raw / name).write_bytes(header + bytes(784 if magic == 2051 else 1))


def reference(root: Path, device: torch.device, steps: int, warmup: int) -> float:
    """The tutorials' loop, as they write it."""
    from torchvision import datasets, transforms

    train_set, _ = data.load("synthetic", str(root / "data"), TRAIN_SIZE)
    tv_root = root / "tv"
    if not (tv_root / "MNIST").exists():
        _write_idx(tv_root, train_set.images.squeeze(1), train_set.labels)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    dataset = datasets.MNIST(str(tv_root), train=True, download=False, transform=transform)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    kwargs = {"num_workers": 1, "pin_memory": True} if device.type == "cuda" else {}
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler, **kwargs)
    torch.manual_seed(0)
    model = DDP(build_model(MODEL, 1, 28, 10).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    sampler.set_epoch(0)
    start, done = None, 0
    for step, (x, y) in enumerate(loader):
        if step == warmup:
            start = time.perf_counter()
        if step == warmup + steps:
            break
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        running = reduced.item() / dist.get_world_size()  # noqa: F841  (what the tutorials print)
        done += y.numel() if step >= warmup else 0
    return done / (time.perf_counter() - start)


def bare(root: Path, device: torch.device, steps: int, warmup: int) -> float:
    """No DDP, no metrics, no data pipeline: batches sliced from normalised tensors on the device."""
    train_set, _ = data.load("synthetic", str(root / "data"), TRAIN_SIZE)
    x_all = data.Normalizer(data.SPECS["synthetic"], device)(train_set.images.to(device))
    y_all = train_set.labels.to(device)
    torch.manual_seed(0)
    model = build_model(MODEL, 1, 28, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for step in range(warmup + steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        lo = (step * BATCH) % (len(y_all) - BATCH)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x_all[lo:lo + BATCH]), y_all[lo:lo + BATCH]).backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * BATCH / (time.perf_counter() - start)


@contextlib.contextmanager
def one_rank(device: str, port: str):
    """This process as a launched job of one rank, as ddp-deploy starts one (with a heartbeat
    directory: agent/heartbeat/, trainer/flight.py), the synthetic dataset prepared in a scratch
    folder; yields (the DistEnv, the folder). Both folders and the process group go after."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    root = Path(tempfile.mkdtemp(prefix="ddp-bench-"))
    beats = tempfile.mkdtemp(prefix="ddp-bench-beats-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    os.environ[HEARTBEAT_DIR_ENV] = beats
    try:
        env = setup(device, "auto")
        data.prepare(env, "synthetic", str(root / "data"), TRAIN_SIZE, True)
        yield env, root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(beats, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, nothing written")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 2, 1

    with one_rank(args.device, "29533") as (env, root):
        results: dict[str, list[float]] = {"a_ours": [], "b_reference": [], "c_bare": []}
        for _ in range(args.rounds):
            results["a_ours"].append(ours(root, args.device, args.steps, args.warmup))
            results["b_reference"].append(reference(root, env.device, args.steps, args.warmup))
            results["c_bare"].append(bare(root, env.device, args.steps, args.warmup))
        med = {k: statistics.median(v) for k, v in results.items()}
        # Each round runs a, b, c back to back: the ratio within a round cancels the machine's drift
        # between rounds, so the headline ratios are the medians of the per-round ratios.
        paired = {
            "a_over_c": [a / c for a, c in zip(results["a_ours"], results["c_bare"])],
            "a_over_b": [a / b for a, b in zip(results["a_ours"], results["b_reference"])],
        }
        record = {
            "bench": "trainer", "device": str(env.device), "flight_recorder": flight.dumper(env.backend) is not None,
            "device_name": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "model": MODEL, "batch": BATCH,
            "steps": args.steps, "rounds": args.rounds, "samples_per_s": results, "median": med,
            "a_over_c": statistics.median(paired["a_over_c"]), "a_over_b": statistics.median(paired["a_over_b"]),
            "per_round": paired,
            "a_over_c_of_medians": med["a_ours"] / med["c_bare"], "a_over_b_of_medians": med["a_ours"] / med["b_reference"],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        for name, value in med.items():
            print(f"{name:12s} {value:10.1f} samples/s   rounds: {', '.join(f'{v:.1f}' for v in results[name])}")
        print(f"a/c = {record['a_over_c']:.3f}   a/b = {record['a_over_b']:.3f}   (medians of per-round ratios; "
              f"ratios of medians: {record['a_over_c_of_medians']:.3f}, {record['a_over_b_of_medians']:.3f})")
        if not args.smoke:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"trainer-{env.device.type}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
