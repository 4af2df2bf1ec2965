"""bench/gpu_check.py, the GPU acceptance check, on a machine without a GPU: its refusal, its
step list, its judgements, and (marked e2e) its resume step run on the CPU with gloo."""

import json
import math
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
from gpu_check import StepFailed  # noqa: E402

SCRIPT = ROOT / "bench" / "gpu_check.py"
STEP_NAMES = ["environment", "nccl-init", "amp-bf16", "amp-fp16", "resume", "nccl-2proc", "stages-2", "parallelism",
              "bench"]


def run_script(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)


def step(name="s", ok=True):
    return {"name": name, "ok": ok, "seconds": 1.0, "summary": "", "detail": {}}


# --- the command line -----------------------------------------------------------------------------

def test_without_a_cuda_device_it_says_so_in_one_line_writes_nothing_and_exits_2(tmp_path):
    before = sorted((ROOT / "bench" / "results").glob("gpu-check-*.json"))
    proc = run_script("--out", str(tmp_path / "out"), env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [gpu_check.no_cuda_message(torch.__version__, torch.version.cuda)]
    assert re.fullmatch(r"gpu-check: no CUDA device visible \(torch \S+, CUDA build \S+\): "
                        r"run it on a machine with an NVIDIA GPU\n", proc.stderr)
    assert not (tmp_path / "out").exists()
    assert sorted((ROOT / "bench" / "results").glob("gpu-check-*.json")) == before


def test_list_names_every_step_in_order_and_runs_nothing(tmp_path):
    proc = run_script("--list", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == STEP_NAMES
    assert [s.name for s in gpu_check.STEPS] == STEP_NAMES
    assert all(len(line.split(maxsplit=1)) == 2 for line in proc.stdout.splitlines())  # each says what it checks
    assert not (tmp_path / "out").exists()


def test_no_cuda_message_names_a_cpu_only_torch_build():
    assert "(torch 2.14.1+cpu, CUDA build none)" in gpu_check.no_cuda_message("2.14.1+cpu", None)


# --- judging the bench's targets ------------------------------------------------------------------

def test_bench_targets_are_met_at_exactly_the_thresholds():
    ok, summary, detail = gpu_check.judge_targets({"a_over_b": 10.0, "a_over_c": 0.9})
    assert ok and detail["met"] == {"a_over_b": True, "a_over_c": True}
    assert summary == "a/b 10.00 (>= 10), a/c 0.90 (>= 0.9)"


@pytest.mark.parametrize("record, missed", [
    ({"a_over_b": 9.99, "a_over_c": 1.2}, "a_over_b"),
    ({"a_over_b": 14.0, "a_over_c": 0.89}, "a_over_c"),
])
def test_bench_fails_when_either_ratio_is_under_its_target_and_says_which(record, missed):
    ok, summary, detail = gpu_check.judge_targets(record)
    assert not ok
    assert [name for name, met in detail["met"].items() if not met] == [missed]
    assert f"{missed.replace('_over_', '/')} {record[missed]:.2f} (<" in summary


def test_bench_figures_keep_the_ratios_per_round_and_the_samples_per_second():
    record = {"a_over_b": 12.0, "a_over_c": 0.95, "per_round": {"a_over_b": [11, 12, 13]},
              "median": {"a_ours": 9000.0}, "device_name": "NVIDIA H100 80GB HBM3"}
    _, _, detail = gpu_check.judge_targets(record)
    assert detail["a_over_b"] == 12.0 and detail["a_over_c"] == 0.95
    assert detail["per_round"] == {"a_over_b": [11, 12, 13]}
    assert detail["median_samples_per_s"] == {"a_ours": 9000.0}
    assert detail["device_name"] == "NVIDIA H100 80GB HBM3"


# --- judging the training runs --------------------------------------------------------------------

def train_records(*losses):
    return [{"kind": "train", "loss": x} for x in losses] + [{"kind": "eval", "eval_loss": 9.0}]


def test_finite_losses_that_decrease_pass():
    ok, summary, detail = gpu_check.judge_losses(train_records(2.3, 1.1, 0.4))
    assert ok and summary == "loss 2.300 -> 0.400"
    assert detail["train_losses"] == [2.3, 1.1, 0.4]


@pytest.mark.parametrize("losses, said", [
    ((2.3, math.nan, 0.4), "1 of 3 interval losses are not finite"),
    ((2.3, math.inf), "1 of 2 interval losses are not finite"),
    ((2.3, 1.0, 2.4), "did not decrease"),
    ((2.3,), "too few to compare"),
])
def test_non_finite_or_non_decreasing_losses_fail_naming_why(losses, said):
    ok, summary, _ = gpu_check.judge_losses(train_records(*losses))
    assert not ok and said in summary


def test_the_final_record_must_name_the_backend_and_world_size_expected():
    records = [{"kind": "train", "loss": 1.0}, {"kind": "final", "backend": "nccl", "world_size": 2, "step": 32}]
    assert gpu_check.judge_final(records, "nccl", 2)[0]
    ok, summary, _ = gpu_check.judge_final(records, "nccl", 1)
    assert not ok and "expected nccl, 1" in summary
    assert not gpu_check.judge_final(records, "gloo", 2)[0]
    assert gpu_check.judge_final(records[:1], "nccl", 2) == (False, "no final record in metrics.jsonl", {})


def relaunch_printed(first_kind="resumed", first_step=40, final_step=512):
    return [{"kind": first_kind, "step": first_step}, {"kind": "train", "step": first_step + 8},
            {"kind": "final", "step": final_step}]


def test_a_relaunch_that_resumed_from_the_checkpoint_and_finished_has_no_problems():
    assert gpu_check.judge_relaunch("... resumed from /x/ckpt-000000040.pt ...", relaunch_printed(), 40, 512) == []


@pytest.mark.parametrize("stderr, printed, said", [
    ("started", relaunch_printed(), 'did not log "resumed from"'),
    ("resumed from x", relaunch_printed(first_kind="train"), "first METRICS record is 'train'"),
    ("resumed from x", relaunch_printed(first_step=0), "resumed at step 0, before the checkpoint at 40"),
    ("resumed from x", relaunch_printed(final_step=300), "ended at final step 300"),
    ("resumed from x", [], "first METRICS record is None"),
])
def test_a_relaunch_that_did_not_resume_or_finish_is_a_problem_named(stderr, printed, said):
    problems = gpu_check.judge_relaunch(stderr, printed, 40, 512)
    assert any(said in p for p in problems), problems


def test_identical_weights_are_reported_bit_identical():
    a = {"w": torch.ones(3), "n": torch.tensor(5)}
    assert gpu_check.compare_weights(a, {k: v.clone() for k, v in a.items()}) == {
        "bit_identical": True, "tensors": 2, "tensors_differing": 0, "max_abs_diff": 0.0}


def test_weights_that_differ_are_a_figure_with_the_largest_difference():
    a = {"w": torch.ones(3), "n": torch.tensor(5)}
    b = {"w": torch.tensor([1.0, 1.25, 0.5]), "n": torch.tensor(5)}
    figures = gpu_check.compare_weights(a, b)
    assert figures["bit_identical"] is False and figures["tensors_differing"] == 1
    assert figures["max_abs_diff"] == 0.5


def test_resumed_weights_identical_to_an_uninterrupted_run_pass():
    ok, said = gpu_check.judge_weights({"bit_identical": True, "max_abs_diff": 0.0}, None)
    assert ok and said == "bit-identical to an uninterrupted run's"


def test_resumed_weights_may_differ_only_where_two_uninterrupted_runs_differ_too():
    """Resumed weights that differ pass only where two uninterrupted runs differ too."""
    differ = {"bit_identical": False, "max_abs_diff": 0.02}
    ok, said = gpu_check.judge_weights(differ, {"bit_identical": False, "max_abs_diff": 0.0076})
    assert ok and "nor are two uninterrupted runs (max |diff| 0.0076)" in said and "not deterministic" in said
    ok, said = gpu_check.judge_weights(differ, {"bit_identical": True, "max_abs_diff": 0.0})
    assert not ok and said.endswith("two uninterrupted runs are: the resume is not exact")


def test_final_models_with_different_keys_fail_the_comparison():
    with pytest.raises(StepFailed, match="keys"):
        gpu_check.compare_weights({"w": torch.ones(1)}, {"v": torch.ones(1)})


def test_only_a_checkpoint_inside_an_epoch_counts_as_mid_epoch():
    run = gpu_check.ResumeRun(size=8192, batch=32, ckpt_every=40)  # 256 steps per epoch
    assert run.mid_epoch(40) and run.mid_epoch(280)
    assert not run.mid_epoch(256) and not run.mid_epoch(512)


def test_checkpoint_markers_are_read_from_their_names_alone(tmp_path):
    for name in ("ckpt-000000040.pt.ok", "ckpt-000000040.pt", "ckpt-000000080.pt.ok", ".ckpt-000000120.pt.tmp",
                 "final_model.pt"):
        (tmp_path / name).touch()
    assert sorted(gpu_check.marker_steps(tmp_path)) == [40, 80]
    assert gpu_check.marker_steps(tmp_path / "absent") == []


def test_printed_metrics_are_the_metrics_lines_in_order():
    out = 'hello\nMETRICS {"kind": "resumed", "step": 3}\nnoise METRICS x\nMETRICS {"kind": "final"}\n'
    assert gpu_check.printed_metrics(out) == [{"kind": "resumed", "step": 3}, {"kind": "final"}]


# --- the environment ------------------------------------------------------------------------------

def test_nvidia_smi_lines_give_each_gpu_s_name_and_driver():
    text = "NVIDIA H100 80GB HBM3, 550.54.15\nNVIDIA H100 80GB HBM3, 550.54.15\n\n"
    assert gpu_check.parse_nvidia_smi(text) == [{"name": "NVIDIA H100 80GB HBM3", "driver": "550.54.15"}] * 2


@pytest.mark.parametrize("raw, shown", [((2, 21, 5), "2.21.5"), (2708, "2708"), (None, None)])
def test_nccl_version_is_shown_as_torch_reports_it(raw, shown):
    assert gpu_check.nccl_version(raw) == shown


# --- summarising ----------------------------------------------------------------------------------

@pytest.mark.parametrize("oks, code", [
    ([True, True], 0),
    ([True, None, True], 0),     # a skipped step neither passes nor fails
    ([True, False, None], 1),
    ([False], 1),
])
def test_exit_code_is_0_only_when_every_step_that_ran_passed(oks, code):
    assert gpu_check.exit_code([step(ok=ok) for ok in oks]) == code


def test_the_table_shows_each_step_s_result_seconds_and_summary():
    steps = [{**step("nccl-init", True), "summary": "backend nccl, world_size 1"},
             {**step("nccl-2proc", None), "summary": "skipped: 1 GPU visible"},
             {**step("bench", False), "summary": "a/b 3.10 (< 10)"}]
    lines = gpu_check.format_table(steps).splitlines()
    assert lines[0].split() == ["step", "result", "seconds", "summary"]
    assert lines[1].split()[:3] == ["nccl-init", "PASS", "1.0"] and lines[1].endswith("backend nccl, world_size 1")
    assert lines[2].split()[:2] == ["nccl-2proc", "SKIP"]
    assert lines[3].split()[:2] == ["bench", "FAIL"]


def test_the_record_is_named_after_the_utc_time():
    later_in_utc = datetime(2026, 11, 22, 23, 30, 5, tzinfo=timezone(timedelta(hours=-2)))
    assert gpu_check.report_name(later_in_utc) == "gpu-check-20261123T013005Z.json"


def test_a_failing_step_records_its_error_and_last_lines_and_the_next_step_runs():
    """A failing step records its error and last lines, and the next step still runs."""
    def fails(check):
        raise StepFailed("run amp-fp16: exit code 1", ["line 1", "RuntimeError: CUDA error"])

    def crashes(check):
        raise KeyError("loss")

    results = [gpu_check.run_step(gpu_check.Step(name, "", fn), check=None)
               for name, fn in (("a", fails), ("b", crashes), ("c", lambda check: (True, "fine", {"x": 1})))]
    assert [r["ok"] for r in results] == [False, False, True]
    assert results[0]["detail"] == {"error": "run amp-fp16: exit code 1",
                                    "last_lines": ["line 1", "RuntimeError: CUDA error"]}
    assert results[1]["summary"] == "KeyError: 'loss'" and "KeyError: 'loss'" in results[1]["detail"]["last_lines"]
    assert results[2] == {"name": "c", "ok": True, "seconds": results[2]["seconds"], "summary": "fine",
                          "detail": {"x": 1}}


def test_the_written_record_holds_the_steps_versions_machine_and_commit(tmp_path):
    steps = [step("environment", True), step("nccl-2proc", None)]
    path = gpu_check.write_report(tmp_path / "out", steps, datetime(2026, 11, 22, 10, 0, tzinfo=timezone.utc), None)
    assert path == tmp_path / "out" / "gpu-check-20261122T100000Z.json"
    report = json.loads(path.read_text())
    assert report["steps"] == steps and report["passed"] is True
    assert report["torch"] == torch.__version__ and report["cuda_build"] == torch.version.cuda
    assert re.fullmatch(r"[0-9a-f]{40}", report["git"]["commit"])
    assert {"hostname", "platform", "cpus", "python"} <= report["machine"].keys()


# --- subprocesses ---------------------------------------------------------------------------------

def test_a_run_past_its_timeout_is_killed_with_its_children_and_fails_the_step(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    run = gpu_check.start([sys.executable, "-c", code], tmp_path / "slow")
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, run.stderr()
        time.sleep(0.05)
    with pytest.raises(StepFailed, match="run slow: timed out after 1 s"):
        gpu_check.finish(run, timeout=1)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the run's child outlived the timeout"
        time.sleep(0.05)


def test_a_run_that_exits_non_zero_fails_with_its_last_error_lines(tmp_path):
    code = "import sys; print('working'); sys.stderr.write('\\n'.join(f'err {i}' for i in range(30))); sys.exit(3)"
    with pytest.raises(StepFailed, match="run bad: exit code 3") as failed:
        gpu_check.finish(gpu_check.start([sys.executable, "-c", code], tmp_path / "bad"), timeout=60)
    assert failed.value.tail == [f"err {i}" for i in range(10, 30)]


def test_a_failed_torchrun_s_last_lines_are_the_workers_not_the_launcher_s_report():
    """The last lines of a failed torchrun are the workers', not the launcher's report."""
    text = ("worker: loading\nRuntimeError: CUDA error: out of memory\n"
            "E1122 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 7)\n"
            "Traceback (most recent call last):\n  File \"launch.py\", line 1\n"
            f"{gpu_check.LAUNCHER_REPORT}: \n====\ntrainer FAILED\n")
    assert gpu_check.last_lines(text) == ["worker: loading", "RuntimeError: CUDA error: out of memory",
                                          "E1122 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 7)"]
    assert gpu_check.last_lines("a\n\nTraceback (most recent call last):\nb\n", n=2) == [
        "Traceback (most recent call last):", "b"]


# --- the steps themselves, on the CPU with gloo ---------------------------------------------------

def cpu_check(tmp_path, **kw):
    small = ("--synthetic-size", "1024", "--batch-size", "32", "--epochs", "1", "--log-every", "4")
    return gpu_check.Check(**{"work": tmp_path / "work", "out": tmp_path / "out", "device": "cpu", "backend": "gloo",
                              "short_flags": small, "amp_flags": small, "timeout": 300, **kw})


@pytest.mark.e2e
def test_resume_step_kills_mid_epoch_relaunches_and_compares_the_final_weights(tmp_path):
    check = cpu_check(tmp_path, resume=gpu_check.ResumeRun(size=512, batch=32, ckpt_every=6))  # 16 steps an epoch
    result = gpu_check.run_step(gpu_check.STEPS[STEP_NAMES.index("resume")], check)
    assert result["ok"] is True, result
    detail = result["detail"]
    assert detail["killed_after_checkpoint_step"] >= 6 and detail["final_step"] == 32
    assert detail["bit_identical"] is True  # on the CPU resuming is exact (tests/test_trainer_e2e.py)


@pytest.mark.e2e
def test_a_training_step_whose_run_fails_records_the_trainer_s_error(tmp_path):
    check = cpu_check(tmp_path, short_flags=("--epochs", "0"))
    result = gpu_check.run_step(gpu_check.STEPS[STEP_NAMES.index("nccl-init")], check)
    assert result["ok"] is False and result["summary"] == "run nccl-init: exit code 1"  # torchrun: a worker failed
    said = result["detail"]["last_lines"]
    assert said[0] == "[rank0]: trainer: error: epochs: must be >= 1, got 0"  # the worker's own words, first, with its rank
    assert not any("ChildFailedError" in line for line in said)      # not torchrun's report after them


def test_the_two_process_step_is_skipped_with_the_reason_on_one_device(tmp_path):
    result = gpu_check.run_step(gpu_check.STEPS[STEP_NAMES.index("nccl-2proc")], cpu_check(tmp_path))
    assert result["ok"] is None and "1 GPU visible" in result["summary"]
    assert not (tmp_path / "work").exists()


def test_printed_metrics_reads_lines_as_torchrun_echoes_them_with_the_rank():
    out = '[rank0]: METRICS {"kind": "resumed"}\n[rank1]: noise\n[rank0]: [rank0]: METRICS {"kind": "final"}\n'
    assert [r["kind"] for r in gpu_check.printed_metrics(out)] == ["resumed", "final"]


@pytest.mark.parametrize("gpus", [1, 3])
def test_model_parallel_steps_are_skipped_with_a_reason_where_the_gpus_do_not_pair(gpus, tmp_path):
    """The model-parallel steps are skipped, with a reason, where the GPUs do not pair."""
    check = gpu_check.Check(work=tmp_path, out=tmp_path / "out", gpus=gpus)
    ok, summary, detail = gpu_check.step_parallelism(check)
    assert ok is None and summary == f"skipped: {gpus} GPU(s) visible, the comparison needs an even count of 2 or more"
    if gpus == 1:
        ok, summary, _ = gpu_check.step_stages(check)
        assert ok is None and summary == "skipped: 1 GPU visible, a process of 2 stages needs 2"
    assert not (tmp_path / "out").exists()
