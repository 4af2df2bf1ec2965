"""End-to-end: the launcher users run (torchrun in-process), 2 processes, gloo on CPU, real files.

Each test runs once on each tested point of the supported torch range (the ``torch_python`` fixture), but for
those marked ``NEWEST_ONLY``, whose behaviour is the trainer's own (tests/torch_ends.py).

The workers are forked from the launcher's zygote, as the launcher does where no GPU can be opened
(agent/zygote.py); those tests marked ``forked=False`` have torchrun start them (``DDP_PREFORK=0``),
as on a GPU machine: a whole run, a kill and a restart, a SIGTERM.
"""

import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from trainer import data
from agent.compat import binds_stores
from agent.contract import printed
from trainer.models import build_model
from trainer_helpers import SMALL, final_weights, metrics, run_torchrun, torchrun_cmd, trainer_env, write_idx_mnist
from fakes import free_port
from procs import descendants_of
from torch_ends import NEWEST_ONLY

pytestmark = pytest.mark.e2e


def assert_ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_two_process_synthetic_run_writes_checkpoints_metrics_and_the_final_model(torch_python, tmp_path):
    """A two-process run on synthetic data writes checkpoints, metrics and the final model."""
    proc = run_torchrun(torch_python.python, tmp_path, *SMALL, "--grad-accum", "2", "--clip-grad", "1.0", "--keep-last", "2",
                        forked=False)
    assert_ok(proc)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("ckpt-*.pt")) == ["ckpt-000000008.pt", "ckpt-000000016.pt"]
    records = metrics(ckpt)
    kinds = [r["kind"] for r in records]
    assert kinds.count("eval") == 2 and kinds[-1] == "final"
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["samples_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_mem_mb"] > 0 for r in train)
    assert train[-1]["loss"] < train[0]["loss"]
    assert printed(proc.stdout) == records  # rank 0 alone prints, one line per record
    assert (ckpt / "final_model.pt").exists()
    assert (tmp_path / "data" / "synthetic" / "synthetic-512.pt").exists()
    # where the time went before the first step, said once by the node's first process
    ready = [line.removeprefix("[rank0]: ") for line in proc.stderr.splitlines() if "trainer: ready to train " in line]
    assert len(ready) == 1, proc.stderr[-3000:]
    assert re.fullmatch(r"trainer: ready to train \d+\.\d s after the launcher started: launcher to this process "
                        r"\d+\.\d s, imports \d+\.\d s, process group \d+\.\d s, data \d+\.\d s, model \d+\.\d s, "
                        r"resume \d+\.\d s", ready[0]), ready[0]


def test_test_made_mnist_files_train_through_torchvision(torch_python, tmp_path):
    write_idx_mnist(tmp_path / "data")
    proc = run_torchrun(torch_python.python, tmp_path, "--dataset", "mnist", "--model", "lenet", "--batch-size", "25",
                        "--optimizer", "adamw", "--lr", "0.003",
                        "--epochs", "2", "--log-every", "4", "--no-download")
    assert_ok(proc)
    final = metrics(tmp_path / "ckpt")[-1]
    assert final["kind"] == "final" and final["eval_samples"] == 200
    assert final["eval_acc"] > 0.5  # the per-class patterns are learnable: far above chance (0.1)


# fp16 convolutions on the CPU are very slow (about 30 s a step for the resnet, 0.1 s for the lenet,
# against 0.1 s for the resnet in bf16): fp16's own path (autocast, the GradScaler) runs on the lenet.
@pytest.mark.parametrize("amp, model", [("bf16", "resnet"), ("fp16", "lenet")], ids=["bf16", "fp16"])
def test_mixed_precision_runs_on_cpu(torch_python, tmp_path, amp, model):
    # 256 samples: bf16 is emulated on a CPU without its instructions (2.2 s a resnet step of 32 here)
    proc = run_torchrun(torch_python.python, tmp_path, *SMALL, "--synthetic-size", "256", "--epochs", "1",
                        "--amp", amp, "--model", model, "--log-every", "1")
    assert_ok(proc)
    records = metrics(tmp_path / "ckpt")
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)  # 256 samples, 2 ranks x 16
    assert math.isfinite(next(r for r in records if r["kind"] == "eval")["eval_loss"])


