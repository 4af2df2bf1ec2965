"""What the preflight session's output says, judged per check (deploy/checks/preflight.py runs the
session): one :class:`Check` row per node and check, from the tagged results ``parse_tagged`` gave
back. Nothing here talks to a node; every judge is a function of recorded output, so each is
tested with outputs recorded from real nodes.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.contract import PROBE_KEPT_PREFIX, PROBE_MODULE, PROBE_PREFIX, TORCH_SUPPORTED

from ..images import build as builder
from ..inventory import Inventory, Node
from ..job import plan
from ..job.payload import payload
from ..job.runtime import CodeDir, runtime
from .. import text
from ..nodes.remote import Result
from . import gpu_arch
from .versions import torch_supported

PROBE_SECONDS = 60
"""How long agent.probe may take on a node (the session's limit for it)."""


def parse_tagged(node: str, stdout: str) -> dict[str, Result]:
    """PHASES output -> one Result per check tag."""
    out: dict[str, list[str]] = {}
    err: dict[str, list[str]] = {}
    done: dict[str, Result] = {}
    for line in stdout.splitlines():
        tag, kind, text = (line.split(" ", 2) + ["", ""])[:3]
        if kind == "o":
            out.setdefault(tag, []).append(text)
        elif kind == "e":
            err.setdefault(tag, []).append(text)
        elif kind == "rc" and text.isdigit():
            o, e = "\n".join(out.get(tag, [])), "\n".join(err.get(tag, []))
            if text == "124":
                done[tag] = Result(node, None, o, e, error=f"timed out after {PROBE_SECONDS} s")
            else:
                done[tag] = Result(node, int(text), o, e)
    return done


@dataclass(frozen=True)
class Check:
    node: str
    name: str
    ok: bool
    detail: str


def checks_from(inv: Inventory, first: Mapping[str, Result], final: Mapping[str, Result],
                meeting, *, for_launch: bool = False, code: CodeDir | None = None,
                nodes: Sequence[Node] | None = None) -> list[Check]:
    """Every node's Check rows from its session's output (``first``: up to the barrier)."""
    nodes = inv.nodes if nodes is None else nodes
    checks: list[Check] = []
    for n in nodes:
        r = first[n.name]
        how = "local" if n.connection == "local" else "ssh"
        checks.append(Check(n.name, how, r.connected, "reachable" if r.connected else r.error))
    up = [n.name for n in nodes if first[n.name].connected]
    if not up:
        return checks
    results = {}
    for node in up:
        got = parse_tagged(node, final[node].stdout)
        missing = Result(node, None, error=f"no result ({final[node].summary()})")
        results[node] = _Tags(got, missing)

    if runtime(inv).engine_argv():
        checks += _judged(up, results, "engine", inv.job.runtime, lambda r: (True, f"engine {r.stdout.strip()}"),
                          f"{inv.job.runtime} engine not usable")
    checks += _platforms(inv, [n for n in up if not runtime(inv).engine_argv() or results[n]["engine"].ok], results)
    checks += [_torch(inv, results[n]["probe"], for_launch) for n in up]
    checks += [c for c in (_program(inv, results[n]["probe"], code) for n in up) if c is not None]

    def gpus(r: Result):
        want = inv.node(r.node).gpus
        have = sum(1 for line in r.stdout.splitlines() if line.startswith("GPU "))
        return have >= want, f"{have} GPUs, need {want}"

    checks += _judged([n for n in up if inv.node(n).gpus > 0], results, "gpus", "gpus", gpus, "nvidia-smi failed")
    checks += [gpu_holds(inv, results[n]["holds"]) for n in up if inv.node(n).devices]
    checks += [_storage(inv, results[n]["storage"]) for n in up]
    checks += meeting.judge(up, results)
    checks += [_previous_run(results[n]["status"]) for n in up]
    return checks


class _Tags(dict):
    def __init__(self, got: dict[str, Result], missing: Result) -> None:
        super().__init__(got)
        self.missing = missing

    def __missing__(self, tag: str) -> Result:
        return self.missing


def _judged(nodes, results, tag, name, judge, fail_text) -> list[Check]:
    out = []
    for node in nodes:
        r = results[node][tag]
        if r.ok:
            ok, detail = judge(r)
        else:
            ok, detail = False, f"{fail_text}: {r.summary()}"
        out.append(Check(node, name, ok, detail))
    return out


PROBE_KEYS = ("torch", "cuda_build", "cuda_available", "devices", "device_names", "nccl", "cuda_error")


IMAGE_MISSING = ("No such image", "Unable to find image")
NO_GPU_RUNTIME = "could not select device driver"
SHOWN_GPUS = 4


def _torch(inv: Inventory, r: Result, for_launch: bool) -> Check:
    """The probe's answer: torch inside the supported range; on a GPU node, CUDA usable on every
    device a process will use, with NCCL."""
    rt = runtime(inv)
    node, where = inv.node(r.node), rt.where()

    def fail(detail: str) -> Check:
        return Check(r.node, "torch", False, detail)

    report = plan.json_line(r.stdout, PROBE_PREFIX)
    if report is None:
        said = f"{r.stderr}\n{r.stdout}"
        if any(m in said for m in IMAGE_MISSING):
            if for_launch:
                return fail(f"{inv.image.name} is not on the node: run `ddp-deploy deploy`")
            return Check(r.node, "torch", True, f"{inv.image.name} not on the node yet (deploy ships it; "
                                                "launch probes it)")
        if NO_GPU_RUNTIME in said:
            return fail("no NVIDIA container runtime: docker cannot give the container GPUs "
                        "(install nvidia-container-toolkit on the node and restart dockerd)")
        if "No module named 'agent'" in said or "No module named agent." in said:  # none, or older than the agent
            return fail(f"{where} cannot import {PROBE_MODULE}, this version's node agent: {rt.install_hint()}")
        if r.exit_code == 127:
            return fail(f"cannot run {where}: {(r.stderr.strip().splitlines() or ['not found'])[-1]}")
        if r.exit_code == 124:
            return fail(f"agent.probe in {where} took longer than {PROBE_SECONDS} s (CUDA or the image stuck?)")
        return fail(f"{where}: agent.probe failed: {r.summary()}")
    if report.get("error"):
        return fail(f"{where}: {report['error']}")
    if any(key not in report for key in PROBE_KEYS):
        return fail(f"{where}: agent.probe answered without {', '.join(k for k in PROBE_KEYS if k not in report)}: "
                    f"a trainer of another version? {rt.install_hint()}")
    version = report["torch"]
    if not torch_supported(version):
        return fail(f"torch {version} in {where} is outside the supported range {TORCH_SUPPORTED}: "
                    f"{rt.torch_hint()}")
    detail = f"torch {version}, " + (f"CUDA {report['cuda_build']}" if report["cuda_build"] else "CPU build")
    if node.devices:
        arch = report.get("arch_list")
        cannot = gpu_arch.unrunnable(arch, report.get("capabilities"), list(range(len(node.devices))))
        if cannot:
            hint = rt.gpu_hint(*gpu_arch.need(arch, [cap for _, cap in cannot]))
            return fail(f"{_no_code_for(report, cannot)} in {where} ({detail}, built for {gpu_arch.describe(arch)}): "
                        f"{hint}")
        if not report["cuda_available"]:
            return fail(f"CUDA not usable in {where} ({detail}): {report['cuda_error']}")
        if report["devices"] < len(node.devices):
            each = f"job.stages ({inv.job.stages}) GPUs" if inv.job.stages > 1 else "one GPU"
            return fail(f"{report['devices']} CUDA device(s) visible in {where} for {node.nprocs} processes "
                        f"(GPUs {','.join(map(str, node.devices))}); {each} per process")
        if not report["nccl"]:
            return fail(f"torch in {where} has no NCCL ({detail}); a GPU job needs it")
        names = sorted(set(report["device_names"]))
        detail += f", {report['devices']} GPU(s) ({', '.join(names)}), NCCL {report['nccl']}"
    if report.get("infiniband"):
        detail += f", InfiniBand {' '.join(report['infiniband'])}"
    return Check(r.node, "torch", True, f"{detail} in {where}{_kept(r.stdout, inv.job.runtime)}")


def _no_code_for(report: dict, cannot: list[tuple[int, tuple[int, int]]]) -> str:
    """``GPU 0 (NVIDIA B200, compute capability 10.0) has no code in this torch`` for the devices
    the build cannot run (gpu_arch.unrunnable), those of one name and capability together."""
    names = report.get("device_names") or []
    kinds: dict[tuple, list[int]] = {}
    for i, (m, n) in cannot:
        kinds.setdefault((str(names[i]) if i < len(names) else "?", m, n), []).append(i)
    said = [f"GPU{'s' if len(ids) > 1 else ''} {','.join(map(str, ids))} ({name}, compute capability {m}.{n})"
            for (name, m, n), ids in kinds.items()]
    return f"{'; '.join(said[:SHOWN_GPUS])}{' and more' if len(said) > SHOWN_GPUS else ''} " \
           f"{'has' if len(cannot) == 1 else 'have'} no code in this torch"


def _kept(stdout: str, runtime: str = "docker") -> str:
    """How a kept answer (deploy/programs/probe_kept.sh, agent/probe.py) is said: when it was probed,
    by the node's clock."""
    what = "image" if runtime == "docker" else "interpreter's installation"
    for line in stdout.splitlines():
        word = line.split(" ", 1)
        if word[0] == PROBE_KEPT_PREFIX and len(word) == 2 and word[1].strip().isdigit() and len(word[1].strip()) < 12:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(word[1])))
            return f" (the answer the node kept for this {what} and probe command, probed {when})"
    return ""


