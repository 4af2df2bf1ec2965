"""The GPU acceptance check: everything GPU-specific, in one go, through the paths users run.

Run: python bench/gpu_check.py [--out DIR] [--list]      (make gpu-check)

Every training run goes through the launcher users run (``python -m agent.launch``, torchrun
in-process) on the synthetic dataset; the steps are listed by ``--list``. Each step is recorded
as {name, ok (true, false, or null when skipped), seconds, summary, detail}. A step that fails
keeps the last lines of its run's output, and the other steps still run. The record goes to
DIR/gpu-check-<UTC time>.json (DIR: bench/results) and a table to stdout; the exit code is 0
only when every step that ran passed. Without a CUDA device it says so on stderr, writes
nothing and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results"
TAIL = 20                                      # output lines kept from a failed run
TARGETS = {"a_over_b": 10.0, "a_over_c": 0.9}  # bench/RESULTS.md: the targets on a GPU
LAUNCHER_REPORT = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
MARKER = re.compile(r"ckpt-(\d+)\.pt\.ok$")
RANKED = re.compile(r"^(?:\[rank\d+\]: ?)+")

COMMON = ("--dataset", "synthetic", "--dist-timeout", "120")
SHORT = ("--synthetic-size", "2048", "--batch-size", "64", "--epochs", "1", "--log-every", "8")
AMP = ("--model", "resnet", "--synthetic-size", "4096", "--batch-size", "64", "--epochs", "2", "--log-every", "8")


@dataclass(frozen=True)
class ResumeRun:
    """The run that is killed after a mid-epoch checkpoint (one process), then relaunched."""

    size: int = 8192
    batch: int = 32
    epochs: int = 2
    ckpt_every: int = 40   # not a divisor of an epoch's steps: the first checkpoint is mid-epoch

    def flags(self) -> tuple[str, ...]:
        return ("--synthetic-size", str(self.size), "--batch-size", str(self.batch), "--epochs", str(self.epochs),
                "--log-every", str(self.ckpt_every), "--ckpt-every", str(self.ckpt_every))

    def mid_epoch(self, step: int) -> bool:
        return step % (self.size // self.batch) != 0


@dataclass(frozen=True)
class Check:
    """What every step runs with. main() always checks cuda with nccl; tests use cpu with gloo."""

    work: Path                  # scratch: the dataset and one folder per run
    out: Path                   # where the bench writes its record
    gpus: int = 1
    device: str = "cuda"
    backend: str = "nccl"
    python: str = sys.executable
    timeout: float = 180        # seconds, for each training run (each takes well under a minute on a GPU)
    bench_timeout: float = 300  # seconds, for the bench (the whole check fits in 10 minutes)
    amp_flags: tuple[str, ...] = AMP
    short_flags: tuple[str, ...] = SHORT
    resume: ResumeRun = ResumeRun()
    # On a GPU a step of the convnet takes ~3 ms: 300 timed steps a round, and metrics every 50 (the
    # trainer's default), not every 10 as on the CPU, where a step takes ~100 ms.
    bench_args: tuple[str, ...] = ("--rounds", "5", "--steps", "300", "--warmup", "50")


class StepFailed(Exception):
    """A run failed, timed out or said something unexpected; carries its last output lines."""

    def __init__(self, message: str, tail: list[str] | None = None) -> None:
        super().__init__(message)
        self.tail = tail or []


# --- subprocesses: every one in its own process group, with a timeout --------------------------

@dataclass
class Run:
    """One subprocess; its output goes to files in its folder (an undrained pipe could block it)."""

    cmd: list[str]
    folder: Path
    proc: subprocess.Popen = field(repr=False)

    def stdout(self) -> str:
        return (self.folder / "stdout.log").read_text(errors="replace")

    def stderr(self) -> str:
        return (self.folder / "stderr.log").read_text(errors="replace")

    def tail(self) -> list[str]:
        return last_lines(self.stderr()) or last_lines(self.stdout())

    def kill(self) -> None:
        """SIGKILL to the whole group: torchrun and every worker it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def start(cmd: list[str], folder: Path) -> Run:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "stdout.log", "w") as out, open(folder / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=child_env(), cwd=ROOT, start_new_session=True)
    return Run(cmd, folder, proc)


