"""The checks a node runs in the preflight session, each its node-side command beside the judge of
what that command printed (deploy/checks/preflight.py runs the session: one command per node that
runs every check's argv at once). A judge talks to no node: it is a function of recorded output,
and tests/check_outputs/ holds outputs recorded from real nodes for each.

The checks, in the order the session runs them and ``check`` shows them: the runtime's engine,
the platform, the probe (torch and CUDA where the job runs, and the program importing there), the
GPUs, who holds them, the storage, then how the nodes meet (deploy/checks/meetings.py), the
previous run; last, two facts that shape the launch command and show no row (the NIC holding the
node's address, InfiniBand devices).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.contract import PROBE_KEPT_PREFIX, PROBE_MODULE, PROBE_PREFIX, TORCH_SUPPORTED, program

from .. import text
from ..images import platforms
from ..inventory import Inventory, Node
from ..job import plan
from ..job.payload import payload
from ..job.runtime import CodeDir, runtime
from ..nodes.remote import Result
from ..programs import node_program
from . import gpu_arch
from .versions import torch_supported

PROBE_SECONDS = 60
"""How long agent.probe may take on a node (the session's limit for each check)."""
HOLDS = program("holds")


@dataclass(frozen=True)
class Check:
    """One row of ``check``: a node, what was checked, whether it passed, and what was found."""

    node: str
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Asked:
    """What a session asks beyond the inventory: ``code``, the synced snapshot the program must
    import from; ``for_launch``: a launch's checks (the image must be on the node already, and a
    probe answer the node kept for the same command and image serves)."""

    code: CodeDir | None = None
    for_launch: bool = False


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


Results = Mapping[str, Mapping[str, Result]]
"""Each reachable node's results, by check tag (a tag that printed nothing: a failed Result)."""


class NodeCheck:
    """One check: ``argv`` runs on a node, ``judge`` turns what every reachable node printed for
    ``tag`` into rows. A check judged node by node says so in ``judge_one``."""

    tag = ""

    def applies(self, inv: Inventory, node: Node) -> bool:
        return True

    def argv(self, inv: Inventory, node: Node, asked: Asked) -> Sequence[str]:
        raise NotImplementedError

    def judge(self, inv: Inventory, up: list[str], results: Results, asked: Asked) -> list[Check]:
        rows = (self.judge_one(inv, results[n][self.tag], asked) for n in up if self.applies(inv, inv.node(n)))
        return [row for row in rows if row is not None]

    def judge_one(self, inv: Inventory, r: Result, asked: Asked) -> Check | None:
        raise NotImplementedError


class EngineCheck(NodeCheck):
    """The runtime's engine answers (docker); the host runtime has none: its probe is that check."""

    tag = "engine"

    def applies(self, inv, node):
        return runtime(inv).engine_argv() is not None

    def argv(self, inv, node, asked):
        return runtime(inv).engine_argv()

    def judge_one(self, inv, r, asked):
        if not r.ok:
            return Check(r.node, inv.job.runtime, False, f"{inv.job.runtime} engine not usable: {r.summary()}")
        return Check(r.node, inv.job.runtime, True, f"engine {r.stdout.strip()}")


class PlatformCheck(NodeCheck):
    """Each node's platform (its engine's, or the kernel's on the host runtime); on the docker
    runtime a node whose platform differs from the first node's fails: one image serves one."""

    tag = "platform"

    def argv(self, inv, node, asked):
        return platforms.node_platform_argv(inv)

    def judge(self, inv, up, results, asked):
        engine = EngineCheck()
        usable = [n for n in up if not engine.applies(inv, inv.node(n)) or results[n][engine.tag].ok]
        return _platforms(inv, usable, results)


def _platforms(inv: Inventory, up: list[str], results) -> list[Check]:
    """Each node's platform; on the docker runtime, a node whose platform differs from the first
    node's fails (the image is built for one platform)."""
    read = {n: platforms.parse_platform(results[n][PlatformCheck.tag].stdout) for n in up if results[n][PlatformCheck.tag].ok}
    first = next((n for n in up if read.get(n)), None)
    out = []
    for node in up:
        r, platform = results[node][PlatformCheck.tag], read.get(node)
        if platform is None:
            said = r.summary() if not r.ok else repr(r.stdout.strip())
            out.append(Check(node, "platform", False, f"cannot tell the platform from "
                                                      f"`{' '.join(platforms.node_platform_argv(inv))}`: {said}"))
        elif inv.job.runtime == "docker" and platform != read[first]:
            out.append(Check(node, "platform", False, f"{platform}, unlike {first}'s {read[first]}: one image serves "
                                                      f"one platform (leave it out: --without {node})"))
        else:
            out.append(Check(node, "platform", True, platform))
    return out



class ProbeCheck(NodeCheck):
    """agent.probe where the job runs: torch and CUDA judged (a row ``torch``), then the job's
    program importing there (a row ``program``)."""

    tag = "probe"

    def argv(self, inv, node, asked):
        return plan.probe_argv(inv, node, asked.code, reuse=asked.for_launch)

    def judge(self, inv, up, results, asked):
        rows = [_torch(inv, results[n][self.tag], asked.for_launch) for n in up]
        return rows + [c for c in (_program(inv, results[n][self.tag], asked.code) for n in up) if c is not None]


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



class GpusCheck(NodeCheck):
    """The node shows at least the GPUs it lists (``nvidia-smi -L``: a ``GPU N: ...`` line each)."""

    tag = "gpus"

    def applies(self, inv, node):
        return node.gpus > 0

    def argv(self, inv, node, asked):
        return ("nvidia-smi", "-L")

    def judge_one(self, inv, r, asked):
        if not r.ok:
            return Check(r.node, "gpus", False, f"nvidia-smi failed: {r.summary()}")
        want = inv.node(r.node).gpus
        have = sum(1 for line in r.stdout.splitlines() if line.startswith("GPU "))
        return Check(r.node, "gpus", have >= want, f"{have} GPUs, need {want}")


class HoldsCheck(NodeCheck):
    """Who holds the GPUs this job would use, from the node's kernel (agent/holds.py)."""

    tag = "holds"

    def applies(self, inv, node):
        return bool(node.devices)

    def argv(self, inv, node, asked):
        return (runtime(inv).listener_python(), "-c", HOLDS, "list", *map(str, node.devices))

    def judge_one(self, inv, r, asked):
        return gpu_holds(inv, r)


def gpu_holds(inv: Inventory, r: Result) -> Check:
    """The job's GPUs on a node are free, or the holders are named (agent/holds.py's ``list``:
    one JSON line per holder, what the node's kernel says of it, ``told`` as a sentence)."""
    devices = inv.node(r.node).devices
    if not r.ok:
        asker = runtime(inv).listener_python()
        return Check(r.node, "gpus free", False,
                     f"cannot tell who holds GPUs {_ids(devices)}: {r.summary()} (the node's {asker} asks)")
    said = []
    for line in [line for line in r.stdout.splitlines() if line.strip()][:64]:
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



# $@ = paths. Per path: "OK PATH FREE_KB" | "MISSING PATH FREE_KB ANCESTOR" | "FAIL PATH why".
STORAGE = node_program("storage.sh")


class StorageCheck(NodeCheck):
    """The data and checkpoint directories exist (or their nearest ancestor does), are writable,
    and have ``storage.min_free_gb`` free."""

    tag = "storage"

    def argv(self, inv, node, asked):
        s = inv.storage
        return ("sh", "-c", STORAGE, "sh", s.data.host, s.checkpoints.host)

    def judge_one(self, inv, r, asked):
        return _storage(inv, r)


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



class PreviousRunCheck(NodeCheck):
    """The job's previous run on the node has ended (a launch replaces it)."""

    tag = "status"

    def argv(self, inv, node, asked):
        return plan.status_argv(inv, node)

    def judge_one(self, inv, r, asked):
        return _previous_run(r)


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


# Lists /dev/infiniband's devices, if any (exit 0 either way).
FABRIC = "ls /dev/infiniband 2>/dev/null; exit 0"


class NicsFact(NodeCheck):
    """The node's interfaces and addresses: the NIC holding its address goes into its launch."""

    tag = "nics"

    def argv(self, inv, node, asked):
        return plan.INTERFACES_ARGV

    def judge(self, inv, up, results, asked):
        return []

    @staticmethod
    def fact(node: Node, r: Result | None) -> str | None:
        return plan.interface_holding(node.address, r.stdout) if r is not None and r.ok else None


class FabricFact(NodeCheck):
    """InfiniBand devices on the node, if any."""

    tag = "fabric"

    def argv(self, inv, node, asked):
        return ("sh", "-c", FABRIC)

    def judge(self, inv, up, results, asked):
        return []

    @staticmethod
    def fact(r: Result | None) -> bool:
        return bool(r is not None and r.stdout.strip())


BEFORE_MEETING: tuple[NodeCheck, ...] = (EngineCheck(), PlatformCheck(), ProbeCheck(), GpusCheck(), HoldsCheck(),
                                         StorageCheck())
AFTER_MEETING: tuple[NodeCheck, ...] = (PreviousRunCheck(), NicsFact(), FabricFact())