def _program(inv: Inventory, r: Result, code: CodeDir | None) -> Check | None:
    """The probe's import of the job's program (train.module / train.script / the built-in
    trainer), where it will run; None when the probe itself gave no answer (``_torch`` says why)."""
    report = plan.json_line(r.stdout, PROBE_PREFIX)
    if report is None or report.get("error"):
        return None
    what = payload(inv).describe()
    where = runtime(inv, code).where() + (f", code snapshot {code.snapshot[:12]}" if code else "")
    if "program" not in report:
        return Check(r.node, "program", False, f"agent.probe in {runtime(inv).where()} cannot import a program: "
                                               f"a trainer older than this tool? {runtime(inv).install_hint()}")
    if report["program_error"]:
        fix = "train.module / train.script, or the code (train.code" + (")" if code else ", or the image)")
        return Check(r.node, "program", False, f"{what} does not import in {where}: {report['program_error']} "
                                               f"(check {fix})")
    return Check(r.node, "program", True, f"{what} imports in {where}")


def _platforms(inv: Inventory, up: list[str], results) -> list[Check]:
    """Each node's platform; on the docker runtime, a node whose platform differs from the first
    node's fails (the image is built for one platform)."""
    read = {n: builder.parse_platform(results[n]["platform"].stdout) for n in up if results[n]["platform"].ok}
    first = next((n for n in up if read.get(n)), None)
    out = []
    for node in up:
        r, platform = results[node]["platform"], read.get(node)
        if platform is None:
            said = r.summary() if not r.ok else repr(r.stdout.strip())
            out.append(Check(node, "platform", False, f"cannot tell the platform from "
                                                      f"`{' '.join(builder.node_platform_argv(inv))}`: {said}"))
        elif inv.job.runtime == "docker" and platform != read[first]:
            out.append(Check(node, "platform", False, f"{platform}, unlike {first}'s {read[first]}: one image serves "
                                                      f"one platform (leave it out: --without {node})"))
        else:
            out.append(Check(node, "platform", True, platform))
    return out


