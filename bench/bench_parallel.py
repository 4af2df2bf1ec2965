"""The tutorials' comparison of ways to use several GPUs on one node, side by side in one run:
the same model (ResNet-50), the same global batch, the same timed loop of forward, backward and
optimizer step on tensors already on the device:

  dp            nn.DataParallel over every GPU, one process (the batch scattered each step)
  ddp           DDP, one process per GPU
  ddp-stages    DDP, one process per pair of GPUs, the model split into 2 stages (--stages 2)
  ddp-pipeline  the same, each batch pipelined through the stages in micro-batches (--micro-batches)

Run: python bench/bench_parallel.py [--device cuda|cpu] [--steps 20] [--warmup 5] [--smoke] [--out DIR]
It prints samples/s for each way and its ratio to ddp, and writes bench/results/parallel-<device>.json
(not with --smoke: tiny sizes on the CPU, nothing written, which only proves that it runs; the test
suite runs it so, so that it cannot rot). With fewer than 2 GPUs, or an odd count, it says why and
exits 2: a comparison of one device with itself would be no comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.dist import DistEnv, pick_device  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.stages import Staged  # noqa: E402

WAYS = ("dp", "ddp", "ddp-stages", "ddp-pipeline")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(step, steps: int, warmup: int, sync) -> float:
    for _ in range(warmup):
        step()
    sync()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - began


def _sync(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _model(args) -> nn.Module:
    torch.manual_seed(0)
    return build_model(args.model, 3, args.size, 10)


def _batch(n: int, args, device: torch.device):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 3, args.size, args.size, generator=g).to(device),
            torch.randint(0, 10, (n,), generator=g).to(device))


def _train_step(model: nn.Module, optimizer, x, y):
    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


def data_parallel(args, devices: int) -> float:
    first = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    model = _model(args).to(first)
    if args.device == "cuda":
        model = nn.DataParallel(model, device_ids=list(range(devices)))
    x, y = _batch(args.batch, args, first)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return args.batch * args.steps / _timed(_train_step(model, optimizer, x, y), args.steps, args.warmup,
                                            _sync(args.device))


def _ddp_worker(rank: int, world: int, port: int, args, stages: int, micro: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if args.device == "cuda" else "gloo"
    # the trainer's own layout: rank r owns the `stages` devices from cuda:r*stages
    devices = DistEnv(rank, rank, world, world, pick_device(args.device, rank, world, stages), backend, stages).devices
    if args.device == "cuda":
        torch.cuda.set_device(devices[0])
    dist.init_process_group(backend, rank=rank, world_size=world)
    model = _model(args).to(devices[0])
    local = Staged(model, devices, micro) if stages > 1 else model
    ids = [devices[0].index] if args.device == "cuda" and stages == 1 else None
    ddp = DDP(local, device_ids=ids)
    x, y = _batch(args.batch // world, args, devices[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seconds = _timed(_train_step(ddp, optimizer, x, y), args.steps, args.warmup, _sync(args.device))
    took = torch.tensor([seconds], dtype=torch.float64, device=devices[0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest process sets the pace
    if rank == 0:
        out.put(args.batch * args.steps / took.item())
    dist.destroy_process_group()


def distributed(args, devices: int, stages: int, micro: int = 1) -> float:
    world = devices // stages
    # CUDA needs fresh processes; on the CPU forked ones start without importing torch again
    method = "spawn" if args.device == "cuda" else "fork"
    queue = mp.get_context(method).SimpleQueue()
    mp.start_processes(_ddp_worker, args=(world, _free_port(), args, stages, micro, queue), nprocs=world,
                       join=True, start_method=method)
    return queue.get()


def measure(args, devices: int) -> dict[str, float]:
    return {"dp": data_parallel(args, devices),
            "ddp": distributed(args, devices, 1),
            "ddp-stages": distributed(args, devices, 2),
            "ddp-pipeline": distributed(args, devices, 2, args.micro_batches)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--size", type=int, default=128, help="image side in pixels (the tutorial's 128)")
    p.add_argument("--batch", type=int, default=256, help="global batch: split over the processes")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cpu-devices", type=int, default=2, help="with --device cpu: processes of the ddp way")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, nothing written: proves that it runs")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.model, args.size, args.batch, args.micro_batches = "cpu", "resnet", 16, 8, 2
        args.steps, args.warmup = 2, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    devices = torch.cuda.device_count() if args.device == "cuda" else args.cpu_devices
    if devices < 2 or devices % 2:
        print(f"bench_parallel: {devices} device(s): the comparison needs an even count of 2 or more "
              "(2 stages per process)", file=sys.stderr)
        return 2
    rates = measure(args, devices)
    record = {"device": args.device, "devices": devices, "model": args.model, "image_size": args.size,
              "global_batch": args.batch, "micro_batches": args.micro_batches, "steps": args.steps,
              "samples_per_s": {k: round(v, 1) for k, v in rates.items()},
              "over_ddp": {k: round(v / rates["ddp"], 3) for k, v in rates.items()},
              "torch": torch.__version__, "machine": platform.machine(),
              "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for way in WAYS:
        print(f"{way:13s} {rates[way]:10.1f} samples/s  {record['over_ddp'][way]:.2f} x ddp")
    if not args.smoke:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"parallel-{args.device}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
