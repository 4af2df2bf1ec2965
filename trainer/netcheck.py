"""A short network check across every node of a job, with the job's own backend and launcher.

    python -m agent.launch <torchrun options> --entry trainer.netcheck -- [--size-mb 32]
        [--iters 5] [--device auto|cpu|cuda] [--backend auto|gloo|nccl] [--dist-timeout 120]

Only each node's leader (local rank 0) measures; the other ranks join the process groups and
wait. Two figures, float32 all-reduces on the process's device, one warm-up then ``--iters``
timed, each iteration started behind a barrier. Each figure comes from the median iteration, so
that one iteration stretched by a busy host (a process scheduled out mid-transfer) does not halve
a link's figure and name a healthy node slow:

- one all-reduce among all leaders: the bus bandwidth the job's gradients would see
  (``busbw = bytes / median s * 2(n-1)/n``, the nccl-tests convention);
- rounds of disjoint node pairs, each pair a 2-rank all-reduce, every node meeting up to two
  peers. A node's figure is the best of its pairs (its link carries at least that), so one slow
  link shows on its own node and not on every peer of it.

Global rank 0 prints one line, ``NETCHECK {json}`` (see :func:`report`), and exits 0: a slow
node is a finding, not a failure. A bad flag exits 2 naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from agent import exits

from .dist import DistEnv, DistSetupError, setup, teardown

SLOW_FRACTION = 0.5
"""A node is slow below this fraction of the median node figure."""

PEERS_PER_NODE = 2
"""Distinct peers each node meets: two, so that a slow peer cannot alone make a node look slow."""

IFNAME_VARIABLE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"netcheck: error: {message}\n")


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="python -m trainer.netcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=_positive(float), default=32.0,
                   help="all-reduce buffer size in MiB (default 32)")
    p.add_argument("--iters", type=_positive(int), default=5,
                   help="timed iterations after one warm-up (default 5)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--dist-timeout", type=_positive(int), default=120, metavar="SECONDS",
                   help="bound on each collective (default 120)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- pure parts

def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs of nodes ``0..n-1`` (the circle method), as few as it takes for
    every node to meet ``min(2, n-1)`` distinct peers: 1 round for 2 nodes, 2 for an even
    number, 3 for an odd one (a node sits each round out). Pairs are ``(low, high)``."""
    need = min(PEERS_PER_NODE, n - 1)
    seats: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    met: dict[int, set[int]] = {i: set() for i in range(n)}
    rounds: list[list[tuple[int, int]]] = []
    while any(len(peers) < need for peers in met.values()):
        half = len(seats) // 2
        pairs = [tuple(sorted((a, b))) for a, b in zip(seats[:half], reversed(seats[half:]))
                 if a is not None and b is not None]
        for a, b in pairs:
            met[a].add(b)
            met[b].add(a)
        rounds.append(pairs)
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return rounds


def slow_nodes(figures: dict[str, float | None]) -> list[str]:
    """Nodes whose figure is below half the median of all nodes' figures. With fewer than three
    nodes a slow node and its slow peer look the same, so nobody is named."""
    known = {name: f for name, f in figures.items() if f is not None}
    if len(figures) < 3 or not known:
        return []
    median = statistics.median(known.values())
    return [name for name, f in known.items() if f < SLOW_FRACTION * median]


_NCCL_NETWORK = re.compile(r"NCCL INFO Using network (\S.*?)\s*$")
_NCCL_IB_PORTS = re.compile(r"NET/IB\s*:\s*Using (.*)$")
_NCCL_SOCKET = re.compile(r"NET/Socket\s*:\s*Using \[\d+\]")


def nccl_transport(lines: Iterable[str]) -> str | None:
    """The network NCCL chose, from its INIT/NET debug lines: ``IB``, ``RoCE`` (an IB verbs
    device on Ethernet), ``sockets``, a plugin's own name, or None when the lines do not say."""
    chosen, ib_ports, socket_seen = None, "", False
    for line in lines:
        if m := _NCCL_NETWORK.search(line):
            chosen = m.group(1)
        elif m := _NCCL_IB_PORTS.search(line):
            ib_ports += m.group(1)
        elif _NCCL_SOCKET.search(line):
            socket_seen = True
    if chosen is None:
        chosen = "IB" if ib_ports else "Socket" if socket_seen else None
    if chosen == "IB":
        return "RoCE" if "/RoCE" in ib_ports and "/IB" not in ib_ports else "IB"
    return "sockets" if chosen == "Socket" else chosen


