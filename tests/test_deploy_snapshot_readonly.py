"""The code snapshot as the program's working directory, through the real CLI on a local
host-runtime node: read-only for root too, a failed write into it explained in one line, and a
project with a trainer/ package of its own still run by the bundle's launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from deploy.cli import cli
from local_job import local_hosts
from trainer import snapshot_hint
from trainer.entry import module_argv

ROOT = Path(__file__).resolve().parents[1]


def _hosts(tmp_path: Path, train: dict) -> Path:
    return local_hosts(tmp_path, job="snapro", train=train)


@pytest.fixture
def ddp(tmp_path, monkeypatch):
    runner = CliRunner()
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))

    def run(hosts: Path, *args: str):
        return runner.invoke(cli, ["--hosts", str(hosts), *args])

    return run


def _snapshot(tmp_path: Path) -> Path:
    (snap,) = [p for p in (tmp_path / "nas/ckpt/.ddp-deploy/code/snapshots").iterdir() if ".moved-" not in p.name]
    return snap


def _can_mount() -> bool:
    return subprocess.run(["unshare", "--mount", "--propagation", "slave", "true"], capture_output=True).returncode == 0


SAVES_IN_CWD = """\
with open("snapshot.pt", "wb") as f:  # the tutorial's checkpoint: into the working directory
    f.write(b"weights")
