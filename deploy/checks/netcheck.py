"""``ddp-deploy check --network``: the operator's side of ``trainer.netcheck``.

Every node runs the network check in the foreground through the job's own launcher (image or
interpreter, interfaces, environment, backend; plan.netcheck_plan); the node whose process got
global rank 0 prints one ``NETCHECK {json}`` line, which this module finds and reads.
"""

from __future__ import annotations

from ..errors import RemoteFailure
from ..inventory import Inventory
from ..job import plan
from ..job.runtime import NodeFacts
from ..nodes.remote import Remote

PREFIX = "NETCHECK "
TIMEOUT_S = 600


def run(inv: Inventory, remote: Remote, facts: dict[str, NodeFacts], size_mb: float) -> dict:
    flags = ("--size-mb", f"{size_mb:g}", "--dist-timeout", "120")
    results = remote.run(plan.netcheck_plan(inv, facts, flags), check=False, timeout=TIMEOUT_S)
    for r in results.values():
        report = plan.json_line(r.stdout, PREFIX)
        if report is not None and all(x.ok for x in results.values()):
            return report
    raise RemoteFailure("network check", results, hint="the nodes could not complete an all-reduce: see each "
                                                       "node's error above; `ddp-deploy check` alone passed")


def rate(bytes_per_s: float | None) -> str:
    """A link rate as people quote them: Mbit/s below a gigabit, else Gbit/s."""
    if bytes_per_s is None:
        return "-"
    bits = bytes_per_s * 8
    return f"{bits / 1e9:.2f} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.0f} Mbit/s"


def describe_slow(report: dict) -> str:
    figures = {n["node"]: n["busbw"] for n in report["nodes"]}
    return "; ".join(f"{name} {rate(figures.get(name))}" for name in report.get("slow") or []) + \
        f"; the others {', '.join(rate(bw) for name, bw in figures.items() if name not in report['slow'])}"