def _storage(inv: Inventory, r: Result) -> Check:
    s = inv.storage
    need_kb = s.min_free_gb * 1024 * 1024
    if not r.ok:
        return Check(r.node, "storage", False, r.summary())
    problems, notes = [], []
    for line in r.stdout.splitlines():
        kind, path, rest = (line.split(" ", 2) + ["", ""])[:3]
        if kind == "FAIL":
            problems.append(f"{path}: {rest}")
            continue
        free_kb = int(rest.split()[0])
        if free_kb < need_kb:
            problems.append(f"{path}: {free_kb / 1048576:.1f} GB free, need {s.min_free_gb:g}")
        if kind == "MISSING":
            notes.append(f"{path} missing (deploy creates it)")
    detail = "; ".join(problems or notes) or "exists, writable, enough space"
    return Check(r.node, "storage", not problems, detail)


def shared(inv: Inventory, up: list[str], results, tokens) -> list[Check]:
    """The first reachable node's token, written in phase 1, must be read by every other node."""
    if len(inv.nodes) < 2:
        return [Check(n, "shared storage", True, "single node") for n in up]
    if len(up) < 2:
        return []
    ref, ckpt = up[0], inv.storage.checkpoints.host
    w = results[ref]["token"]
    path = w.stdout.strip()
    if not path:
        return [Check(n, "shared storage", False, f"cannot write under {ckpt} on {ref}") for n in up]
    if not w.ok:
        return [Check(ref, "shared storage", False, f"cannot write {path}: {w.summary()}")]
    out = [Check(ref, "shared storage", True, f"wrote token to {os.path.dirname(path)}")]
    for n in up[1:]:
        r = results[n]["seen"]
        same = r.ok and r.stdout.strip() == tokens[ref]
        out.append(Check(n, "shared storage", same,
                         f"sees {ref}'s token" if same else f"does not see {path} written by {ref}: "
                         "not the same storage"))
    return out


