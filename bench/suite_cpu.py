"""Where the test suite's CPU goes, by kind of process: trainer workers, torchrun agents,
preflight probes, the operator CLI, pytest itself, Docker, ssh, ... (the suite is bound by
its 2 cores, so a cut must remove core-seconds, not only waiting).

Two sources, both from the kernel:
- BSD process accounting (``accton``, Debian's ``acct``): one record per process that ended,
  with its command name (15 characters), pid, parent, start second and CPU time. Exact, and it
  sees every process, containers' too; but ``python3.11`` is all it says of a worker.
- A sampler that reads /proc once a second and keeps each new process's command line, so a
  record is classed by what the process ran (matched by pid and start second).

    python bench/suite_cpu.py record OUT_DIR     # until SIGTERM / Ctrl-C; then run the suite
    python bench/suite_cpu.py report OUT_DIR     # the table, and OUT_DIR/summary.json

Processes that ran under a second are classed by their command name only. Records of
processes still alive when recording stops are absent (the daemons' CPU is partly missed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.text import safe  # noqa: E402  (a process names itself: its name is shown as text)

ACCT = struct.Struct("<BBHIIIIIIf8H16s")  # struct acct_v3 (linux/acct.h), 64 bytes
AHZ = 100  # acct_v3 times are in 1/100 s

# (class, pattern on the command line); the first match wins. The image's entrypoint runs a module
# as ``python -c "import runpy, ..." MODULE``.
CLASSES = [
    ("preflight probe", re.compile(r"(-m |runpy.*[ ,])agent\.probe\b")),
    ("launcher and torchrun agent", re.compile(r"((-m |runpy.*[ ,])agent\.launch\b|torch\.distributed\.run|/torchrun\b)")),
    ("trainer worker", re.compile(r"(-m trainer( |$)|-u -m |trainer/__main__\.py)")),
    ("operator CLI", re.compile(r"(ddp-deploy|-m deploy\b)")),
    ("pytest", re.compile(r"(pytest|xdist|execnet)")),
    ("node program (python -c)", re.compile(r"python[0-9.]* -c")),
]


def _comp_t(v: int) -> float:
    return float((v & 0x1FFF) << (3 * ((v >> 13) & 7)))


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


def record(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    acct = out / "pacct"
    acct.write_bytes(b"")
    subprocess.run(["accton", str(acct)], check=True, capture_output=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    boot, hz = _boot_time(), os.sysconf("SC_CLK_TCK")
    seen: set[tuple[int, int]] = set()
    with open(out / "cmdlines.jsonl", "a") as f:
        while not stop:
            for d in os.scandir("/proc"):
                if not d.name.isdigit():
                    continue
                try:
                    stat = Path(d.path, "stat").read_text()
                    start = int(stat.rsplit(")", 1)[1].split()[19])
                    key = (int(d.name), start)
                    if key in seen:
                        continue
                    cmd = Path(d.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except (OSError, IndexError, ValueError):
                    continue
                seen.add(key)
                f.write(json.dumps({"pid": key[0], "start": boot + start / hz, "cmd": cmd[:400]}) + "\n")
            f.flush()
            time.sleep(1.0)
    subprocess.run(["accton", "off"], capture_output=True)


ZYGOTE = "ddp-zygote"
"""A launcher's zygote names itself so (agent/zygote.py); the workers it forks show its command
line, so they are told by their parent."""


def classify(cmd: str | None, comm: str, forked: bool = False) -> str:
    if comm == ZYGOTE:
        return "worker zygote"
    if forked:
        return "trainer worker (forked)"
    if cmd:
        for name, pattern in CLASSES:
            if pattern.search(cmd):
                return name
    if comm.startswith("python"):
        return "python, other or under 1 s"
    return comm


def report(out: Path) -> dict:
    cmds: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for line in (out / "cmdlines.jsonl").read_text().splitlines():
        r = json.loads(line)
        cmds[r["pid"]].append((r["start"], r["cmd"]))
    data = (out / "pacct").read_bytes()
    records = [f for off in range(0, len(data) - ACCT.size + 1, ACCT.size)
               if (f := ACCT.unpack_from(data, off))[1] == 3]
    zygotes = {f[6] for f in records if f[18].split(b"\0")[0] == ZYGOTE.encode()}
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for f in records:
        pid, ppid, btime, utime, stime = f[6], f[7], f[8], f[10], f[11]
        comm = f[18].split(b"\0")[0].decode(errors="replace")
        cpu = (_comp_t(utime) + _comp_t(stime)) / AHZ
        cmd = next((c for s, c in cmds.get(pid, ()) if abs(s - btime) <= 1.5), None)
        row = rows[classify(cmd, comm, ppid in zygotes)]
        row[0] += cpu
        row[1] += 1
        total += cpu
    table = sorted(((k, v[0], v[1]) for k, v in rows.items()), key=lambda r: -r[1])
    summary = {"total_core_s": round(total, 1),
               "classes": [{"class": k, "core_s": round(s, 1), "processes": n} for k, s, n in table]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{total / 60:.1f} core-min in processes that ended")
    for k, s, n in table[:25]:
        print(f"{s / 60:8.1f} core-min {100 * s / max(total, 1e-9):5.1f}%  {n:7d} processes  "
              f"{s / max(n, 1):6.2f} s each  {safe(k)}")
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "report"):
        sys.exit(__doc__)
    (record if sys.argv[1] == "record" else report)(Path(sys.argv[2]))
