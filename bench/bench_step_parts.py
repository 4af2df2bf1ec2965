"""What the trainer's step pays for: a ladder from the bare loop (bench_trainer's (c)) up to the
trainer's own step, one part added per rung, timed side by side in one process (one rank).

  bare      batches sliced from normalised tensors on the device (bench_trainer's (c))
  +gather   the trainer's batches: a gather of uint8 images by index, normalised per batch
  +stats    the running loss/accuracy kept on the device (trainer.metrics.RunningStats)
  +sched    autocast and GradScaler (both off, as in an fp32 run), the LR scheduler's step
  +beat     the heartbeat's write (agent.heartbeat, into a folder on /dev/shm)
  +stop     the stop flag (trainer.stopping.StopSignal.requested; a job of one process asks nobody)
  +log      the metrics interval every --log-every steps (an all-reduce, a sync, the record)
  trainer   trainer.loop.train itself, timed by its metrics intervals (bench_trainer's (a))
  bare+ddp  the bare loop with the model in DDP, in a group of one: the hooks and bucket copies
            that each process of a several-process job pays besides the all-reduce itself (the
            trainer wraps the model only when there are several processes)

Run: python bench/bench_step_parts.py [--device cpu|cuda] [--rounds 5] [--steps 200] [--smoke]
       [--profile]    (also prints torch.profiler's table of the trainer's own steps)
Rounds are interleaved; each rung's figure is the median of its per-round ratio to `bare`, so
the machine's drift cancels. The record goes to bench/results/step-parts-<device>.json (not with
--smoke).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_trainer  # noqa: E402
from trainer import data  # noqa: E402
from agent.contract import HEARTBEAT_DIR_ENV  # noqa: E402
from agent.heartbeat import Heartbeat  # noqa: E402
from trainer.metrics import IntervalTimer, RunningStats  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.stopping import StopSignal  # noqa: E402

RUNGS = ("bare", "+gather", "+stats", "+sched", "+beat", "+stop", "+log")
DDP_SIDE = "bare+ddp"
MODEL, BATCH, TRAIN_SIZE = bench_trainer.MODEL, bench_trainer.BATCH, bench_trainer.TRAIN_SIZE


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rung(level: int, env, stop: StopSignal, root: Path, steps: int, warmup: int, log_every: int,
         ddp: bool = False) -> float:
    """Samples/s of the loop with the first ``level + 1`` parts of RUNGS (and DDP, with ``ddp``)."""
    device = env.device
    has = lambda name: RUNGS.index(name) <= level  # noqa: E731
    train_set, _ = data.load("synthetic", str(root / "data"), TRAIN_SIZE)
    normalize = data.Normalizer(data.SPECS["synthetic"], device)
    images, labels = train_set.images.to(device), train_set.labels.to(device)
    x_all = normalize(images)
    torch.manual_seed(0)
    raw = build_model(MODEL, 1, 28, 10).to(device)
    model = DDP(raw, device_ids=[device.index] if device.type == "cuda" else None) if ddp else raw
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    stats, timer = RunningStats(device), IntervalTimer()
    beat = Heartbeat(os.environ[HEARTBEAT_DIR_ENV] if has("+beat") else None, env.local_rank, env.rank)
    order = torch.randperm(len(labels)).to(device)
    model.train()
    for step in range(warmup + steps):
        if step == warmup:
            sync(device)
            start = time.perf_counter()
        lo = (step * BATCH) % (len(labels) - BATCH)
        if has("+gather"):
            idx = order[lo:lo + BATCH]
            x, y = normalize(images[idx]), labels[idx]
        else:
            x, y = x_all[lo:lo + BATCH], labels[lo:lo + BATCH]
        autocast = torch.autocast(device.type, enabled=False) if has("+sched") else contextlib.nullcontext()
        with autocast:
            out = model(x)
            loss = F.cross_entropy(out, y)
        (scaler.scale(loss / 1) if has("+sched") else loss).backward()
        if has("+stats"):
            stats.add(loss, (out.argmax(1) == y).sum(), y.numel())
        if has("+sched"):
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if has("+sched"):
            scheduler.step()
        timer.tick()
        beat.beat(step)
        if has("+stop"):
            stop.requested(env)
        if has("+log") and (step + 1) % log_every == 0:
            totals = stats.reduce(env)
            json.dumps({"step": step, **totals, **timer.rates(totals["samples"])})
    sync(device)
    seconds = time.perf_counter() - start
    beat.close()
    return steps * BATCH / seconds


def profile_trainer(root: Path, device: str, steps: int) -> str:
    """torch.profiler's table (by self CPU time) of the trainer's own loop over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        bench_trainer.ours(root, device, steps, steps)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA") if device == "cuda" else 0
    return table + (f"\nCUDA kernels: {kernels} in {2 * steps} steps and the evaluation\n" if device == "cuda" else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, nothing written")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.log_every = 1, 4, 2, 2

    with bench_trainer.one_rank(args.device, "29534") as (env, root):
        stop = StopSignal()
        stop.join(env)  # as the trainer's: on nccl, a gloo group of its own
        names = (*RUNGS, "trainer", DDP_SIDE)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for level, name in enumerate(RUNGS):
                rates[name].append(rung(level, env, stop, root, args.steps, args.warmup, args.log_every))
            # the trainer's intervals are --log-every long; its warm-up is one interval
            rates["trainer"].append(bench_trainer.ours(root, args.device, args.steps, args.log_every))
            rates[DDP_SIDE].append(rung(0, env, stop, root, args.steps, args.warmup, args.log_every, ddp=True))
        ratio = {name: statistics.median(r / b for r, b in zip(rates[name], rates["bare"])) for name in names}
        median = {name: statistics.median(rates[name]) for name in names}
        print(f"{'rung':10s} {'samples/s':>10s} {'/bare':>6s} {'us/step':>8s} {'+us':>7s}")
        previous = None
        for name in names:
            us = 1e6 * BATCH / median[name]
            if name == DDP_SIDE:
                previous = 1e6 * BATCH / median["bare"]
            print(f"{name:10s} {median[name]:10.0f} {ratio[name]:6.3f} {us:8.1f} "
                  f"{'' if previous is None else f'{us - previous:+7.1f}'}")
            previous = us
        if args.profile:
            print(profile_trainer(root, args.device, args.steps))
        if not args.smoke:
            record = {"bench": "step-parts", "device": str(env.device), "torch": torch.__version__,
                      "device_name": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None,
                      "model": MODEL, "batch": BATCH, "steps": args.steps, "rounds": args.rounds,
                      "log_every": args.log_every, "samples_per_s": rates, "median": median, "over_bare": ratio,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"step-parts-{env.device.type}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