_ACCEPTED = re.compile(r"accepted (\d+) of \d+")


def rendezvous(inv: Inventory, up: list[str], results) -> list[Check]:
    rdzv = inv.rdzv_node
    port = inv.rendezvous.port
    if rdzv.name not in up:
        return [Check(rdzv.name, "rendezvous", False, "endpoint node unreachable")]
    others = [n for n in up if n != rdzv.name]
    out = []
    for node in up:
        r = results[node]["rdzv"]
        if node == rdzv.name:
            got = _ACCEPTED.search(r.stdout)
            ok = got is not None and r.exit_code in (0, 4) and int(got[1]) >= len(others)
            if ok:
                detail = f"port {port} free"
            elif got is not None and r.exit_code in (0, 4):
                detail = f"accepted {got[1]} of {len(others)}"
            else:
                detail = r.stdout.strip() or r.summary()
        else:
            ok = r.ok
            detail = f"reaches {rdzv.address}:{port}" if ok else f"cannot reach {rdzv.address}:{port}"
        out.append(Check(node, "rendezvous", ok, detail))
    return out


def gpu_holds(inv: Inventory, r: Result) -> Check:
    """The job's GPUs on a node are free, or the holders are named (agent/holds.py's ``list``:
    one JSON line per holder, what the node's kernel says of it, ``told`` as a sentence)."""
    devices = inv.node(r.node).devices
    if not r.ok:
        asker = runtime(inv).listener_python()
        return Check(r.node, "gpus free", False,
                     f"cannot tell who holds GPUs {_ids(devices)}: {r.summary()} (the node's {asker} asks)")
    said = []
    for line in r.stdout.splitlines()[:64]:
        try:
            said.append(text.safe(str(json.loads(line)["told"]))[:600])
        except (ValueError, KeyError, TypeError, AttributeError):
            said.append(f"an answer not understood: {text.safe(line)[:200]}")
    if not said:
        return Check(r.node, "gpus free", True, f"no other job holds GPUs {_ids(devices)}")
    return Check(r.node, "gpus free", False, "; ".join(said) + ": stop that job first, or give this job other GPUs "
                                                           "(nodes[].gpu_ids)")


def _ids(devices) -> str:
    return ",".join(map(str, devices))


def _previous_run(r: Result) -> Check:
    if not r.ok:
        return Check(r.node, "previous run", False, r.summary())
    st = plan.parse_status(r.stdout)
    if st.running:
        detail = "still running: run `ddp-deploy stop` first"
    elif st.exists:
        detail = f"finished ({st.state}); launch clears it and the job resumes from its checkpoint"
    else:
        detail = "none"
    return Check(r.node, "previous run", not st.running, detail)
