"""The rules that span several fields of an inventory (duplicate nodes, GPU layouts, Slurm's
limits, the built-in trainer's flags): each as a field path and a message."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections import Counter

from agent.contract import TRAINER_FLAGS_MODULE, module_argv


class CrossFieldProblems(Exception):
    """Not a ValueError on purpose: pydantic lets it through with its field paths intact."""

    def __init__(self, problems: list[tuple[tuple, str]]):
        super().__init__(problems)
        self.problems = problems


def cross_field_problems(inv) -> list[tuple[tuple, str]]:
    """Rules that span several fields of ``inv`` (the schema's Inventory, as its validator sees it:
    this module imports nothing of the schema), as (field path, message) pairs."""
    out: list[tuple[tuple, str]] = []
    machines = [*(("nodes", i, n) for i, n in enumerate(inv.nodes)),
                *(("spares", i, n) for i, n in enumerate(inv.spares))]
    names = Counter(n.name for *_, n in machines)
    pairs = Counter((n.address, n.connection) for *_, n in machines)
    seen_names: set[str] = set()
    seen_pairs: set[tuple[str, str]] = set()
    for section, i, n in machines:
        if names[n.name] > 1 and n.name in seen_names:
            out.append(((section, i, "name"), f"duplicate node name {n.name!r}"))
        seen_names.add(n.name)
        pair = (n.address, n.connection)
        if pairs[pair] > 1 and pair in seen_pairs:
            out.append(((section, i, "address"),
                        f"duplicate address {n.address!r} (connection {n.connection}); each node needs its own host"))
        seen_pairs.add(pair)
        out += _layout_problems(n, section, i, inv.job.stages)
    gpu = [n.name for *_, n in machines if n.gpus > 0]
    cpu = [n.name for *_, n in machines if n.gpus == 0]
    if gpu and cpu:
        where = ("nodes",) if len({n.gpus > 0 for n in inv.nodes}) > 1 or not inv.spares else ("spares",)
        out.append((where, f"mixes GPU nodes ({', '.join(gpu)}) and CPU nodes ({', '.join(cpu)}): their "
                    "ranks would pick different backends (nccl, gloo) and hang; give every node "
                    "gpus > 0, or every node gpus: 0"))
    out += _train_problems(inv.train, [n.env for *_, n in machines], inv.job.stages)
    if inv.slurm is not None:
        return out + _slurm_problems(inv)
    if not inv.nodes:
        out.append((("nodes",), "required: the nodes to run on (or slurm: to run on a Slurm cluster)"))
        return out
    if inv.rendezvous.node is None:
        out.append((("rendezvous", "node"), "required: the name of the node that hosts the rendezvous"))
    elif inv.rendezvous.node not in (listed := [n.name for n in inv.nodes]):
        out.append((("rendezvous", "node"),
                    f"{inv.rendezvous.node!r} is not one of nodes[].name ({', '.join(listed)})"))
    if inv.job.min_nodes is not None and inv.job.min_nodes > len(inv.nodes):
        out.append((("job", "min_nodes"), f"{inv.job.min_nodes} is more than the {len(inv.nodes)} nodes listed"))
    procs = {n.nprocs for n in inv.nodes}
    if inv.train.spawn and len(procs) > 1:
        out.append((("train", "spawn"), f"the nodes run {', '.join(map(str, sorted(procs)))} processes: a program "
                    "that starts its own workers counts its ranks as GROUP_RANK x DDP_PROCS + i, one DDP_PROCS "
                    "on every node; give every node the same procs"))
    if inv.rendezvous.last_call() >= inv.rendezvous.join_timeout:
        out.append((("rendezvous", "last_call_timeout"), f"{inv.rendezvous.last_call()} must be less than "
                    f"join_timeout ({inv.rendezvous.join_timeout}): a round of fewer nodes would time out first"))
    return out


def _slurm_problems(inv) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    s = inv.slurm
    if inv.nodes:
        out.append((("nodes",), "give nodes (an SSH fleet) or slurm (a Slurm cluster), not both"))
    if inv.spares:
        out.append((("spares",), "not on Slurm: Slurm allocates the nodes, and a requeued job gets others"))
    if inv.heal.watch:
        out.append((("heal", "watch"), "not on Slurm: Slurm requeues a job whose node fails (slurm.requeue)"))
    if inv.rendezvous.node is not None:
        out.append((("rendezvous", "node"), "not on Slurm: the allocation's first node hosts the rendezvous"))
    k = inv.job.stages
    if s.gpus_per_node and s.procs_per_node and s.procs_per_node * k > s.gpus_per_node:
        out.append((("slurm", "procs_per_node"), f"{s.procs_per_node}{_times(k)} must be <= gpus_per_node "
                                                 f"({s.gpus_per_node})"))
    if s.gpus_per_node and s.procs_per_node is None:
        out += [(("slurm", "gpus_per_node"), msg) for msg in _divisible(s.gpus_per_node, k)]
    if inv.job.min_nodes is not None:
        out.append((("job", "min_nodes"), "not on Slurm: the allocation is the job's nodes (Slurm requeues "
                                          "a job whose node fails)"))
    if inv.job.runtime == "docker" and s.container is None:
        out.append((("job", "runtime"), "docker on Slurm needs slurm.container (pyxis or apptainer: what the site "
                                        "runs images with); or runtime: host with a shared venv as train.python"))
    if inv.job.runtime == "host" and s.container is not None:
        out.append((("slurm", "container"), "only with job.runtime: docker (the job runs in that image)"))
    return out


def _train_problems(train, node_envs: list[dict[str, str]], stages: int) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    if train.builtin and train.args:
        # The trainer's own parser, here: a bad flag is exit 2 now, not exited(1) after restarts.
        # With the stages the tool gives it (job.stages), which --micro-batches needs.
        problem = _trainer_refuses(("--stages", str(stages), *train.args))
        if problem:
            out.append((("train", "args"), f"the built-in trainer refuses these flags: {problem} "
                                           "(see python -m trainer --help)"))
    plain = set(train.env).union(*node_envs)
    for name in train.secrets:
        if name in plain:
            out.append((("train", "secrets", name), f"{name} is also set in train.env or nodes[].env; "
                                                    "keep it in one place (secrets for values never shown)"))
    return out


@functools.lru_cache(maxsize=256)
def _trainer_refuses(argv: tuple[str, ...]) -> str | None:
    """What the built-in trainer refuses in ``argv``, asked of the trainer itself as a program (this
    machine's interpreter, which installs it beside the tool): its flags are its own, and nothing of
    the training side is imported here."""
    try:
        r = subprocess.run([sys.executable, *module_argv(TRAINER_FLAGS_MODULE), *argv], capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot ask {sys.executable} -m {TRAINER_FLAGS_MODULE} about them ({exc})"
    if r.returncode == 0:
        return None
    said = (r.stdout.strip() or r.stderr.strip() or f"exit {r.returncode}").splitlines()[-1]
    return said if r.returncode == 2 else f"cannot ask {sys.executable} -m {TRAINER_FLAGS_MODULE} about them ({said})"


def _times(stages: int) -> str:
    return f" x job.stages ({stages})" if stages > 1 else ""


def _per_process(stages: int) -> str:
    return f"job.stages ({stages}) GPUs per process" if stages > 1 else "one GPU per process"


def _divisible(gpus: int, stages: int) -> list[str]:
    """A GPU count that job.stages must divide, with no procs given to use fewer."""
    if gpus < stages:
        return [f"{gpus} GPU(s), fewer than one process needs: job.stages ({stages}) GPUs per process"]
    if gpus % stages:
        return [f"{gpus} GPUs do not divide into processes of job.stages ({stages}) GPUs each; "
                f"set procs to use {gpus - gpus % stages} of them, or change job.stages"]
    return []


def _layout_problems(n, section: str, i: int, stages: int) -> list[tuple[tuple, str]]:
    """A GPU node's processes, each with ``stages`` of its GPUs: a layout that fits the node,
    or what does not fit, each message naming the node (``section``: nodes or spares)."""
    return [((section, *where[1:]), f"node {n.name}: {message}") for where, message in _layout(n, i, stages)]


def _layout(n, i: int, stages: int) -> list[tuple[tuple, str]]:
    if n.gpus == 0:
        if n.gpu_ids is not None:
            return [(("nodes", i, "gpu_ids"), "gpu_ids on a CPU node (gpus: 0); set gpus to the node's GPU count")]
        return []
    out: list[tuple[tuple, str]] = []
    if n.procs is not None and n.procs * stages > n.gpus:
        out.append((("nodes", i, "procs"), f"procs ({n.procs}){_times(stages)} must be <= gpus ({n.gpus}) "
                                           "on a GPU node"))
    ids = n.gpu_ids
    if ids is None:
        if n.procs is None:
            out += [(("nodes", i, "gpus"), msg) for msg in _divisible(n.gpus, stages)]
        return out
    where = ("nodes", i, "gpu_ids")
    if len(set(ids)) != len(ids):
        out.append((where, f"{list(ids)} lists a GPU twice; {_per_process(stages)}"))
    if len(ids) != n.nprocs * stages:
        out.append((where, f"{len(ids)} GPU ids for {n.nprocs} processes; {_per_process(stages)}"))
    if any(g >= n.gpus for g in ids):
        out.append((where, f"{list(ids)}: ids are 0 .. {n.gpus - 1} on a node with gpus: {n.gpus}"))
    return out
