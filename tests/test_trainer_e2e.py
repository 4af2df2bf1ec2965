"""End-to-end: real torchrun, 2 processes, gloo on CPU, real files."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from trainer import data
from trainer.dist import DistEnv
from trainer.models import build_model
from trainer_helpers import SMALL, final_weights, metrics, run_torchrun, torchrun_cmd, trainer_env, write_idx_mnist
from fakes import free_port

pytestmark = pytest.mark.e2e


def assert_ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_two_process_run_on_synthetic_data_writes_checkpoints_metrics_and_the_final_model(tmp_path):
    proc = run_torchrun(tmp_path, *SMALL, "--grad-accum", "2", "--clip-grad", "1.0", "--keep-last", "2")
    assert_ok(proc)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("ckpt-*.pt")) == ["ckpt-000000008.pt", "ckpt-000000016.pt"]
    records = metrics(ckpt)
    kinds = [r["kind"] for r in records]
    assert kinds.count("eval") == 2 and kinds[-1] == "final"
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["samples_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_mem_mb"] > 0 for r in train)
    assert train[-1]["loss"] < train[0]["loss"]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    assert len(printed) == len(records)  # rank 0 alone prints, one line per record
    assert (ckpt / "final_model.pt").exists()
    assert (tmp_path / "data" / "synthetic" / "synthetic-1024.pt").exists()


def test_test_made_mnist_files_train_through_torchvision(tmp_path):
    write_idx_mnist(tmp_path / "data")
    proc = run_torchrun(tmp_path, "--dataset", "mnist", "--model", "lenet", "--batch-size", "25",
                        "--optimizer", "adamw", "--lr", "0.003",
                        "--epochs", "2", "--log-every", "4", "--no-download")
    assert_ok(proc)
    final = metrics(tmp_path / "ckpt")[-1]
    assert final["kind"] == "final" and final["eval_samples"] == 200
    assert final["eval_acc"] > 0.5  # the per-class patterns are learnable: far above chance (0.1)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_runs_on_cpu(tmp_path, amp):
    proc = run_torchrun(tmp_path, *SMALL, "--epochs", "1", "--amp", amp, "--model", "resnet")
    assert_ok(proc)
    assert all(math.isfinite(r["loss"]) for r in metrics(tmp_path / "ckpt") if r["kind"] == "train")


def test_distributed_evaluation_equals_single_process_evaluation(tmp_path):
    assert_ok(run_torchrun(tmp_path, *SMALL, "--epochs", "1"))
    reported = metrics(tmp_path / "ckpt")[-1]
    model = build_model("convnet", 1, 28, 10)
    model.load_state_dict(final_weights(tmp_path / "ckpt"))
    model.eval()
    _, test = data.load("synthetic", str(tmp_path / "data"), 1024)
    with torch.no_grad():
        out = model(data.Normalizer(data.SPECS["synthetic"], torch.device("cpu"))(test.images))
    assert reported["eval_samples"] == len(test)
    assert reported["eval_acc"] == (out.argmax(1) == test.labels).double().mean().item()
    single_loss = torch.nn.functional.cross_entropy(out, test.labels).item()
    assert reported["eval_loss"] == pytest.approx(single_loss, rel=1e-5)


def _run_until_checkpoint_then_kill(tmp_path, flags, step):
    marker = tmp_path / "ckpt" / f"ckpt-{step:09d}.pt.ok"
    proc = subprocess.Popen(torchrun_cmd(tmp_path, *flags), env=trainer_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, "the run ended before the checkpoint to kill at: " + proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "ckpt" / "final_model.pt").exists(), "killed too late: the run had finished"


@pytest.mark.parametrize("kill_at_step, extra", [
    (16, []),                        # after epoch 1 of 2 (16 steps per epoch)
    (8, ["--ckpt-every", "4"]),      # in the middle of epoch 1, from a mid-epoch checkpoint
])
def test_killed_and_restarted_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path, kill_at_step, extra):
    flags = [*SMALL, *extra]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert_ok(run_torchrun(straight, *flags))
    _run_until_checkpoint_then_kill(resumed, flags, kill_at_step)
    restarted = run_torchrun(resumed, *flags)
    assert_ok(restarted)
    assert "resumed from" in restarted.stderr
    said = [json.loads(line[len("METRICS "):]) for line in restarted.stdout.splitlines()
            if line.startswith("METRICS ")]
    assert said[0]["kind"] == "resumed" and said[0]["step"] >= kill_at_step
    # the restarted job continued from there, it did not start again from zero
    assert all(r["step"] > said[0]["step"] for r in said[1:] if r["kind"] == "train")
    a, b = final_weights(straight / "ckpt"), final_weights(resumed / "ckpt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_two_nodes_sharing_the_data_directory_fetch_the_dataset_once(tmp_path):
    port = free_port()
    nodes = []
    for is_host in (1, 0):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fetch-once",
               "--rdzv-conf", f"is_host={is_host}", "--local-addr", "127.0.0.1",
               "-m", "trainer", "--data-dir", str(tmp_path / "data"), "--ckpt-dir", str(tmp_path / "ckpt"),
               *SMALL, "--epochs", "1"]
        nodes.append(subprocess.Popen(cmd, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    said = [err for _, err in outputs]
    assert sum("dataset synthetic fetched" in e for e in said) == 1
    assert sum("dataset synthetic found" in e for e in said) == 1


def test_resuming_with_another_model_or_without_resume_is_refused_naming_the_cause(tmp_path):
    assert_ok(run_torchrun(tmp_path, *SMALL, "--epochs", "1", nproc=1))
    other = run_torchrun(tmp_path, *SMALL, "--epochs", "1", "--model", "lenet", nproc=1)
    assert other.returncode != 0
    assert "trainer: error: model: the checkpoints in" in other.stderr
    fresh = run_torchrun(tmp_path, *SMALL, "--epochs", "1", "--no-resume", nproc=1)
    assert fresh.returncode != 0
    assert "holds checkpoints of an earlier run" in fresh.stderr