@NEWEST_ONLY
def test_distributed_evaluation_equals_single_process_evaluation(torch_python, tmp_path):
    assert_ok(run_torchrun(torch_python.python, tmp_path, *SMALL, "--epochs", "1"))
    reported = metrics(tmp_path / "ckpt")[-1]
    model = build_model("convnet", 1, 28, 10)
    model.load_state_dict(final_weights(tmp_path / "ckpt"))
    model.eval()
    _, test = data.load("synthetic", str(tmp_path / "data"), 512)
    with torch.no_grad():
        out = model(data.Normalizer(data.SPECS["synthetic"], torch.device("cpu"))(test.images))
    assert reported["eval_samples"] == len(test)
    assert reported["eval_acc"] == (out.argmax(1) == test.labels).double().mean().item()
    single_loss = torch.nn.functional.cross_entropy(out, test.labels).item()
    assert reported["eval_loss"] == pytest.approx(single_loss, rel=1e-5)


def _run_until_checkpoint_then_kill(python, tmp_path, flags, step, forked=True):
    marker = tmp_path / "ckpt" / f"ckpt-{step:09d}.pt.ok"
    proc = subprocess.Popen(torchrun_cmd(python, tmp_path, *flags), env=trainer_env(forked), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, "the run ended before the checkpoint to kill at: " + proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    workers = descendants_of(proc.pid)  # each in a session of its own (torchrun's or the zygote's): not in its group
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)  # as a machine's crash would end them, with torchrun
    proc.wait()
    assert not (tmp_path / "ckpt" / "final_model.pt").exists(), "killed too late: the run had finished"


