import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_ends import torch_python  # noqa: E402,F401  (the fixture: both ends of the torch range)


@pytest.fixture(autouse=True)
def fleet_lock_path(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own fleet lock directory (deploy/lock.py), never this machine's /tmp/ddp-deploy.lock:
    a test that launches is not refused by an operator's lock here, nor by a lock an earlier test left."""
    path = tmp_path_factory.mktemp("fleet-lock") / "ddp-deploy.lock"
    monkeypatch.setenv("DDP_DEPLOY_LOCK_PATH", str(path))
    return path