def finish(run: Run, timeout: float) -> Run:
    """Waits for the run; a run past its timeout is killed. Raises StepFailed unless it exited 0."""
    try:
        run.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        raise StepFailed(f"run {run.folder.name}: timed out after {timeout:.0f} s", run.tail()) from None
    except BaseException:  # Ctrl-C: the run has its own session, so it would outlive this process
        run.kill()
        raise
    if run.proc.returncode != 0:
        raise StepFailed(f"run {run.folder.name}: exit code {run.proc.returncode}", run.tail())
    return run


def last_lines(text: str, n: int = TAIL) -> list[str]:
    """The last n non-blank lines. torchrun ends a failed run with its own traceback, which says
    only that a worker failed: that report is left out, so the workers' error is what is kept."""
    lines = [line for line in text.splitlines() if line.strip()]
    if any(LAUNCHER_REPORT in line for line in lines):
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
        lines = lines[:starts[-1]] if starts else lines
    return lines[-n:]


def torchrun_cmd(check: Check, run_dir: Path, *flags: str, nproc: int = 1) -> list[str]:
    """The launcher users run (torchrun in-process, standalone on this machine), then trainer flags."""
    return [check.python, "-m", "agent.launch", "--standalone", "--nproc-per-node", str(nproc), "--",
            "--device", check.device, "--backend", check.backend, *COMMON,
            "--data-dir", str(check.work / "data"), "--ckpt-dir", str(run_dir / "ckpt"), *flags]


def train(check: Check, name: str, *flags: str, nproc: int = 1) -> tuple[Run, list[dict]]:
    """One whole training run; returns it and its metrics records (metrics.jsonl)."""
    run_dir = check.work / name
    run = finish(start(torchrun_cmd(check, run_dir, *flags, nproc=nproc), run_dir), check.timeout)
    return run, read_jsonl(run_dir / "ckpt" / "metrics.jsonl")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def printed_metrics(stdout: str) -> list[dict]:
    """The records rank 0 printed, in order (``METRICS`` lines; agent.launch has torchrun echo
    them with the rank in front, ``[rank0]: ``)."""
    lines = (RANKED.sub("", line, count=1) for line in stdout.splitlines())
    return [json.loads(line[len("METRICS "):]) for line in lines if line.startswith("METRICS ")]


def command_output(cmd: list[str], timeout: float = 30) -> str | None:
    """stdout of a short command, or None where it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return proc.stdout if proc.returncode == 0 else None


# --- judgements: pure functions of what the runs wrote -----------------------------------------

def judge_final(records: list[dict], backend: str, world_size: int) -> tuple[bool, str, dict]:
    final = records[-1] if records else {}
    if final.get("kind") != "final":
        return False, "no final record in metrics.jsonl", {}
    ok = final.get("backend") == backend and final.get("world_size") == world_size
    figures = {k: final.get(k) for k in ("backend", "world_size", "step", "eval_loss", "eval_acc")}
    summary = f"backend {final.get('backend')}, world_size {final.get('world_size')}"
    if not ok:
        summary += f" (expected {backend}, {world_size})"
    return ok, summary, figures


def judge_losses(records: list[dict]) -> tuple[bool, str, dict]:
    """Training losses must all be finite and the last interval's lower than the first's."""
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    figures = {"train_losses": losses}
    if len(losses) < 2:
        return False, f"{len(losses)} training interval(s) logged: too few to compare", figures
    bad = sum(not math.isfinite(x) for x in losses)
    if bad:
        return False, f"{bad} of {len(losses)} interval losses are not finite", figures
    ok = losses[-1] < losses[0]
    return ok, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" + ("" if ok else " (did not decrease)"), figures


def judge_relaunch(stderr: str, printed: list[dict], killed_at: int, expected_final_step: int) -> list[str]:
    """What is wrong with the relaunch after the kill (nothing: an empty list)."""
    problems = []
    if "resumed from" not in stderr:
        problems.append('the relaunch did not log "resumed from"')
    first = printed[0] if printed else {}
    if first.get("kind") != "resumed":
        problems.append(f"its first METRICS record is {first.get('kind')!r}, not 'resumed'")
    elif first.get("step", -1) < killed_at:
        problems.append(f"it resumed at step {first.get('step')}, before the checkpoint at {killed_at}")
    last = printed[-1] if printed else {}
    if last.get("kind") != "final" or last.get("step") != expected_final_step:
        problems.append(f"it ended at {last.get('kind')} step {last.get('step')}, "
                        f"the uninterrupted run at final step {expected_final_step}")
    return problems


def compare_weights(a: dict, b: dict) -> dict:
    """Bit-identity and the largest difference between two state dicts with the same keys."""
    import torch

    if a.keys() != b.keys():
        raise StepFailed(f"the final models differ in their keys: {sorted(set(a) ^ set(b))}")
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    max_diff = max(((a[k].double() - b[k].double()).abs().max().item() for k in differing), default=0.0)
    return {"bit_identical": not differing, "tensors": len(a), "tensors_differing": len(differing),
            "max_abs_diff": max_diff}


def judge_targets(record: dict, targets: dict[str, float] = TARGETS) -> tuple[bool, str, dict]:
    """The bench record's headline ratios against the targets (each met when >= its target)."""
    met = {name: record[name] >= target for name, target in targets.items()}
    figures = {**{name: record[name] for name in targets}, "targets": targets, "met": met,
               "per_round": record.get("per_round"), "median_samples_per_s": record.get("median"),
               "device_name": record.get("device_name")}
    summary = ", ".join(f"{n.replace('_over_', '/')} {record[n]:.2f} ({'>=' if met[n] else '<'} {t:g})"
                        for n, t in targets.items())
    return all(met.values()), summary, figures