@pytest.mark.parametrize("torch_python, kill_at_step, extra, forked", [
    ("newest", 16, [], True),                        # after epoch 1 of 2 (16 steps per epoch)
    ("newest", 8, ["--ckpt-every", "4"], True),      # in the middle of epoch 1, from a mid-epoch checkpoint
    ("base", 8, ["--ckpt-every", "4"], False),       # the sampler's and RNG state mid-epoch, on the default
    ("oldest", 8, ["--ckpt-every", "4"], False),     # base's torch and the oldest, their workers started by
], indirect=["torch_python"])                        # torchrun
def test_killed_and_restarted_run_ends_bit_identical_to_an_uninterrupted_one(torch_python, tmp_path, kill_at_step, extra,
                                                                             forked):
    flags = [*SMALL, *extra]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert_ok(run_torchrun(torch_python.python, straight, *flags, forked=forked))
    _run_until_checkpoint_then_kill(torch_python.python, resumed, flags, kill_at_step, forked)
    restarted = run_torchrun(torch_python.python, resumed, *flags, forked=forked)
    assert_ok(restarted)
    assert "resumed from" in restarted.stderr
    said = printed(restarted.stdout)
    assert said[0]["kind"] == "resumed" and said[0]["step"] >= kill_at_step
    # the moments rank 0 reached on its way there, in order (a recovery's phases, tests/FAULTS.md)
    moments = said[0]["startup"]
    assert list(moments) == ["launcher", "process", "imports", "process_group", "data", "model", "resume"]
    assert list(moments.values()) == sorted(moments.values()) and moments["resume"] <= said[0]["time"]
    # the restarted job continued from there, it did not start again from zero
    assert all(r["step"] > said[0]["step"] for r in said[1:] if r["kind"] == "train")
    a, b = final_weights(straight / "ckpt"), final_weights(resumed / "ckpt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@NEWEST_ONLY
def test_a_resized_job_resumes_deterministically_at_the_epoch_start_on_the_new_size(torch_python, tmp_path):
    """What an elastic job does when a node is lost or taken in (hosts.yaml job.min_nodes)."""
    import shutil

    flags = [*SMALL, "--ckpt-every", "4", "--epochs", "1"]  # 16 steps per epoch on 2 ranks (32 on one):
    # the kill at step 8 lands inside the only epoch, which each resized run does again
    _run_until_checkpoint_then_kill(torch_python.python, tmp_path / "a", flags, 8)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for run in ("a", "b"):
        resized = run_torchrun(torch_python.python, tmp_path / run, *flags, nproc=1)
        assert_ok(resized)
        said = printed(resized.stdout)
        assert said[0]["kind"] == "resumed" and said[0]["from_world_size"] == 2 and said[0]["world_size"] == 1
        assert said[0]["epoch"] < 2 and said[0]["micro"] == 0  # the epoch again, laid out for one rank
        assert said[-1]["kind"] == "final" and said[-1]["world_size"] == 1
    a, b = final_weights(tmp_path / "a" / "ckpt"), final_weights(tmp_path / "b" / "ckpt")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sigterm_mid_epoch_stops_every_rank_at_one_checkpointed_step_redoing_nothing(torch_python, tmp_path):
    """SIGTERM mid-epoch stops every rank at one step with a checkpoint, and nothing is redone."""
    flags = [*SMALL, "--ckpt-every", "100", "--log-every", "1"]  # the stop's checkpoint is the only mid-epoch one
    forked = torch_python.name == "newest"  # on the other points torchrun starts the workers
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert_ok(run_torchrun(torch_python.python, straight, *flags, forked=forked))
    proc = subprocess.Popen(torchrun_cmd(torch_python.python, stopped, *flags), env=trainer_env(forked),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = stopped / "ckpt" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (log.exists() and any(r["kind"] == "train" and r["step"] >= 4 for r in metrics(stopped / "ckpt"))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # to torchrun, as docker stop and a scheduler send it
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, "a stopped job is not a finished one"
    assert "stopped by SIGTERM at step" in err and "launch again to resume" in err
    records = metrics(stopped / "ckpt")
    stop = records[-1]
    assert stop["kind"] == "stopped" and stop["signal"] == "SIGTERM" and stop["micro"] > 0
    last_trained = max(r["step"] for r in records if r["kind"] == "train")
    assert stop["step"] == last_trained
    assert (stopped / "ckpt" / stop["checkpoint"]).exists() and not (stopped / "ckpt" / "final_model.pt").exists()

    again = run_torchrun(torch_python.python, stopped, *flags, forked=forked)
    assert_ok(again)
    said = printed(again.stdout)
    assert said[0]["kind"] == "resumed" and said[0]["step"] == stop["step"]  # zero steps redone
    assert min(r["step"] for r in said if r["kind"] == "train") == stop["step"] + 1
    a, b = final_weights(straight / "ckpt"), final_weights(stopped / "ckpt")
    for name in a:
        assert torch.equal(a[name], b[name]), name


@NEWEST_ONLY
def test_two_nodes_sharing_the_data_directory_fetch_the_dataset_once(torch_python, tmp_path):
    port = free_port()
    nodes = []
    for is_host in (1, 0):
        cmd = [torch_python.python, "-m", "agent.launch", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fetch-once",
               "--rdzv-conf", f"is_host={is_host}", "--local-addr", "127.0.0.1",
               "--", "--data-dir", str(tmp_path / "data"), "--ckpt-dir", str(tmp_path / "ckpt"),
               *SMALL, "--epochs", "1"]
        nodes.append(subprocess.Popen(cmd, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    said = [err for _, err in outputs]
    assert sum("dataset synthetic fetched" in e for e in said) == 1
    assert sum("dataset synthetic found" in e for e in said) == 1


@NEWEST_ONLY
def test_resuming_with_another_model_or_without_resume_is_refused_naming_the_cause(torch_python, tmp_path):
    assert_ok(run_torchrun(torch_python.python, tmp_path, *SMALL, "--epochs", "1", nproc=1))
    other = run_torchrun(torch_python.python, tmp_path, *SMALL, "--epochs", "1", "--model", "lenet", nproc=1)
    assert other.returncode != 0
    assert "trainer: error: model: the checkpoints in" in other.stderr
    fresh = run_torchrun(torch_python.python, tmp_path, *SMALL, "--epochs", "1", "--no-resume", nproc=1)
    assert fresh.returncode != 0
    assert "holds checkpoints of an earlier run" in fresh.stderr


def _process_tree(root: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _listeners_of(pids: set[int]) -> set[str]:
    """Listening TCP addresses (``ADDR:PORT``) of the given processes."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            found.add(line.split()[3])
    return found


def test_the_job_listens_only_on_the_addresses_it_was_given(torch_python, tmp_path):
    """The rendezvous store and the workers' store on --local-addr, gloo on the named interface:
    nothing on a wildcard address (0.0.0.0, [::], *). Before torch 2.8 the stores cannot be bound
    (agent.compat): there they are torch's own, on every address, and gloo stays on lo."""
    port = free_port()
    cmd = [torch_python.python, "-m", "agent.launch", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "listen",
           "--rdzv-conf", "is_host=1", "--local-addr", "127.0.0.2",
           "--", "--data-dir", str(tmp_path / "data"), "--ckpt-dir", str(tmp_path / "ckpt"),
           *SMALL, "--epochs", "1", "--log-every", "1"]
    env = {**trainer_env(), "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _listeners_of(_process_tree(proc.pid))
            time.sleep(0.2)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    hosts = {s.rsplit(":", 1)[0] for s in seen}
    if binds_stores(torch_python.version):
        assert f"127.0.0.2:{port}" in seen  # the c10d store, bound to --local-addr
        assert len({s for s in seen if s.startswith("127.0.0.2:")}) >= 2  # and the workers' store
        assert hosts <= {"127.0.0.2", "127.0.0.1"}, seen  # gloo on lo's own address; no 0.0.0.0, [::] or *
    else:  # before torch 2.8 both stores are torch's own, on every address (agent.compat, README)
        assert {s for s in seen if s.endswith(f":{port}")} <= {f"*:{port}", f"0.0.0.0:{port}", f"[::]:{port}"}
        assert {s for s in seen if s.endswith(f":{port}")}, seen
        assert hosts - {"*", "0.0.0.0", "[::]"} <= {"127.0.0.1"}, seen  # gloo still on the named interface


def test_sync_bn_on_cpu_is_one_clear_error_at_start(torch_python, tmp_path):
    proc = run_torchrun(torch_python.python, tmp_path, *SMALL, "--epochs", "1", "--sync-bn", nproc=1)
    assert proc.returncode != 0
    assert "trainer: error: sync_bn: SyncBatchNorm needs CUDA devices" in proc.stderr
    assert "Traceback" not in proc.stderr.split("trainer: error:")[0]
    assert not (tmp_path / "ckpt" / "metrics.jsonl").exists()


@NEWEST_ONLY
def test_two_stages_per_process_end_as_one_does_and_resume_exactly_in_another_split(torch_python, tmp_path):
    """Model parallelism inside each DDP process (--stages): on gloo the split changes nothing the
    job computes, and a checkpoint of one split resumes bit-exactly in another."""
    import shutil

    flags = [*SMALL, "--model", "resnet", "--ckpt-every", "4", "--keep-last", "10", "--epochs", "1"]  # 16 steps
    one, two, three = tmp_path / "one", tmp_path / "two", tmp_path / "three"
    assert_ok(run_torchrun(torch_python.python, one, *flags))
    split = run_torchrun(torch_python.python, two, *flags, "--stages", "2")
    assert_ok(split)
    assert re.search(r"model resnet split: stages=2 on \['cpu', 'cpu'\]", split.stderr), split.stderr[-2000:]
    expected = final_weights(one / "ckpt")
    for name, tensor in final_weights(two / "ckpt").items():
        assert torch.equal(tensor, expected[name]), name
    # the 2-stage run's mid-epoch checkpoint at step 8, resumed with 3 stages
    (three / "ckpt").mkdir(parents=True)
    for f in (two / "ckpt").glob("ckpt-000000008.pt*"):
        shutil.copy(f, three / "ckpt" / f.name)
    resumed = run_torchrun(torch_python.python, three, *flags, "--stages", "3")
    assert_ok(resumed)
    said = printed(resumed.stdout)
    assert said[0]["kind"] == "resumed" and said[0]["step"] == 8 and said[0]["micro"] == 8
    for name, tensor in final_weights(three / "ckpt").items():
        assert torch.equal(tensor, expected[name]), name
