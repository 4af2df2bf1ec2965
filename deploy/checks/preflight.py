"""Checks run on every node before anything is started anywhere.

Every node runs ONE command (one SSH session: on fleets whose login shell runs conda or pyenv
init, each command costs a fraction of a second before it does anything), built by
:func:`check_argv`: a constant bash script that runs each check's argv list at the same time,
every value a positional argument, and prints tagged lines (``TAG o LINE``, ``TAG e LINE``,
``TAG rc CODE``) that :func:`parse_tagged` turns back into one :class:`Result` per check.

Two checks need the nodes to meet, and the session has two phases for them
(:func:`converse`):

- shared storage: in phase 1 every node writes its own token file under the checkpoint
  directory; once all have, the first reachable node is the reference and every other node
  reads the reference's token in phase 2; the reference ends last, and every node removes its
  own token file as it ends.
- rendezvous: the endpoint listens on the port during phase 1 while every other node connects.

An unreachable node gets one failed ``ssh`` (or ``local``) check naming the cause and no further
checks.

The same session reads each node's platform (its docker engine's, or the kernel's on the host
runtime): shown, and on the docker runtime nodes of another platform than the first node's are
refused (one image serves one platform; deploy builds it for the nodes' platform).

The same session gathers the node's facts that shape its launch command (:class:`NodeFacts`:
the NIC holding its address, InfiniBand devices), and runs ``trainer.probe`` where the job will
run (in the image, or with the host interpreter; with the job's GPUs): torch and CUDA versions,
judged against the supported range, and on GPU nodes whether CUDA works there at all.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from trainer import probe
from trainer.compat import TORCH_SUPPORTED

from ..images import build as builder
from ..inventory import Inventory, Node
from ..job import plan
from ..job.payload import payload
from ..job.runtime import CodeDir, NodeFacts, runtime
from ..node import node_program
from ..nodes.remote import Remote, Result
from . import gpu_arch
from .versions import torch_supported

# $@ = paths. Per path: "OK PATH FREE_KB" | "MISSING PATH FREE_KB ANCESTOR" | "FAIL PATH why".
STORAGE = node_program("storage.sh")

# $1 = directory, $2 = token. Writes the token into $1 (or its nearest existing ancestor, as
# STORAGE does); prints the file's path before writing it; exit 3: no writable directory.
TOKEN = node_program("token.sh")

# argv: PORT N TIMEOUT. Binds the port (fails if in use), accepts N connections or times out.
LISTEN = node_program("listen.py")

# $1 = address, $2 = port, $3 = seconds. Retries while the listener starts.
CONNECT = node_program("connect.bash")

MARKER = "@phase2"

# $1 = seconds each check may take, then per check: TAG N and the N words of its argv.
# Phase 1 starts every check at once, then prints each one's output as tagged lines (rc
# "124": it ran past the limit) and the MARKER line. Phase 2 reads one line from stdin:
# "READ PATH" prints PATH's content as tag "seen"; anything else, or EOF, just ends. On exit
# the node removes the token file its "token" check wrote.
PHASES = r"""limit=$1; shift
tmp=$(mktemp -d) || exit 1
mine=
trap 'rm -rf "$tmp"; [ -z "$mine" ] || timeout "$limit" rm -f "$mine"' EXIT
emit() {
  local line
  while IFS= read -r line || [ -n "$line" ]; do printf '%s o %s\n' "$1" "$line"; done < "$tmp/$1.o"
  while IFS= read -r line || [ -n "$line" ]; do printf '%s e %s\n' "$1" "$line"; done < "$tmp/$1.e"
  printf '%s rc %s\n' "$1" "$2"
}
tags=(); pids=()
while [ $# -gt 0 ]; do
  tag=$1; n=$2; shift 2
  timeout "$limit" "${@:1:n}" < /dev/null > "$tmp/$tag.o" 2> "$tmp/$tag.e" &
  tags+=("$tag"); pids+=($!)
  shift "$n"
done
for i in "${!tags[@]}"; do
  wait "${pids[i]}"; rc=$?
  [ "${tags[i]}" = token ] && mine=$(head -n 1 "$tmp/token.o")
  emit "${tags[i]}" "$rc"
done
echo '""" + MARKER + r"""'
if IFS= read -r -t $((2 * limit)) line && [ "${line%% *}" = READ ]; then
  timeout "$limit" cat "${line#READ }" < /dev/null > "$tmp/seen.o" 2> "$tmp/seen.e"
  emit seen $?
fi
"""

PROBE_SECONDS = 60
LISTEN_SECONDS = 15


@dataclass(frozen=True)
class Check:
    node: str
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Preflight:
    """Every check's row, and what the sessions found on each reachable node."""

    checks: list[Check]
    facts: dict[str, NodeFacts]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


# Lists /dev/infiniband's devices, if any (exit 0 either way).
FABRIC = "ls /dev/infiniband 2>/dev/null; exit 0"


def rendezvous_argv(inv: Inventory, node: Node) -> tuple[str, ...]:
    """The endpoint listens for every other node; every other node connects to it."""
    rdzv, port = inv.rdzv_node, str(inv.rendezvous.port)
    if node.name == rdzv.name:
        return (runtime(inv).listener_python(), "-c", LISTEN, port, str(len(inv.nodes) - 1), str(LISTEN_SECONDS))
    return ("bash", "-c", CONNECT, "bash", rdzv.address, port, str(LISTEN_SECONDS))


def check_argv(inv: Inventory, node: Node, token: str, code: CodeDir | None = None,
               meeting: Sequence[tuple[str, Sequence[str]]] | None = None, *, reuse_probe: bool = False
               ) -> tuple[str, ...]:
    """The one command run on ``node``; ``token`` is empty for a one-node inventory; ``code``: the
    code snapshot the probe imports the program from; ``meeting``: the checks by which the node
    meets the others (default: the fleet's, :class:`FleetMeeting`); ``reuse_probe``: a probe
    answer the node kept for the same command and image serves (a launch's checks; ``check``
    itself always probes, and keeps a good answer)."""
    s = inv.storage
    engine = runtime(inv).engine_argv()
    checks: list[tuple[str, Sequence[str]]] = [("engine", engine)] if engine else []
    checks.append(("platform", builder.node_platform_argv(inv)))
    checks.append(("probe", plan.probe_argv(inv, node, code, reuse=reuse_probe)))
    if node.gpus > 0:
        checks.append(("gpus", ("nvidia-smi", "-L")))
    checks.append(("storage", ("sh", "-c", STORAGE, "sh", s.data.host, s.checkpoints.host)))
    if meeting is None:
        meeting = FleetMeeting.meeting_checks(inv, node, token)
    checks += [*meeting, ("status", plan.status_argv(inv, node)),
               ("nics", plan.INTERFACES_ARGV), ("fabric", ("sh", "-c", FABRIC))]
    argv = ["bash", "-c", PHASES, "bash", str(PROBE_SECONDS)]
    for tag, words in checks:
        argv += [tag, str(len(words)), *words]
    return tuple(argv)


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


def token_waves(inv: Inventory, first: Mapping[str, Result]) -> list[dict[str, str]]:
    """Phase 2: the other nodes read the reference's token, then the reference ends."""
    up = [n.name for n in inv.nodes if first[n.name].connected]
    if len(up) < 2:
        return []
    token = parse_tagged(up[0], first[up[0]].stdout).get("token")
    path = token.stdout.strip() if token is not None and token.ok else ""
    if not path:
        return []
    return [{n: f"READ {path}\n" for n in up[1:]}, {up[0]: ""}]


class FleetMeeting:
    """How the nodes of a launch (or ``check``) meet: through shared storage (every node writes a
    token in phase 1, the others read the first node's in phase 2) and at the rendezvous (the
    endpoint listens on the port, free, while every other node connects)."""

    def __init__(self, inv: Inventory) -> None:
        self.inv = inv
        self.tokens = {n.name: secrets.token_hex(16) for n in inv.nodes} if len(inv.nodes) > 1 else {}

    @staticmethod
    def meeting_checks(inv: Inventory, node: Node, token: str) -> list[tuple[str, Sequence[str]]]:
        out: list[tuple[str, Sequence[str]]] = []
        if token:
            out.append(("token", ("sh", "-c", TOKEN, "sh", inv.storage.checkpoints.host, token)))
        return [*out, ("rdzv", rendezvous_argv(inv, node))]

    def argv(self, node: Node, code: CodeDir | None, reuse_probe: bool) -> tuple[str, ...]:
        return check_argv(self.inv, node, self.tokens.get(node.name, ""), code, reuse_probe=reuse_probe)

    def waves(self, first: Mapping[str, Result]) -> list[dict[str, str]]:
        return token_waves(self.inv, first)

    def judge(self, up: list[str], results) -> list[Check]:
        return _shared(self.inv, up, results, self.tokens) + _rendezvous(self.inv, up, results)


class JoinMeeting:
    """How a node meets a job that runs already (``ddp-deploy join``): in phase 2 it reads the
    job's launch record on the shared storage, which must match what a running node read there,
    and it reaches the job's rendezvous store, which listens."""

    def __init__(self, inv: Inventory, record_path: str, record_text: str) -> None:
        self.inv, self.path, self.text = inv, record_path, record_text

    def argv(self, node: Node, code: CodeDir | None, reuse_probe: bool) -> tuple[str, ...]:
        rdzv = self.inv.rdzv_node
        reach = ("bash", "-c", CONNECT, "bash", rdzv.address, str(self.inv.rendezvous.port), str(LISTEN_SECONDS))
        return check_argv(self.inv, node, "", code, meeting=[("rdzv", reach)], reuse_probe=reuse_probe)

    def waves(self, first: Mapping[str, Result]) -> list[dict[str, str]]:
        return [{n: f"READ {self.path}\n" for n, r in first.items() if r.connected}]

    def judge(self, up: list[str], results) -> list[Check]:
        rdzv, port = self.inv.rdzv_node, self.inv.rendezvous.port
        out = []
        for node in up:
            seen = results[node]["seen"]
            same = seen.ok and seen.stdout.strip() == self.text.strip()
            out.append(Check(node, "shared storage", same, f"sees the running job's launch record {self.path}" if same
                             else f"does not see the running job's launch record {self.path} "
                                  f"({seen.summary() if not seen.ok else 'another content'}): not the same storage"))
            reached = results[node]["rdzv"].ok
            out.append(Check(node, "rendezvous", reached, f"reaches the running job's store at {rdzv.address}:{port}"
                             if reached else f"cannot reach the running job's store at {rdzv.address}:{port}"))
        return out


def run_checks(inv: Inventory, remote: Remote, *, for_launch: bool = False, code: CodeDir | None = None) -> Preflight:
    """Every check on every node, one session each; ``for_launch``: the image must be on the
    nodes already (``check`` alone accepts a node that ``deploy`` has yet to ship it to);
    ``code``: the synced code snapshot (train.code), where the program must import."""
    return _run(inv, remote, inv.nodes, FleetMeeting(inv), for_launch=for_launch, code=code)


def join_checks(inv: Inventory, remote: Remote, node: str, record: tuple[str, str],
                code: CodeDir | None = None) -> Preflight:
    """The launch's checks on ``node`` alone, before it joins the job that runs on the others
    (``inv``'s rendezvous node hosts its store): ``record`` is the job's launch record (path,
    content) as a running node read it, which ``node`` must see the same on the shared storage."""
    return _run(inv, remote, (inv.node(node),), JoinMeeting(inv, *record), for_launch=True, code=code)


def _run(inv: Inventory, remote: Remote, nodes: Sequence[Node], meeting, *, for_launch: bool,
         code: CodeDir | None) -> Preflight:
    commands = {n.name: meeting.argv(n, code, for_launch) for n in nodes}
    first: dict[str, Result] = {}

    def reply(phase1: dict[str, Result]) -> list[dict[str, str]]:
        first.update(phase1)
        return meeting.waves(phase1)

    final = converse(remote, commands, marker=MARKER, reply=reply, timeout=PROBE_SECONDS + LISTEN_SECONDS + 30)
    return Preflight(checks_from(inv, first, final, meeting, for_launch=for_launch, code=code, nodes=nodes),
                     facts_from(inv, first, final, nodes))


def converse(
    remote: Remote,
    commands: Mapping[str, Sequence[str]],
    *,
    marker: str,
    reply: Callable[[dict[str, Result]], Sequence[Mapping[str, str]]],
    timeout: float | None = None,
) -> dict[str, Result]:
    """Run commands whose stdin stays open, in two phases with one barrier between them.

    Once every node has printed the line ``marker`` (or ended, or failed to start),
    ``reply`` gets each node's output so far (``exit_code`` None while it still runs) and
    returns waves of ``{node: text}``: each wave's nodes get their text on stdin, then EOF,
    and are read to the end before the next wave starts; nodes in no wave get EOF last.
    Each node's final :class:`Result` holds its whole output except the marker line. One
    command per node however many phases: a login shell that is slow to start starts once.
    ``timeout`` bounds each wait for output.
    """
    sessions = {}
    first: dict[str, Result] = {}

    def start(node: str) -> Result:
        s = sessions[node] = remote.start(node, commands[node], timeout)
        lines = []
        try:
            while raw := s.readline():
                line = raw.decode(errors="replace")
                if line.rstrip("\n") == marker:
                    return Result(node, None, "".join(lines))
                lines.append(line)
        except BaseException:
            sessions.pop(node).close()
            raise
        code, _, err = sessions.pop(node).finish(b"")
        return Result(node, code, "".join(lines), err.decode(errors="replace"))

    def finish(node: str, text: str) -> Result:
        code, rest, err = sessions.pop(node).finish(text.encode())
        return Result(node, code, first[node].stdout + rest.decode(errors="replace"), err.decode(errors="replace"))

    try:
        first.update(remote.parallel(list(commands), start))
        final = {n: r for n, r in first.items() if n not in sessions}
        for wave in [*reply(dict(first)), {n: "" for n in commands}]:
            todo = {n: text for n, text in wave.items() if n in sessions}
            final.update(remote.parallel(list(todo), lambda n: finish(n, todo[n])))
    finally:
        for s in sessions.values():
            s.close()
    return {n: final[n] for n in commands}


def facts_from(inv: Inventory, first: Mapping[str, Result], final: Mapping[str, Result],
               nodes: Sequence[Node] | None = None) -> dict[str, NodeFacts]:
    facts = {}
    for n in inv.nodes if nodes is None else nodes:
        if not first[n.name].connected:
            continue
        got = parse_tagged(n.name, final[n.name].stdout)
        nics, fabric = got.get("nics"), got.get("fabric")
        facts[n.name] = NodeFacts(
            interface=plan.interface_holding(n.address, nics.stdout) if nics is not None and nics.ok else None,
            infiniband=bool(fabric is not None and fabric.stdout.strip()))
    return facts


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


PROBE_PREFIX, PROBE_KEPT = probe.PREFIX, probe.KEPT_PREFIX  # what trainer.probe prints (probe_kept.sh too)
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
        if "No module named 'trainer'" in said:
            return fail(f"{where} cannot import trainer: {rt.install_hint()}")
        if "No module named trainer.probe" in said:
            return fail(f"{where} has a trainer older than trainer.probe: {rt.install_hint()}")
        if r.exit_code == 127:
            return fail(f"cannot run {where}: {(r.stderr.strip().splitlines() or ['not found'])[-1]}")
        if r.exit_code == 124:
            return fail(f"trainer.probe in {where} took longer than {PROBE_SECONDS} s (CUDA or the image stuck?)")
        return fail(f"{where}: trainer.probe failed: {r.summary()}")
    if report.get("error"):
        return fail(f"{where}: {report['error']}")
    if any(key not in report for key in PROBE_KEYS):
        return fail(f"{where}: trainer.probe answered without {', '.join(k for k in PROBE_KEYS if k not in report)}: "
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
    """How a kept answer (deploy/node/probe_kept.sh, trainer/probe.py) is said: when it was probed,
    by the node's clock."""
    what = "image" if runtime == "docker" else "interpreter's installation"
    for line in stdout.splitlines():
        word = line.split(" ", 1)
        if word[0] == PROBE_KEPT and len(word) == 2 and word[1].strip().isdigit() and len(word[1].strip()) < 12:
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
        return Check(r.node, "program", False, f"trainer.probe in {runtime(inv).where()} cannot import a program: "
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


def _shared(inv: Inventory, up: list[str], results, tokens) -> list[Check]:
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


def _rendezvous(inv: Inventory, up: list[str], results) -> list[Check]:
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
