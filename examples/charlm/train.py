"""A character-level language model trained with plain DistributedDataParallel.

What a user script needs under the deploy tool, with nothing imported from the bundle: torchrun's
environment, DDP_DEVICE / DDP_BACKEND, a DistributedSampler with set_epoch, METRICS lines from
rank 0, an atomic checkpoint per epoch in DDP_CKPT_DIR, and resuming from the newest one.
Started without torchrun (`python train.py`), it trains as one process.
"""

import argparse
import gc
import json
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def report(**fields):
    """Print one METRICS line: what the deploy tool collects from rank 0's stdout."""
    fields["time"] = round(time.time(), 3)
    print("METRICS " + json.dumps(fields), flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps-per-epoch", type=int, default=30, help="at most this many optimizer steps per epoch")
    p.add_argument("--text", default=str(Path(__file__).resolve().parent / "data" / "tiny.txt"))
    p.add_argument("--log-every", type=int, default=5, help="optimizer steps per train METRICS line")
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


class Windows(Dataset):
    """Non-overlapping windows of seq_len characters, each with the next character as target."""

    def __init__(self, ids, seq_len):
        self.ids, self.seq_len = ids, seq_len

    def __len__(self):
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i):
        chunk = self.ids[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class CharGRU(nn.Module):
    def __init__(self, vocab, dim=64, hidden=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x, state=None):
        out, state = self.gru(self.embed(x), state)
        return self.head(out), state


@torch.no_grad()
def evaluate(model, windows, rank, world, device, chunk=256):
    """(loss, next-character accuracy) over all windows, each rank taking every world-th one."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    mine = list(range(rank, len(windows), world))
    for start in range(0, len(mine), chunk):
        x, y = (torch.stack(t).to(device) for t in zip(*(windows[i] for i in mine[start:start + chunk])))
        logits, _ = model(x)
        sums[0] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        sums[1] += (logits.argmax(-1) == y).sum()
        sums[2] += y.numel()
    all_sum(sums)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


@torch.no_grad()
def sample(model, stoi, chars, prompt, length, device, seed):
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    x = torch.tensor([[stoi[c] for c in prompt if c in stoi]], device=device)
    out, state = [], None
    for _ in range(length):
        logits, state = model(x, state)
        probs = torch.softmax(logits[0, -1].float().cpu(), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).item()
        out.append(chars[nxt])
        x = torch.tensor([[nxt]], device=device)
    return prompt + "".join(out)


def save_atomic(state, path):
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def newest_epoch(ckpt_dir):
    """The highest N of the ckpt-epochN.pt files (complete by construction: written by rename), or -1."""
    found = (re.fullmatch(r"ckpt-epoch(\d+)\.pt", p.name) for p in ckpt_dir.glob("ckpt-epoch*.pt"))
    return max((int(m.group(1)) for m in found if m), default=-1)


def from_rank0(value, device):
    tensor = torch.tensor([value], device=device)
    if dist.is_initialized():
        dist.broadcast(tensor, src=0)
    return int(tensor.item())


def main():
    args = parse_args()
    rank, world, device = setup()
    node, run_id = os.environ.get("DDP_NODE_NAME", "local"), os.environ.get("DDP_RUN_ID", "local")
    print(f"[{node}] run {run_id}: rank {rank} of {world} on {device}", flush=True)
    ckpt_dir = Path(os.environ.get("DDP_CKPT_DIR", "runs/ckpt"))
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)

    text = Path(args.text).read_text(encoding="utf-8")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(len(ids) * 0.9)
    train_set, val_set = Windows(ids[:split], args.seq_len), Windows(ids[split:], args.seq_len)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = min(len(loader), args.steps_per_epoch)
    if steps_per_epoch == 0 or len(val_set) == 0:
        raise SystemExit(f"{args.text}: too short for --seq-len {args.seq_len} and --batch-size {args.batch_size}")

    model = CharGRU(len(chars)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start_epoch, step = 0, 0
    last = from_rank0(newest_epoch(ckpt_dir) if rank == 0 else -1, device)
    if last >= 0:
        path = ckpt_dir / f"ckpt-epoch{last}.pt"
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, step = state["epoch"] + 1, state["step"]
        if rank == 0:
            print(f"resuming from {path}: epoch {start_epoch}, step {step}", flush=True)
    ddp = model
    if dist.is_initialized():
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        samples, tic = 0, time.perf_counter()
        for i, (x, y) in enumerate(loader):
            if i == steps_per_epoch:
                break
            x, y = x.to(device), y.to(device)
            logits, _ = ddp(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            sums[0] += loss.detach() * y.numel()
            sums[1] += (logits.detach().argmax(-1) == y).sum()
            sums[2] += y.numel()
            samples += x.size(0)
            if step % args.log_every == 0 or i == steps_per_epoch - 1:
                all_sum(sums)
                if rank == 0:
                    report(kind="train", epoch=epoch, step=step, loss=(sums[0] / sums[2]).item(),
                           acc=(sums[1] / sums[2]).item(), samples_per_s=round(samples * world / (time.perf_counter() - tic), 1),
                           epochs=args.epochs, steps_per_epoch=steps_per_epoch)
                sums.zero_()
                samples, tic = 0, time.perf_counter()
        val_loss, val_acc = evaluate(model, val_set, rank, world, device)
        if rank == 0:
            report(kind="eval", epoch=epoch, step=step, loss=val_loss, acc=val_acc, epochs=args.epochs, steps_per_epoch=steps_per_epoch)
            save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step},
                        ckpt_dir / f"ckpt-epoch{epoch}.pt")

    if rank == 0:
        print("sample: " + sample(model, stoi, chars, "The ", 120, device, args.seed).replace("\n", " "), flush=True)
    if dist.is_initialized():
        # Every rank leaves together, and DDP's reference cycles are collected while Python is
        # whole: left to the interpreter's exit, gloo's teardown aborts a rank now and then.
        dist.barrier()
        del ddp
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