def nccl_version(raw) -> str | None:
    """torch.cuda.nccl.version(): a tuple (2, 21, 5) in recent torch, an int in old ones."""
    if raw is None:
        return None
    return ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)


def parse_nvidia_smi(text: str) -> list[dict]:
    """``nvidia-smi --query-gpu=name,driver_version --format=csv,noheader`` -> one dict per GPU."""
    gpus = []
    for line in text.splitlines():
        name, _, driver = line.rpartition(",")
        if name.strip():
            gpus.append({"name": name.strip(), "driver": driver.strip()})
    return gpus


def exit_code(steps: list[dict]) -> int:
    """0 when every step that ran passed (skipped steps, ok None, count as neither)."""
    return 0 if all(step["ok"] is not False for step in steps) else 1


def report_name(now: datetime) -> str:
    return f"gpu-check-{now.astimezone(timezone.utc):%Y%m%dT%H%M%SZ}.json"


def no_cuda_message(torch_version: str, cuda_build: str | None) -> str:
    return (f"gpu-check: no CUDA device visible (torch {torch_version}, CUDA build {cuda_build or 'none'}): "
            f"run it on a machine with an NVIDIA GPU")


def format_table(steps: list[dict]) -> str:
    word = {True: "PASS", False: "FAIL", None: "SKIP"}
    lines = [f"{'step':12s} {'result':6s} {'seconds':>8s}  summary"]
    for step in steps:
        lines.append(f"{step['name']:12s} {word[step['ok']]:6s} {step['seconds']:8.1f}  {step['summary']}")
    return "\n".join(lines)


# --- the steps: each returns (ok, summary, detail); ok None is a skip ---------------------------

