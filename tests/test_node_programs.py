"""The programs the tool runs on nodes are files (deploy/programs/), and every shell one, the files
and the few still spliced together in Python from shared parts, passes ``shellcheck``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agent import contract
from deploy.checks import meetings, preflight
from deploy.job import runs, scripts
from deploy.engines import slurm
from deploy.images import image
from deploy.programs import HERE, node_program

SPLICED = {  # programs put together in Python from shared parts: (text, shell)
    "scripts.HOST_START": (scripts.HOST_START, "sh"), "scripts.RECORD_STOP": (scripts.RECORD_STOP, "sh"),
    "runs.NODES_OF": (runs.NODES_OF, "sh"), "slurm.TASK": (slurm.TASK, "sh"),
    "preflight.PHASES": (preflight.PHASES, "bash"), "agent/heartbeat/diagnose.sh": (contract.program("diagnose"), "sh"),
    "image.IDENTIFY": (image.IDENTIFY, "sh"), "image.LOAD": (image.LOAD, "sh"),
}
FILES = sorted(p for p in HERE.iterdir() if p.suffix in (".sh", ".bash"))


@pytest.fixture(scope="module")
def shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found is None:
        if os.environ.get("DDP_SHELLCHECK_REQUIRED"):
            pytest.fail("shellcheck is not installed: .ci/run installs it (apt-get install shellcheck)")
        pytest.skip("shellcheck is not installed: apt-get install shellcheck")
    return found


def _check(shellcheck: str, text: str, shell: str) -> str:
    got = subprocess.run([shellcheck, f"--shell={shell}", "--format=gcc", "-"], input=text, capture_output=True,
                         text=True, timeout=60)
    return got.stdout + got.stderr


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_node_shell_file_passes_shellcheck(shellcheck, path: Path):
    said = _check(shellcheck, path.read_text(), "bash" if path.suffix == ".bash" else "sh")
    assert said == "", f"{path.name}:\n{said}"


@pytest.mark.parametrize("name", sorted(SPLICED))
def test_every_spliced_node_program_passes_shellcheck(shellcheck, name: str):
    text, shell = SPLICED[name]
    said = _check(shellcheck, text, shell)
    assert said == "", f"{name}:\n{said}"


def test_shellcheck_finds_a_planted_fault(shellcheck):
    assert "SC2086" in _check(shellcheck, 'rm -rf $1\n', "sh")  # the check itself can fail


def test_the_node_programs_are_read_from_their_files():
    assert scripts.KILL_RUN == node_program("kill_run.sh") == (HERE / "kill_run.sh").read_text()
    assert meetings.LISTEN == node_program("listen.py") and meetings.LISTEN.startswith("import socket")
    assert len(FILES) >= 20
