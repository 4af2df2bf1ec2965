"""The ``torch_python`` fixture: an interpreter at each of the three tested points of the supported
torch range.

``newest`` is the interpreter running the tests (the Makefile's main venv); ``base`` is
``$DDP_TORCH_BASE_PYTHON`` (the torch of the Dockerfile's default base, what the shipped image
runs); ``oldest`` is ``$DDP_TORCH_OLDEST_PYTHON``. A test taking the fixture runs once per point,
unless it names its points (``on_ends``, ``NEWEST_ONLY``): a test of what does not change with
torch's version (the trainer's own logic over torch's stable API) runs on the newest alone, since
each point costs a whole training run. What torch changed across the range runs on all three: the
stores' bind, torchrun's signals and error files, autocast, torch.load's defaults, torchvision, a
mid-epoch resume's state. Where a point's torch is not installed the test is skipped with the
reason; with ``DDP_TORCH_ENDS_REQUIRED=1`` (CI) that is a failure, and each interpreter's torch
must then be exactly the release it stands for.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from agent.contract import TORCH_SUPPORTED


@dataclass(frozen=True)
class TorchEnd:
    name: str
    python: str
    version: str


def range_ends(spec: str = TORCH_SUPPORTED) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(oldest release, newest minor series) of a ``>=A,<B`` range: ``>=2.5.1,<2.15`` ->
    ``((2, 5, 1), (2, 14))``."""
    specs = {s.operator: Version(s.version).release for s in SpecifierSet(spec)}
    upper = specs["<"]
    return specs[">="], (upper[0], upper[1] - 1)


def base_release(dockerfile: Path = Path(__file__).resolve().parent.parent / "Dockerfile") -> tuple[int, ...]:
    """The torch release of the Dockerfile's default base: ``pytorch/pytorch:2.9.0-cuda12.8-...`` ->
    ``(2, 9, 0)``."""
    found = re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:(\d+\.\d+\.\d+)-cuda", dockerfile.read_text(), re.M)
    if not found:
        raise ValueError(f"{dockerfile}: ARG BASE_IMAGE names no pytorch/pytorch:VERSION-cuda... image")
    return Version(found.group(1)).release


# Where each point's interpreter is named, and the Makefile target that installs it.
_POINTS = {"base": ("DDP_TORCH_BASE_PYTHON", "install-base"), "oldest": ("DDP_TORCH_OLDEST_PYTHON", "install-oldest")}


def _torch_version(python: str) -> str:
    proc = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{python} cannot import torch: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip()


def _unavailable(reason: str):
    if os.environ.get("DDP_TORCH_ENDS_REQUIRED") == "1":
        pytest.fail(reason + " (DDP_TORCH_ENDS_REQUIRED=1)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session", params=["newest", "base", "oldest"])
def torch_python(request) -> TorchEnd:
    oldest, newest = range_ends()
    if request.param == "newest":
        python, expected = sys.executable, newest
    else:
        variable, target = _POINTS[request.param]
        python, expected = os.environ.get(variable, ""), {"base": base_release(), "oldest": oldest}[request.param]
        if not python or not os.path.exists(python):
            _unavailable(f"the {request.param} point's torch ({'.'.join(map(str, expected))}) is not installed: "
                         f"`make {target}` and set {variable} (make test does both)")
    version = _torch_version(python)
    if os.environ.get("DDP_TORCH_ENDS_REQUIRED") == "1" and Version(version).release[:len(expected)] != expected:
        pytest.fail(f"{request.param} point: {python} has torch {version}, expected "
                    f"{'.'.join(map(str, expected))} ({TORCH_SUPPORTED})", pytrace=False)
    return TorchEnd(request.param, python, version)


def on_ends(*ends: str):
    """Runs the test on these points of the range only (``newest``, ``base``, ``oldest``)."""
    return pytest.mark.parametrize("torch_python", ends, indirect=True)


NEWEST_ONLY = on_ends("newest")
"""For a test whose behaviour does not depend on torch's version (see above)."""