def busbw(size_bytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: what each link carried, comparable across n."""
    return size_bytes / seconds * 2 * (ranks - 1) / ranks


def report(*, backend: str | None, device: str, size_bytes: int, iters: int,
           nodes: list[dict], allreduce_s: float | None,
           pair_s: dict[tuple[int, int], float]) -> dict:
    """The NETCHECK object from the leaders' timings. ``nodes``: name, interface, transport of
    each node in node-index order; ``pair_s``: typical seconds of each measured pair."""
    n = len(nodes)
    names = [node["node"] for node in nodes]
    pairs: list[dict[str, int]] = [{} for _ in nodes]
    for (a, b), seconds in sorted(pair_s.items()):
        figure = round(busbw(size_bytes, seconds, 2))
        pairs[a][names[b]] = pairs[b][names[a]] = figure
    figures = {names[i]: max(pairs[i].values(), default=None) for i in range(n)}
    note = None
    if n == 1:
        note = "one node: no link between nodes to measure"
    elif n == 2:
        note = "two nodes: a slow node cannot be told from its slow peer; run with three or more"
    return {
        "backend": backend, "device": device, "size_bytes": size_bytes, "iters": iters,
        "nodes_total": n,
        "allreduce_busbw": None if allreduce_s is None else round(busbw(size_bytes, allreduce_s, n)),
        "nodes": [{**node, "busbw": figures[node["node"]], "pairs": pairs[i]}
                  for i, node in enumerate(nodes)],
        "slow": slow_nodes(figures),
        "note": note,
    }


def unique_names(names: list[str]) -> list[str]:
    """Node names as reported: a name that several nodes share (hostnames on a fleet without
    DDP_NODE_NAME) gets ``#<node index>`` so that every node and pair stays distinguishable."""
    return [f"{name}#{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


# --------------------------------------------------------------------------- measuring

def capture_nccl_log() -> Path:
    """Makes NCCL write its INIT/NET lines to a private directory, where :func:`transport` reads
    which network it chose. Must run before the process group exists. It overrides the job's own
    NCCL_DEBUG for this check run alone (hosts.example.yaml sets one), so the transport is known."""
    log_dir = Path(tempfile.mkdtemp(prefix="netcheck-nccl-"))
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET",
                      NCCL_DEBUG_FILE=str(log_dir / "nccl.%h.%p"))
    return log_dir


def transport(backend: str, nccl_log: Path | None) -> str:
    """gloo always speaks TCP; NCCL picks its network at init and says which in its log."""
    if backend == "gloo":
        return "tcp"
    lines = [line for f in sorted(nccl_log.glob("nccl.*")) for line in f.read_text().splitlines()] \
        if nccl_log else []
    return nccl_transport(lines) or "unknown"


def _barrier(env: DistEnv, group) -> None:
    if env.device.type == "cuda":
        dist.barrier(group=group, device_ids=[env.device.index])
    else:
        dist.barrier(group=group)


def typical_seconds(took: list[float]) -> float:
    """The seconds an iteration of a link takes: the median, which fewer than half of the
    iterations slowed by something other than the link (a CPU taken by another process) cannot
    move, where the mean is pulled by each of them."""
    return statistics.median(took)


def timed_all_reduce(env: DistEnv, group, buf: torch.Tensor, iters: int) -> float:
    """:func:`typical_seconds` of ``iters`` all-reduces in ``group`` after one warm-up, each
    started behind a barrier so that no rank's late arrival counts as transfer time."""
    dist.all_reduce(buf, group=group)
    took = []
    for _ in range(iters):
        _barrier(env, group)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        took.append(time.perf_counter() - start)
    return typical_seconds(took)


def measure(args: argparse.Namespace, env: DistEnv, nccl_log: Path | None) -> dict | None:
    """Every rank: the groups, the leaders' measurements, one gather. Returns the report on
    global rank 0, None elsewhere."""
    backend = env.backend
    me = {"group_rank": int(os.environ.get("GROUP_RANK", "0")), "rank": env.rank,
          "leader": env.is_local_main,
          "node": os.environ.get("DDP_NODE_NAME") or socket.gethostname(),
          "interface": os.environ.get(IFNAME_VARIABLE[backend]) or "auto"}
    everyone = _all_gather(env, me)
    leaders = sorted((r for r in everyone if r["leader"]), key=lambda r: r["group_rank"])
    ranks = [r["rank"] for r in leaders]
    mine = ranks.index(env.rank) if env.rank in ranks else None
    rounds = pair_rounds(len(ranks)) if len(ranks) > 1 else []
    timeout = timedelta(seconds=args.dist_timeout)
    # dist.new_group is collective over the whole job: every rank creates every group, in order.
    leader_group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
    pair_groups = [[dist.new_group(list(pair_ranks), timeout=timeout)
                    for pair_ranks in ((ranks[a], ranks[b]) for a, b in pairs)] for pairs in rounds]
    # Non-leaders wait in the final gather for the whole measurement: as long as every
    # collective of a leader (a barrier and an all-reduce per iteration, per round) may take.
    meeting = dist.new_group(timeout=timeout * (len(rounds) + 1) * (args.iters + 1) * 2)

    elements = max(1, round(args.size_mb * 2**20 / 4))
    timings: dict = {"allreduce_s": None, "pair_s": {}, "transport": None}
    if mine is not None:
        buf = torch.zeros(elements, dtype=torch.float32, device=env.device)
        if leader_group is not None:
            timings["allreduce_s"] = timed_all_reduce(env, leader_group, buf, args.iters)
        for pairs, groups in zip(rounds, pair_groups):
            _barrier(env, leader_group)
            for (a, b), group in zip(pairs, groups):
                if mine in (a, b):
                    timings["pair_s"][(a, b)] = timed_all_reduce(env, group, buf, args.iters)
        timings["transport"] = transport(backend, nccl_log)
    results = _all_gather(env, timings, group=meeting)
    if not env.is_main:
        return None
    by_rank = {r["rank"]: res for r, res in zip(everyone, results)}
    lead = [by_rank[rank] for rank in ranks]
    pair_s: dict[tuple[int, int], float] = {}
    for res in lead:
        for pair, seconds in res["pair_s"].items():
            pair_s[pair] = max(seconds, pair_s.get(pair, 0.0))
    allreduce = [res["allreduce_s"] for res in lead if res["allreduce_s"] is not None]
    names = unique_names([r["node"] for r in leaders])
    nodes = [{"node": name, "interface": r["interface"], "transport": res["transport"]}
             for name, r, res in zip(names, leaders, lead)]
    return report(backend=backend, device=env.device.type, size_bytes=elements * 4, iters=args.iters,
                  nodes=nodes, allreduce_s=max(allreduce, default=None), pair_s=pair_s)


def _all_gather(env: DistEnv, obj: object, group=None) -> list:
    out: list = [None] * env.world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def _say(result: dict) -> None:
    """The operator's summary on stderr; stdout keeps the one NETCHECK line for tools."""
    for node in result["nodes"]:
        figure = f"{node['busbw'] / 1e6:.0f} MB/s" if node["busbw"] else "-"
        mark = "  SLOW" if node["node"] in result["slow"] else ""
        print(f"netcheck: {node['node']}: {figure} ({node['interface']}, {node['transport']}){mark}",
              file=sys.stderr)
    if result["note"]:
        print(f"netcheck: {result['note']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nccl_log = capture_nccl_log() if args.backend != "gloo" else None
    try:
        return run(args, nccl_log)
    finally:
        if nccl_log:
            shutil.rmtree(nccl_log, ignore_errors=True)


def run(args: argparse.Namespace, nccl_log: Path | None) -> int:
    try:
        env = setup(args.device, args.backend, args.dist_timeout)
    except DistSetupError as exc:
        print(f"netcheck: error: {exc}", file=sys.stderr)
        return 2
    if not env.distributed:
        print("netcheck: error: not started by torchrun; run python -m agent.launch <torchrun options> "
              "--entry trainer.netcheck -- <netcheck flags>", file=sys.stderr)
        return 2
    finished = False
    try:
        result = measure(args, env, nccl_log)
        if result is not None:
            print("NETCHECK " + json.dumps(result), flush=True)
            _say(result)
        finished = True
    except RuntimeError as exc:  # a peer lost or a collective timed out: one line, not a traceback
        print(f"netcheck: error: rank {env.rank}: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    finally:
        teardown(env, finished, hung_exit=0 if finished else 1)
    return 0


if __name__ == "__main__":
    exits.main(main)  # sys.exit(main()), without the interpreter's teardown of torch
