"""The user's own code through the real CLI on a local host-runtime node: a package from a synced
snapshot (only changed files travel, a relaunch resumes), secrets that never show, and a program
that does not import refused before anything starts."""

from __future__ import annotations

import json
import re
import shutil
import stat
from pathlib import Path

import pytest

from local_job import local_hosts

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-value-for-the-test"


def _hosts(tmp_path: Path, train: dict) -> Path:
    return local_hosts(tmp_path, job="usercode", train=train, procs=2)


def _ok(r):
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r


def test_a_synced_package_trains_resumes_and_a_one_file_edit_sends_one_file(ddp, tmp_path):
    """A package from a synced snapshot trains and resumes, and a one-file edit sends one file."""
    project = tmp_path / "regress"
    shutil.copytree(ROOT / "examples/regress", project, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    (project / "runs").mkdir()
    (project / "runs/huge.bin").write_bytes(b"\0" * 1000)  # ignored by the example's .gitignore
    train = {"module": "regress.train", "code": str(project), "args": ["--epochs", "1", "--samples", "512"]}
    hosts = _hosts(tmp_path, train)

    first = _ok(ddp(hosts, "launch", "--wait", "--timeout", "240"))
    # a program of its own: when its first step came (a METRICS line or a heartbeat), said and kept
    assert re.search(r"^first step after \d+\.\d s \(here: ", first.stdout, re.M), first.stdout
    assert json.loads(_ok(ddp(hosts, "runs", "--json")).stdout)[-1]["record"]["first_step"]["node"] == "here"
    files = len([p for p in project.rglob("*") if p.is_file() and "runs" not in p.parts])
    assert f"code sent {files} files" in first.stdout
    assert "module regress.train, code snapshot" in first.stdout
    snapshots = list((tmp_path / "nas/ckpt/.ddp-deploy/code/snapshots").iterdir())
    assert len(snapshots) == 1
    snap = snapshots[0]
    assert (snap / "regress/train.py").read_bytes() == (project / "regress/train.py").read_bytes()
    assert not (snap / "runs").exists()
    assert not stat.S_IMODE((snap / "regress/train.py").stat().st_mode) & 0o222  # read-only
    assert (tmp_path / "nas/ckpt/latest.pt").exists()
    kept = json.loads((tmp_path / "nas/ckpt/.ddp-deploy/usercode/launch.json").read_text())
    assert kept["code_snapshot"] == snap.name and kept["program"] == "module regress.train"

    status = json.loads(_ok(ddp(hosts, "status", "--json")).stdout)[0]
    assert status["state"] == "exited(0)" and json.loads(status["metrics"][len("METRICS "):])["kind"] == "eval"

    same = _ok(ddp(hosts, "launch", "--wait", "--timeout", "240"))  # nothing changed: nothing travels
    assert f"code snapshot {snap.name[:12]} present" in same.stdout

    model = project / "regress/model.py"
    model.write_text(model.read_text() + "\n# an edit\n")
    hosts = _hosts(tmp_path, {**train, "args": ["--epochs", "2", "--samples", "512"]})
    again = _ok(ddp(hosts, "launch", "--wait", "--timeout", "240"))
    assert "code sent 1 file (" in again.stdout
    logs = _ok(ddp(hosts, "logs")).stdout
    assert "resuming from" in logs and "epoch 1" in logs  # the checkpoint of the first launch
    assert len(list((tmp_path / "nas/ckpt/.ddp-deploy/code/snapshots").iterdir())) == 2


LEAK = """\
import json, os
if os.environ["RANK"] == "0":  # one process prints: the two ranks' lines would interleave
    print("METRICS " + json.dumps({"kind": "train", "epoch": 0, "step": 1, "loss": 1.0, "token": os.environ["API_TOKEN"]}), flush=True)
    print("the token is", os.environ["API_TOKEN"], flush=True)
assert os.environ["DDP_DEVICE"] == "cpu" and os.environ["DDP_BACKEND"] == "gloo"
assert os.environ["DDP_CKPT_DIR"].endswith("/nas/ckpt") and os.environ["DDP_RUN_ID"] == "usercode"
"""


def test_a_secret_reaches_the_program_and_shows_as_stars_everywhere_the_tool_prints(ddp, tmp_path):
    project = tmp_path / "leaky"
    project.mkdir()
    (project / "leak.py").write_text(LEAK)
    hosts = _hosts(tmp_path, {"script": "leak.py", "code": str(project),
                              "secrets": {"API_TOKEN": {"env": "TEST_API_TOKEN"}}})
    env = {"TEST_API_TOKEN": SECRET}

    missing = ddp(hosts, "launch", env={"TEST_API_TOKEN": None})
    assert missing.exit_code == 2 and "train.secrets.API_TOKEN: $TEST_API_TOKEN is not set" in missing.stderr

    dry = _ok(ddp(hosts, "launch", "--dry-run", env=env))
    assert "API_TOKEN=*** (from $TEST_API_TOKEN)" in dry.stdout and SECRET not in dry.output

    launched = _ok(ddp(hosts, "-v", "launch", "--wait", "--timeout", "240", env=env))
    assert SECRET not in launched.output
    logs = _ok(ddp(hosts, "logs", env=env)).stdout
    assert "the token is ***" in logs and SECRET not in logs  # it reached the program, it is not shown
    status = _ok(ddp(hosts, "status", "--json", env=env)).stdout
    assert '"token": "***"' in json.loads(status)[0]["metrics"] and SECRET not in status
    assert SECRET not in (tmp_path / "debug.log").read_text()
    assert SECRET not in (tmp_path / "hosts.yaml").read_text()
    kept = (tmp_path / "nas/ckpt/.ddp-deploy/usercode/launch.json").read_text()
    assert SECRET not in kept and json.loads(kept)["secrets"] == {"API_TOKEN": "$TEST_API_TOKEN"}


def test_a_module_that_does_not_import_is_refused_naming_the_error_starting_nothing(ddp, tmp_path):
    """A module that does not import is refused, naming the error, and nothing starts."""
    project = tmp_path / "proj"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg/__init__.py").write_text("")
    (project / "pkg/train.py").write_text("print('training')\n")
    hosts = _hosts(tmp_path, {"module": "pkg.trian", "code": str(project)})

    r = ddp(hosts, "launch")
    assert r.exit_code == 1
    assert "here program: module pkg.trian does not import" in r.stderr
    assert "No module named 'pkg.trian'" in r.stderr
    assert json.loads(_ok(ddp(hosts, "status", "--json")).stdout)[0]["state"] == "absent"

    checked = ddp(hosts, "check")
    assert checked.exit_code == 1 and "No module named 'pkg.trian'" in checked.stderr
    fixed = _hosts(tmp_path, {"module": "pkg.train", "code": str(project)})
    passed = _ok(ddp(fixed, "check")).stdout
    assert "all " in passed and "pkg.train imports" in " ".join(passed.split())
