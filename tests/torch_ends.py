"""The ``torch_python`` fixture: an interpreter at each end of the supported torch range.

``newest`` is the interpreter running the tests (the Makefile's main venv); ``oldest`` is
``$DDP_TORCH_OLDEST_PYTHON`` (the Makefile's second venv, the Dockerfile's default base's
torch). A test taking the fixture runs once per end, unless it is marked ``NEWEST_ONLY``: a test of
what does not change with torch's version (the trainer's own logic over torch's stable API) runs on
the newest end alone, since each end costs a whole training run. What torch changed between the
ends runs on both: the stores' bind, torchrun's signals and error files, autocast, torch.load's
defaults, torchvision, a mid-epoch resume's state. Where the oldest is not installed the
test is skipped with the reason; with ``DDP_TORCH_ENDS_REQUIRED=1`` (CI) that is a failure, and
each interpreter's torch must then be exactly the end of the range it stands for.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from trainer.compat import TORCH_SUPPORTED


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


@pytest.fixture(scope="session", params=["newest", "oldest"])
def torch_python(request) -> TorchEnd:
    oldest, newest = range_ends()
    if request.param == "newest":
        python, expected = sys.executable, newest
    else:
        python, expected = os.environ.get("DDP_TORCH_OLDEST_PYTHON", ""), oldest
        if not python or not os.path.exists(python):
            _unavailable("the oldest supported torch is not installed: `make install-oldest` and set "
                         "DDP_TORCH_OLDEST_PYTHON (make test does both)")
    version = _torch_version(python)
    if os.environ.get("DDP_TORCH_ENDS_REQUIRED") == "1" and Version(version).release[:len(expected)] != expected:
        pytest.fail(f"{request.param} end: {python} has torch {version}, expected "
                    f"{'.'.join(map(str, expected))} ({TORCH_SUPPORTED})", pytrace=False)
    return TorchEnd(request.param, python, version)


def on_ends(*ends: str):
    """Runs the test on these ends of the range only (``newest``, ``oldest``)."""
    return pytest.mark.parametrize("torch_python", ends, indirect=True)


NEWEST_ONLY = on_ends("newest")
"""For a test whose behaviour does not depend on torch's version (see above)."""
