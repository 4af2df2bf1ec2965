"""Turns the figures the fault tests record into the table of tests/FAULTS.md.

    DDP_FAULTS_RECORD=bench/results/faults.jsonl make test PYTEST_ARGS="tests/cluster/test_faults.py"
    python bench/faults_table.py bench/results/faults.jsonl
"""

from __future__ import annotations

import json
import sys


def _cell(value) -> str:
    if value is None:
        return "n/a"
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return str(value)


def table(rows: list[dict]) -> str:
    head = ["fault", "job finished", "work redone (steps)", "time to detect", "left running", "bit-identical",
            "run's goodput (`runs`)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        redone = r["redone_steps"]
        redone = "n/a" if redone is None else f"{redone} (checkpoint every {r['ckpt_every']})"
        detect = "n/a" if r["detect_s"] is None else f"{r['detect_s']} s: {r['detect_what']}"
        extra = f"; {r['previous_checkpoint']}" if r.get("previous_checkpoint") else ""
        good = "n/a"
        if r.get("goodput") is not None:
            good = f"{r['goodput']:.0%}" + (f", training again {r['recovery_s']} s after the last step logged"
                                              if r.get("recovery_s") is not None else "")
        lines.append("| " + " | ".join([r["fault"], _cell(r["finished"]) + extra, redone, detect,
                                        r["left_running"], _cell(r["bit_identical"]), good]) + " |")
    return "\n".join(lines)


def recovery_table(rows: list[dict]) -> str:
    """The faults that recorded where their recovery's time went (``recovery_phases``: seconds by
    phase, in order), one row each; empty where none did."""
    timed = [r for r in rows if r.get("recovery_phases")]
    if not timed:
        return ""
    names = list(timed[0]["recovery_phases"])
    head = ["fault", *names, "kill to training again"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in timed:
        phases = r["recovery_phases"]
        cells = [f"{phases[n]:.1f} s" if n in phases else "n/a" for n in names]
        lines.append("| " + " | ".join([r["fault"], *cells, f"{sum(phases.values()):.1f} s"]) + " |")
    return "\n".join(lines)


def main() -> None:
    with open(sys.argv[1]) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    print(table(rows))
    recovery = recovery_table(rows)
    if recovery:
        print()
        print(recovery)


if __name__ == "__main__":
    main()
