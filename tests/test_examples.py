"""The example user projects under examples/ run under torchrun, report metrics and resume.

Each example is copied into tmp_path and run there with real processes (2 under torchrun, gloo
on CPU), once on each tested point of the supported torch range (the ``torch_python`` fixture):
each example trains on all three; the package's ``-m`` entry and resume, the trainer's own, on the newest.
"""

import ast
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from torch_ends import NEWEST_ONLY

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
KEYS = {"kind", "epoch", "step", "loss", "time"}


def copy_example(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(EXAMPLES / name, dest, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    return dest


def example_env(tmp_path: Path) -> dict[str, str]:
    """The example's environment. TMPDIR is the test's own: torchrun run as the README runs it
    makes a /tmp/torchelastic_* for its logs and never removes it."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DDP_CKPT_DIR=str(tmp_path / "ckpt"), DDP_DATA_DIR=str(tmp_path / "data"), DDP_DEVICE="cpu",
               DDP_BACKEND="gloo", DDP_RUN_ID="test-run", DDP_NODE_NAME="node-a", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path / "tmp"))
    return env


def run(cmd: list[str], cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=example_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def torchrun(python: str, cwd: Path, tmp_path: Path, *entry: str) -> subprocess.CompletedProcess:
    return run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *entry], cwd, tmp_path)


def metrics(stdout: str) -> list[dict]:
    records = [json.loads(line[len("METRICS "):]) for line in stdout.splitlines() if line.startswith("METRICS ")]
    assert records, stdout[-3000:]
    for r in records:
        assert KEYS <= r.keys() and r["kind"] in ("train", "eval"), r
        assert math.isfinite(r["loss"]), r
    return records


def assert_trained_epochs(records: list[dict], epochs: list[int], total: int) -> None:
    assert sorted({r["epoch"] for r in records}) == epochs
    assert [r["epoch"] for r in records if r["kind"] == "eval"] == epochs  # one eval line per epoch
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["samples_per_s"] > 0 and r["epochs"] == total and r["steps_per_epoch"] > 0 for r in train)
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)


def test_charlm_script_trains_reports_metrics_and_resumes_from_its_checkpoint(torch_python, tmp_path):
    cwd = copy_example("charlm", tmp_path)
    first = metrics(torchrun(torch_python.python, cwd, tmp_path, "train.py", "--epochs", "1").stdout)
    assert_trained_epochs(first, [0], 1)
    assert 0 <= first[-1]["acc"] <= 1
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ckpt-epoch0.pt"]

    proc = torchrun(torch_python.python, cwd, tmp_path, "train.py", "--epochs", "2")
    second = metrics(proc.stdout)
    assert "resuming from" in proc.stdout
    assert_trained_epochs(second, [1], 2)
    assert second[0]["step"] > first[-1]["step"]
    assert second[-1]["loss"] < first[0]["loss"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ckpt-epoch0.pt", "ckpt-epoch1.pt"]


@NEWEST_ONLY
def test_regress_package_runs_with_dash_m_and_resumes_from_its_checkpoint(torch_python, tmp_path):
    cwd = copy_example("regress", tmp_path)
    first = metrics(torchrun(torch_python.python, cwd, tmp_path, "-m", "regress.train", "--epochs", "1").stdout)
    assert_trained_epochs(first, [0], 1)
    assert first[-1]["r2"] > 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest.pt"]
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["regress-4096x8-seed0.pt"]

    proc = torchrun(torch_python.python, cwd, tmp_path, "-m", "regress.train", "--epochs", "2")
    second = metrics(proc.stdout)
    assert "resuming from" in proc.stdout
    assert_trained_epochs(second, [1], 2)
    assert second[0]["step"] > first[-1]["step"]
    assert second[-1]["r2"] > first[-1]["r2"]


@pytest.mark.parametrize("example, entry", [("charlm", ["train.py"]), ("regress", ["-m", "regress.train"])])
def test_examples_train_as_one_plain_process_without_torchrun(torch_python, tmp_path, example, entry):
    cwd = copy_example(example, tmp_path)
    records = metrics(run([torch_python.python, *entry, "--epochs", "1"], cwd, tmp_path).stdout)
    assert_trained_epochs(records, [0], 1)
    assert any((tmp_path / "ckpt").iterdir())


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_examples_do_not_import_the_bundle():
    sources = sorted(EXAMPLES.rglob("*.py"))
    assert {p.relative_to(EXAMPLES).parts[0] for p in sources} >= {"charlm", "regress"}
    for path in sources:
        assert not imported_modules(path) & {"trainer", "agent", "deploy"}, path