def step_environment(check: Check) -> tuple[bool, str, dict]:
    import torch

    count = torch.cuda.device_count()
    smi = command_output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    detail = {
        "torch": torch.__version__, "cuda_build": torch.version.cuda, "device_count": count,
        "devices": [{"name": torch.cuda.get_device_name(i),
                     "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))} for i in range(count)],
        "nvidia_smi": parse_nvidia_smi(smi) if smi is not None else "nvidia-smi not found or failed",
        "nccl": nccl_version(torch.cuda.nccl.version()),
        "bf16_supported": torch.cuda.is_bf16_supported(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        # what `check` judges on a node of these GPUs (the build's architectures against each
        # device's): agent.probe's answer, as deploy runs it; tests/test_deploy_probe.py judges it
        "probe": probe_report(count),
    }
    drivers = sorted({g["driver"] for g in detail["nvidia_smi"]}) if smi is not None else ["unknown"]
    names = sorted({d["name"] for d in detail["devices"]})
    summary = (f"{count} x {', '.join(names)}, driver {', '.join(drivers)}, CUDA {torch.version.cuda}, "
               f"NCCL {detail['nccl']}")
    return count >= 1 and detail["nccl"] is not None, summary, detail


def probe_report(gpus: int) -> dict | str:
    """``python -m agent.probe`` on ``gpus`` GPUs: its report, or why there is none."""
    try:
        r = subprocess.run([sys.executable, "-m", "agent.probe", "--gpus", str(gpus), "--procs", str(max(gpus, 1))],
                           capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "agent.probe took longer than 300 s"
    for line in r.stdout.splitlines():
        if line.startswith("PROBE {"):
            return json.loads(line[len("PROBE "):])
    return f"agent.probe exited {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1]}"


def step_nccl_init(check: Check) -> tuple[bool, str, dict]:
    _, records = train(check, "nccl-init", *check.short_flags)
    return judge_final(records, check.backend, 1)


def amp_step(precision: str) -> Callable[[Check], tuple[bool, str, dict]]:
    def step(check: Check) -> tuple[bool, str, dict]:
        run, records = train(check, f"amp-{precision}", *check.amp_flags, "--amp", precision)
        ok, summary, detail = judge_losses(records)
        if precision == "fp16":
            detail["grad_scale"] = final_grad_scale(run.folder / "ckpt")
            summary += f", GradScaler scale {detail['grad_scale']}"
        return ok, summary, detail
    return step


def final_grad_scale(ckpt_dir: Path) -> float | None:
    """The GradScaler's scale in the newest checkpoint (None: no scaler state, it was not used)."""
    import torch

    newest = max(ckpt_dir.glob("ckpt-*.pt"), default=None)
    state = torch.load(newest, weights_only=True, map_location="cpu") if newest else {}
    scale = (state.get("scaler") or {}).get("scale")
    return float(scale) if scale is not None else None


def step_resume(check: Check) -> tuple[bool, str, dict]:
    flags = check.resume.flags()
    straight, _ = train(check, "resume-straight", *flags)
    resumed = check.work / "resume"
    killed_at = run_until_checkpoint_then_kill(check, resumed, flags)
    relaunch = finish(start(torchrun_cmd(check, resumed, *flags), resumed / "relaunch"), check.timeout)
    expected = read_jsonl(straight.folder / "ckpt" / "metrics.jsonl")[-1]["step"]
    problems = judge_relaunch(relaunch.stderr(), printed_metrics(relaunch.stdout()), killed_at, expected)
    if problems:
        raise StepFailed("; ".join(problems), relaunch.tail())
    uninterrupted = load_final(straight.folder / "ckpt")
    weights = compare_weights(uninterrupted, load_final(resumed / "ckpt"))
    detail = {"killed_after_checkpoint_step": killed_at, "final_step": expected, **weights}
    if not weights["bit_identical"]:
        # Either the resume is not exact, or the device's kernels are not deterministic (cuDNN's
        # algorithms, atomics): a second uninterrupted run tells which.
        again, _ = train(check, "resume-straight-again", *flags)
        detail["uninterrupted_twice"] = compare_weights(uninterrupted, load_final(again.folder / "ckpt"))
    ok, verdict = judge_weights(weights, detail.get("uninterrupted_twice"))
    return ok, f"killed after step {killed_at}, resumed and finished; final weights {verdict}", detail


def judge_weights(resumed: dict, twice: dict | None) -> tuple[bool, str]:
    """The resumed run's final weights against an uninterrupted run's (``resumed``) and, where they
    differ, two uninterrupted runs' against each other (``twice``)."""
    if resumed["bit_identical"]:
        return True, "bit-identical to an uninterrupted run's"
    said = f"not bit-identical (max |diff| {resumed['max_abs_diff']:.3g}); "
    if twice is None or twice["bit_identical"]:
        return False, said + "two uninterrupted runs are: the resume is not exact"
    return True, said + (f"nor are two uninterrupted runs (max |diff| {twice['max_abs_diff']:.3g}): "
                         "the device's kernels are not deterministic")


def run_until_checkpoint_then_kill(check: Check, run_dir: Path, flags: tuple[str, ...]) -> int:
    """Starts the run, SIGKILLs its process group once a checkpoint marker appears; returns its step."""
    run = start(torchrun_cmd(check, run_dir, *flags), run_dir / "killed")
    deadline = time.monotonic() + check.timeout
    try:
        while not (steps := marker_steps(run_dir / "ckpt")):
            if run.proc.poll() is not None:
                raise StepFailed("the run ended before writing a checkpoint to kill it at", run.tail())
            if time.monotonic() > deadline:
                raise StepFailed(f"no checkpoint marker within {check.timeout:.0f} s", run.tail())
            time.sleep(0.02)
    finally:
        run.kill()
    if (run_dir / "ckpt" / "final_model.pt").exists():
        raise StepFailed("killed too late: the run had already finished")
    if not check.resume.mid_epoch(min(steps)):
        raise StepFailed(f"the first checkpoint seen, step {min(steps)}, is at an epoch end, not mid-epoch")
    return max(steps)


def marker_steps(ckpt_dir: Path) -> list[int]:
    names = (p.name for p in ckpt_dir.glob("ckpt-*.pt.ok")) if ckpt_dir.is_dir() else ()
    return [int(m.group(1)) for m in map(MARKER.match, names) if m]


def load_final(ckpt_dir: Path) -> dict:
    import torch

    return torch.load(ckpt_dir / "final_model.pt", weights_only=True, map_location="cpu")


def step_nccl_2proc(check: Check) -> tuple[bool | None, str, dict]:
    if check.gpus < 2:
        reason = f"{check.gpus} GPU visible, a 2-process NCCL run needs 2"
        return None, f"skipped: {reason}", {"skipped": reason}
    _, records = train(check, "nccl-2proc", *check.short_flags, nproc=2)
    return judge_final(records, check.backend, 2)


def _pairs_of_gpus(check: Check) -> str | None:
    """Why a step of 2-stage processes cannot run here, or None."""
    if check.gpus < 2:
        return f"{check.gpus} GPU visible, a process of 2 stages needs 2"
    return None


def step_stages(check: Check) -> tuple[bool | None, str, dict]:
    """One process of 2 stages (resnet50 split over 2 GPUs), pipelined in micro-batches."""
    reason = _pairs_of_gpus(check)
    if reason:
        return None, f"skipped: {reason}", {"skipped": reason}
    run, records = train(check, "stages-2", *check.short_flags, "--model", "resnet50", "--stages", "2",
                         "--micro-batches", "2")
    ok, summary, detail = judge_final(records, check.backend, 1)
    placed = "stages=2 on ['cuda:0', 'cuda:1']" in run.stderr()
    detail["split_logged"] = placed
    return ok and placed, summary + ("" if placed else "; the trainer did not log its split on cuda:0 and cuda:1"), detail


def step_parallelism(check: Check) -> tuple[bool | None, str, dict]:
    """bench/bench_parallel.py: DataParallel, DDP, DDP with 2 stages, with and without micro-batches."""
    if check.gpus < 2 or check.gpus % 2:
        reason = f"{check.gpus} GPU(s) visible, the comparison needs an even count of 2 or more"
        return None, f"skipped: {reason}", {"skipped": reason}
    cmd = [check.python, str(ROOT / "bench" / "bench_parallel.py"), "--device", check.device, "--out", str(check.out)]
    finish(start(cmd, check.work / "parallel"), check.bench_timeout)
    record_path = check.out / f"parallel-{check.device}.json"
    record = json.loads(record_path.read_text())
    rates = record["samples_per_s"]
    summary = ", ".join(f"{way} {rate:.0f}/s ({record['over_ddp'][way]:.2f})" for way, rate in rates.items())
    return all(rate > 0 for rate in rates.values()), summary, {**record, "record": str(record_path)}


def step_bench(check: Check) -> tuple[bool, str, dict]:
    cmd = [check.python, str(ROOT / "bench" / "bench_trainer.py"), "--device", check.device,
           "--out", str(check.out), *check.bench_args]
    finish(start(cmd, check.work / "bench"), check.bench_timeout)
    record_path = check.out / f"trainer-{check.device}.json"
    ok, summary, detail = judge_targets(json.loads(record_path.read_text()))
    return ok, summary, {**detail, "record": str(record_path)}


@dataclass(frozen=True)
class Step:
    name: str
    checks: str
    run: Callable[[Check], tuple[bool | None, str, dict]]


STEPS = [
    Step("environment", "torch and CUDA build, driver and GPU names (nvidia-smi), device count, NCCL version",
         step_environment),
    Step("nccl-init", "1-process run with --device cuda --backend nccl; the final record says backend nccl",
         step_nccl_init),
    Step("amp-bf16", "run with --amp bf16 (resnet); every loss finite, the last below the first", amp_step("bf16")),
    Step("amp-fp16", "run with --amp fp16 (the trainer's GradScaler); every loss finite, the last below the first",
         amp_step("fp16")),
    Step("resume", "SIGKILL after a mid-epoch checkpoint, relaunch: 'resumed from', first record 'resumed', "
         "same final step; final weights bit-identical to an uninterrupted run's, or, where they differ, so "
         "do two uninterrupted runs' (the device's kernels are not deterministic)", step_resume),
    Step("nccl-2proc", "2-process run on 2 GPUs with NCCL, world_size 2 (skipped with fewer GPUs)", step_nccl_2proc),
    Step("stages-2", "1 process of 2 stages (resnet50 split over 2 GPUs, --micro-batches 2) trains to its final "
         "record and logs its split (skipped with fewer GPUs)", step_stages),
    Step("parallelism", "bench/bench_parallel.py: DataParallel, DDP, DDP with 2 stages with and without "
         "micro-batches, samples/s side by side (skipped without an even count of 2+ GPUs)", step_parallelism),
    Step("bench", f"bench/bench_trainer.py --device cuda: a/b >= {TARGETS['a_over_b']:g} and "
         f"a/c >= {TARGETS['a_over_c']:g}", step_bench),
]


def run_step(step: Step, check: Check) -> dict:
    """Runs one step; whatever goes wrong is recorded in its result and the next step still runs."""
    began = time.monotonic()
    try:
        ok, summary, detail = step.run(check)
    except StepFailed as exc:
        ok, summary, detail = False, str(exc), {"error": str(exc), "last_lines": exc.tail}
    except Exception as exc:  # noqa: BLE001  (an unexpected state must not stop the other steps)
        error = f"{type(exc).__name__}: {exc}"
        ok, summary, detail = False, error, {"error": error, "last_lines": last_lines(traceback.format_exc())}
    return {"name": step.name, "ok": ok, "seconds": round(time.monotonic() - began, 1), "summary": summary,
            "detail": detail}


# --- the report -----------------------------------------------------------------------------------

def git_commit() -> dict:
    commit = command_output(["git", "rev-parse", "HEAD"])
    status = command_output(["git", "status", "--porcelain"])
    return {"commit": commit.strip() if commit else None, "dirty": bool(status.strip()) if status is not None else None}


def machine() -> dict:
    return {"hostname": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version()}


def write_report(out: Path, steps: list[dict], now: datetime, work: Path | None) -> Path:
    import torch

    report = {
        "check": "gpu", "time": now.astimezone(timezone.utc).isoformat(timespec="seconds"),
        "passed": exit_code(steps) == 0, "git": git_commit(), "machine": machine(),
        "torch": torch.__version__, "cuda_build": torch.version.cuda, "steps": steps,
        "work_dir": str(work) if work else None,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / report_name(now)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the steps and what each checks; run nothing")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"folder for the JSON record and the bench's own record (default: {DEFAULT_OUT})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(f"{step.name:12s} {step.checks}" for step in STEPS))
        return 0
    gpus = visible_gpus()
    if not gpus:
        import torch

        print(no_cuda_message(torch.__version__, torch.version.cuda), file=sys.stderr)
        return 2
    now = datetime.now(timezone.utc)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    check = Check(work=work, out=args.out.resolve(), gpus=gpus)
    steps = [run_step(step, check) for step in STEPS]
    passed = exit_code(steps) == 0
    if passed:
        shutil.rmtree(work, ignore_errors=True)
    path = write_report(check.out, steps, now, None if passed else work)
    print(format_table(steps))
    print(f"gpu-check: {'passed' if passed else 'FAILED'}; record: {path}"
          + ("" if passed else f"; the runs' logs: {work}"))
    return exit_code(steps)


if __name__ == "__main__":
    sys.exit(main())