"""


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="the read-only mount is what root gets; others meet the file modes")
@pytest.mark.skipif(os.geteuid() == 0 and not _can_mount(), reason="root here cannot make a mount namespace")
def test_a_program_run_as_root_cannot_save_into_the_snapshot_and_is_told_where_to_write(ddp, tmp_path):
    project = tmp_path / "tutorial"
    project.mkdir()
    (project / "train.py").write_text(SAVES_IN_CWD)
    hosts = _hosts(tmp_path, {"script": "train.py", "code": str(project)})

    r = ddp(hosts, "launch", "--wait", "--timeout", "120")
    assert r.exit_code == 1, r.output
    logs = ddp(hosts, "logs").stdout
    said = [line for line in logs.splitlines() if "trainer.launch: snapshot.pt" in line]
    assert said and said[0].endswith("trainer.launch: snapshot.pt is in the read-only code snapshot (the working "
                                     f"directory); write to $DDP_CKPT_DIR ({tmp_path / 'nas/ckpt'})"), logs
    assert not (_snapshot(tmp_path) / "snapshot.pt").exists()
    assert ddp(hosts, "stop").exit_code == 0


@pytest.mark.e2e
def test_a_launch_says_which_file_it_moved_aside_from_a_snapshot_something_wrote_into(ddp, tmp_path):
    project = tmp_path / "proj"
    project.mkdir()
    (project / "run.py").write_text("print('ran', flush=True)\n")
    hosts = _hosts(tmp_path, {"script": "run.py", "code": str(project)})
    assert ddp(hosts, "launch", "--wait", "--timeout", "120").exit_code == 0
    assert ddp(hosts, "stop").exit_code == 0
    snap = _snapshot(tmp_path)
    os.chmod(snap, 0o755)  # what root, or an owner who made it writable again, can do
    (snap / "snapshot.pt").write_bytes(b"weights")

    r = ddp(hosts, "launch", "--wait", "--timeout", "120")
    assert r.exit_code == 0, r.output
    (warning,) = [line for line in r.output.splitlines() if "was not your code; moved aside:" in line]
    assert warning.startswith("here: warning: code snapshot ") and '"snapshot.pt"' in warning, warning
    assert not (_snapshot(tmp_path) / "snapshot.pt").exists()
    assert ddp(hosts, "stop").exit_code == 0


OWN_TRAINER = """\
import json, os, trainer
# the program's own trainer package, from its own directory: first on its path, as usual
assert os.path.dirname(trainer.__file__) == os.path.join(os.getcwd(), "trainer"), trainer.__file__
print("METRICS " + json.dumps({"kind": "final", "epoch": 0, "step": 1, "loss": 0.5, "mine": trainer.MINE}), flush=True)
"""


@pytest.mark.e2e
def test_a_project_with_a_trainer_package_of_its_own_still_runs_the_bundles_launcher(ddp, tmp_path):
    project = tmp_path / "proj"
    (project / "trainer").mkdir(parents=True)
    (project / "trainer/__init__.py").write_text("MINE = 'yes'\n")
    shadow = "import sys; print('the project launcher ran'); sys.exit(3)\n"
    for name in ("launch.py", "probe.py", "__main__.py"):
        (project / "trainer" / name).write_text(shadow)
    (project / "run.py").write_text(OWN_TRAINER)
    hosts = _hosts(tmp_path, {"script": "run.py", "code": str(project)})

    r = ddp(hosts, "launch", "--wait", "--timeout", "120")
    assert r.exit_code == 0, r.output
    logs = ddp(hosts, "logs").stdout
    assert "the project launcher ran" not in logs and '"mine": "yes"' in logs, logs
    assert ddp(hosts, "stop").exit_code == 0


def test_the_images_entrypoint_runs_the_launcher_without_the_working_directory_on_its_path():
    entry = next(line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT "))
    assert json.loads(entry[len("ENTRYPOINT "):]) == ["python", *module_argv("trainer.launch")]
    project = (ROOT / "docker/Dockerfile.project").read_text().splitlines()
    assert not [line for line in project if line.startswith("ENTRYPOINT")]  # a project image inherits it


def test_the_bundle_module_form_skips_a_trainer_package_in_the_working_directory(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer/__init__.py").write_text("")
    (tmp_path / "trainer/entry.py").write_text("import sys; print('shadowed'); sys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shadowed = subprocess.run([sys.executable, "-m", "trainer.entry"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert shadowed.stdout == "shadowed\n"  # what `python -m` does
    ours = subprocess.run([sys.executable, *module_argv("trainer.entry")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ours.returncode == 0 and "shadowed" not in ours.stdout, ours.stderr


@pytest.mark.parametrize("line, named", [
    ("[rank0]: PermissionError: [Errno 13] Permission denied: 'snapshot.pt'", "snapshot.pt"),
    ("OSError: [Errno 30] Read-only file system: 'runs'", "runs"),
    ('PermissionError: [Errno 13] Permission denied: "it\'s.pt"', "it's.pt"),
    ("RuntimeError: [enforce fail at inline_container.cc:747] . open file failed with strerror: Read-only file system", "."),
    ("RuntimeError: File ckpt/last.pt cannot be opened.", "ckpt/last.pt"),
    ("touch: cannot touch 'out.txt': Permission denied", "out.txt"),
    ("sh: 1: cannot create log.txt: Read-only file system", "log.txt"),
])
def test_a_failed_write_into_the_snapshot_is_found_in_each_writers_words(tmp_path, line, named):
    assert snapshot_hint.written_paths([line], str(tmp_path)) == [named]


def test_an_error_naming_only_the_working_directory_says_so_without_a_path():
    said = snapshot_hint.message(".", "/ckpt")
    assert said == ("trainer.launch: the working directory is the read-only code snapshot: a file cannot be "
                    "written there; write to $DDP_CKPT_DIR (/ckpt)")


def test_a_failed_write_elsewhere_or_another_error_is_not_blamed_on_the_snapshot(tmp_path):
    lines = ["PermissionError: [Errno 13] Permission denied: '/etc/shadow'",
             "OSError: [Errno 30] Read-only file system: '../elsewhere.pt'",
             "FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'"]
    assert snapshot_hint.written_paths(lines, str(tmp_path)) == []


def test_the_launcher_reads_the_workers_output_and_says_it_once_per_path_as_text(tmp_path, monkeypatch):
    import io

    logs = tmp_path / "torchelastic/run_x/attempt_0/0"
    logs.mkdir(parents=True)
    (logs / "stderr.log").write_text("touch: cannot touch 'a\x1b[2J.pt': Permission denied\n" * 2)  # a raw ESC
    (logs / "stdout.log").write_text("")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    said = snapshot_hint.explain(snapshot_hint.tails(str(tmp_path / "torchelastic")), {"DDP_CODE_SNAPSHOT": "abc", "DDP_CKPT_DIR": "/ckpt"}, out)
    assert said == ["trainer.launch: a\\x1b[2J.pt is in the read-only code snapshot (the working directory); "
                    "write to $DDP_CKPT_DIR (/ckpt)"]
    assert "\x1b" not in out.getvalue()
    assert snapshot_hint.explain(snapshot_hint.tails(str(tmp_path / "torchelastic")), {"DDP_CKPT_DIR": "/ckpt"}, io.StringIO()) == []
