"""The operator's install: ``pip install ddp-bundle`` is ddp-deploy alone, without torch.

Installed from this tree (a copy of what a build reads) into a fresh venv, with the wheels ``make operator-wheels`` fetched (the
test reaches no package index), it validates the shipped hosts.yaml, shows ``check --help``,
prints ``launch --dry-run`` and says in one line what to install for the verbs that need more.
Its size and install time are printed (README: Install).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path(os.environ.get("DDP_OPERATOR_WHEELS", ROOT / ".wheels-operator"))
GOAL_MB = 200  # SkyPilot, dstack and TorchX install in seconds; the trainer's extra is ~5.8 GB


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


@pytest.fixture(scope="module")
def operator(tmp_path_factory):
    """(the venv's bin folder, install seconds, size in MiB)."""
    if not (WHEELS / ".done").exists():
        pytest.skip(f"no operator wheels in {WHEELS}: `make operator-wheels` fetches them (`make test` does)")
    work = tmp_path_factory.mktemp("operator")
    venv, source = work / "venv", work / "source"
    # What a build reads, copied: setuptools builds in the source tree, and a build/ folder left
    # in this one could carry files deleted since into the wheel.
    junk = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("trainer", "agent", "deploy"):
        shutil.copytree(ROOT / part, source / part, ignore=junk)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    got = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--find-links", str(WHEELS),
                          str(source)], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    seconds, size = time.monotonic() - began, _size_mb(venv)
    print(f"\noperator install: {size:.0f} MiB, {seconds:.1f} s (venv, pip and ddp-bundle's dependencies, offline)")
    return venv / "bin", seconds, size


def _run(bin_dir: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ""})


def test_the_operator_install_has_no_torch_and_stays_under_its_size_goal(operator):
    bin_dir, _, size = operator
    found = _run(bin_dir, "python", "-c", "import importlib.util as u; "
                 "print(*[m for m in ('torch', 'torchvision', 'tensorboard', 'matplotlib') if u.find_spec(m)])")
    assert found.returncode == 0 and found.stdout.strip() == "", found.stdout + found.stderr
    assert size < GOAL_MB, f"the operator's install takes {size:.0f} MiB"


def test_the_operator_install_validates_checks_and_dry_runs_the_shipped_inventory(operator):
    bin_dir = operator[0]
    validated = _run(bin_dir, "ddp-deploy", "--hosts", "hosts.yaml", "validate")
    assert validated.returncode == 0 and "hosts.yaml: ok: job ddp-demo" in validated.stdout, validated.stderr
    helped = _run(bin_dir, "ddp-deploy", "--hosts", "hosts.yaml", "check", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("Usage: ddp-deploy check"), helped.stderr
    dry = _run(bin_dir, "ddp-deploy", "--hosts", "hosts.yaml", "launch", "--dry-run")
    assert dry.returncode == 0 and "[all] program: the built-in trainer" in dry.stdout, dry.stderr[-2000:]


def test_verbs_that_need_an_extra_say_which_in_one_line(operator):
    bin_dir = operator[0]
    plotted = _run(bin_dir, "ddp-deploy", "--hosts", "hosts.yaml", "plot")
    assert plotted.returncode == 2, plotted.stderr
    assert "plot needs matplotlib" in plotted.stderr and "pip install 'ddp-bundle[plot]'" in plotted.stderr
    trained = _run(bin_dir, "ddp-train", "--help")
    assert trained.returncode == 1 and "Traceback" not in trained.stderr
    assert trained.stderr.strip() == ("ddp-train: torch is not installed here (the operator's install leaves the "
                                      "trainer out): pip install 'ddp-bundle[trainer]'")
