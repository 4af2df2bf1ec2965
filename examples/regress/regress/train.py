"""Train an MLP on a synthetic regression task with DistributedDataParallel, as a package module.

Run from examples/regress: `torchrun --standalone --nproc-per-node 2 -m regress.train`, or
`python -m regress.train` for one process. Shows a shared data cache written once by rank 0,
AdamW, METRICS lines with the loss and R^2, and one checkpoint (latest.pt) that a new launch
resumes from.
"""

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from regress import ckpt, data
from regress.model import mlp


def report(**fields):
    """Print one METRICS line: what the deploy tool collects from rank 0's stdout."""
    fields["time"] = round(time.time(), 3)
    print("METRICS " + json.dumps(fields), flush=True)


def parse_args():
    p = argparse.ArgumentParser(prog="python -m regress.train", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="samples per process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--samples", type=int, default=4096, help="dataset size; a fifth is held out")
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps per train METRICS line")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def setup():
    """(rank, world size, device), joining the process group when torchrun started us."""
    kind = os.environ.get("DDP_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if kind == "cuda" else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        return 0, 1, device
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), device


def all_sum(tensor):
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


@torch.no_grad()
def evaluate(model, x, y, rank, world, device):
    """(MSE, R^2) over the held-out set, each rank taking every world-th sample."""
    model.eval()
    x, y = x[rank::world].to(device), y[rank::world].to(device)
    err = (model(x) - y).double()
    y = y.double()
    sums = all_sum(torch.stack([(err ** 2).sum(), y.sum(), (y ** 2).sum(), torch.tensor(float(len(y)), dtype=torch.float64, device=device)]))
    model.train()
    sse, sy, syy, n = sums.tolist()
    return sse / n, 1 - sse / (syy - sy * sy / n)


def main():
    args = parse_args()
    rank, world, device = setup()
    node, run_id = os.environ.get("DDP_NODE_NAME", "local"), os.environ.get("DDP_RUN_ID", "local")
    print(f"[{node}] run {run_id}: rank {rank} of {world} on {device}", flush=True)
    ckpt_dir = os.environ.get("DDP_CKPT_DIR", "runs/ckpt")
    os.makedirs(ckpt_dir, exist_ok=True)
    torch.manual_seed(args.seed)

    dataset = data.load(os.environ.get("DDP_DATA_DIR", "runs/data"), args.samples, args.features, args.seed, rank)
    split = args.samples * 4 // 5
    train_set = TensorDataset(dataset["x"][:split], dataset["y"][:split])
    val_x, val_y = dataset["x"][split:], dataset["y"][split:]
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise SystemExit(f"--samples {args.samples} is too few for --batch-size {args.batch_size} on {world} processes")

    model = mlp(args.features, args.hidden).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    start_epoch, step = 0, 0
    state = ckpt.load(ckpt_dir)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, step = state["epoch"] + 1, state["step"]
    epoch0 = torch.tensor([start_epoch], device=device)
    if dist.is_initialized():
        dist.broadcast(epoch0, src=0)
    if epoch0.item() != start_epoch:
        raise SystemExit(f"rank {rank} sees a different {ckpt_dir}/latest.pt than rank 0 (epoch {start_epoch - 1})")
    if rank == 0 and state is not None:
        print(f"resuming from {ckpt_dir}/latest.pt: epoch {start_epoch}, step {step}", flush=True)
    ddp = model
    if dist.is_initialized():
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        samples, tic = 0, time.perf_counter()
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            loss = F.mse_loss(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            sums[0] += loss.detach() * len(y)
            sums[1] += len(y)
            samples += len(y)
            if step % args.log_every == 0 or i == len(loader) - 1:
                all_sum(sums)
                if rank == 0:
                    report(kind="train", epoch=epoch, step=step, loss=(sums[0] / sums[1]).item(),
                           samples_per_s=round(samples * world / (time.perf_counter() - tic), 1),
                           epochs=args.epochs, steps_per_epoch=len(loader))
                sums.zero_()
                samples, tic = 0, time.perf_counter()
        val_loss, r2 = evaluate(model, val_x, val_y, rank, world, device)
        if rank == 0:
            report(kind="eval", epoch=epoch, step=step, loss=val_loss, r2=r2, epochs=args.epochs, steps_per_epoch=len(loader))
            ckpt.save(ckpt_dir, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step})

    if dist.is_initialized():
        # Every rank leaves together, and DDP's reference cycles are collected while Python is
        # whole: left to the interpreter's exit, gloo's teardown aborts a rank now and then.
        dist.barrier()
        del ddp
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
