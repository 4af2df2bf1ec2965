"""The read-only code snapshot behind the program's working directory (agent/workdir.py), through
the real CLI on a local host-runtime node: a snapshot something wrote into is moved aside and named,
a failed write through a file of the code is explained in one line, and a project with a trainer/
package of its own still runs the bundle's launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from local_job import local_hosts
from agent import contract
from agent import snapshot_hint
from agent.contract import module_argv

ROOT = Path(__file__).resolve().parents[1]


def _hosts(tmp_path: Path, train: dict) -> Path:
    return local_hosts(tmp_path, job="snapro", train=train)


def _snapshot(tmp_path: Path) -> Path:
    (snap,) = [p for p in (tmp_path / "nas/ckpt/.ddp-deploy/code/snapshots").iterdir() if ".moved-" not in p.name]
    return snap


@pytest.mark.e2e
def test_a_launch_names_the_file_it_moved_aside_from_a_snapshot_something_wrote_into(ddp, tmp_path):
    """A launch says which file it moved aside from a snapshot something wrote into."""
    project = tmp_path / "proj"
    project.mkdir()
    # a METRICS line: a run that shows nothing of training is no success (deploy/job/outcome.py)
    (project / "run.py").write_text("print('METRICS {\"kind\": \"final\", \"step\": 1}', flush=True)\n")
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


OWN_PACKAGES = """\
import json, os, agent, trainer
# the program's own agent and trainer packages, from its own directory: first on its path, as usual
# (the script's real directory, the snapshot, whose files the working directory links to)
for package in (agent, trainer):
    name = package.__name__
    mine = os.path.realpath(os.path.join(os.getcwd(), name, "__init__.py"))
    assert os.path.realpath(package.__file__) == mine != os.path.join(os.getcwd(), name, "__init__.py"), package.__file__
print("METRICS " + json.dumps({"kind": "final", "epoch": 0, "step": 1, "loss": 0.5, "mine": agent.MINE + trainer.MINE}),
      flush=True)
"""


@pytest.mark.e2e
def test_a_project_with_its_own_agent_and_trainer_still_runs_the_bundles_launcher(ddp, tmp_path):
    project = tmp_path / "proj"
    shadow = "import sys; print('the project launcher ran'); sys.exit(3)\n"
    for package in ("agent", "trainer"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text("MINE = 'yes'\n")
        for name in ("launch.py", "probe.py", "__main__.py"):
            (project / package / name).write_text(shadow)
    (project / "run.py").write_text(OWN_PACKAGES)
    hosts = _hosts(tmp_path, {"script": "run.py", "code": str(project)})

    r = ddp(hosts, "launch", "--wait", "--timeout", "120")
    assert r.exit_code == 0, r.output
    logs = ddp(hosts, "logs").stdout
    assert "the project launcher ran" not in logs and '"mine": "yesyes"' in logs, logs
    assert ddp(hosts, "stop").exit_code == 0


def test_the_entrypoint_runs_the_launcher_without_the_working_directory_on_its_path():
    """The image's entrypoint runs the launcher without the working directory on its path."""
    entry = next(line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT "))
    assert json.loads(entry[len("ENTRYPOINT "):]) == ["python", *module_argv("agent.launch")]
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


def _linked(tmp_path: Path, names: list[str]) -> tuple[Path, Path]:
    """A snapshot holding ``names`` and a working directory of links to them (agent/workdir.py)."""
    snap, work = tmp_path / "snap", tmp_path / "work"
    for name in names:
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_text("")
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(snap / name, work / name)
    return snap, work


@pytest.mark.parametrize("line, named, kind", [
    ("[rank0]: PermissionError: [Errno 13] Permission denied: 'snapshot.pt'", "snapshot.pt", "link"),
    ("OSError: [Errno 30] Read-only file system: 'runs/x'", "runs/x", "link"),
    ('PermissionError: [Errno 13] Permission denied: "it\'s.pt"', "it's.pt", "link"),
    ("RuntimeError: [enforce fail at inline_container.cc:747] . open file failed with strerror: Read-only file system",
     ".", "directory"),
    ("RuntimeError: File ckpt/last.pt cannot be opened.", "ckpt/last.pt", "link"),
    ("touch: cannot touch 'out.txt': Permission denied", "out.txt", "link"),
    ("sh: 1: cannot create log.txt: Read-only file system", "log.txt", "link"),
    ("PermissionError: [Errno 13] Permission denied: '{snap}/data'", "{snap}/data", "snapshot"),
])
def test_a_failed_write_through_the_code_is_found_in_each_writers_words(tmp_path, line, named, kind):
    snap, work = _linked(tmp_path, ["snapshot.pt", "runs/x", "it's.pt", "ckpt/last.pt", "out.txt", "log.txt"])
    line, named = line.replace("{snap}", str(snap)), named.replace("{snap}", str(snap))
    assert snapshot_hint.written_paths([line], str(snap), str(work)) == [snapshot_hint.Write(named, kind)]


def test_each_failed_write_is_one_line_naming_the_file_or_the_code_s_files_there(tmp_path):
    """Each failed write is said in one line, naming the file or the code's files there."""
    snap, work = _linked(tmp_path, ["model.pth", "train.py", "a/b.pt"])
    said = snapshot_hint.message(snapshot_hint.Write("model.pth", "link"), "/ckpt", str(snap), str(work))
    assert said == ("agent.launch: model.pth is a file of your code, a link to the read-only code snapshot: it "
                    "cannot be written; leave it out of train.code (train.code.ignore) so that the program writes "
                    "its own, or write to $DDP_CKPT_DIR (/ckpt)")
    said = snapshot_hint.message(snapshot_hint.Write(".", "directory"), "/ckpt", str(snap), str(work))
    assert said.startswith("agent.launch: a write in the working directory failed on a file of your code, a link "
                           "to the read-only code snapshot (torch names no file; the code's files there that are not "
                           "Python: model.pth); ")
    said = snapshot_hint.message(snapshot_hint.Write(f"{snap}/x", "snapshot"), None, str(snap), str(work))
    assert said == (f"agent.launch: {snap}/x is inside the read-only code snapshot itself (a resolved path leads "
                    "there, as Path(__file__).resolve() does): write relative to the working directory, or to "
                    "$DDP_CKPT_DIR")
    assert all(contract.is_hint(line) for line in [said])


def test_a_failed_write_elsewhere_or_another_error_is_not_blamed_on_the_snapshot(tmp_path):
    snap, work = _linked(tmp_path, ["train.py"])
    (work / "mine").mkdir()
    lines = ["PermissionError: [Errno 13] Permission denied: '/etc/shadow'",
             "OSError: [Errno 30] Read-only file system: '../elsewhere.pt'",
             "OSError: [Errno 30] Read-only file system: 'mine/new.pt'",
             "RuntimeError: [enforce fail at inline_container.cc:747] mine open file failed with strerror: "
             "Permission denied",
             "FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'"]
    assert snapshot_hint.written_paths(lines, str(snap), str(work)) == []


def test_the_launcher_reads_the_workers_output_and_says_it_once_per_path_as_text(tmp_path, monkeypatch):
    import io

    snap, work = _linked(tmp_path, ["a\x1b[2J.pt"])
    logs = tmp_path / "torchelastic/run_x/attempt_0/0"
    logs.mkdir(parents=True)
    (logs / "stderr.log").write_text("touch: cannot touch 'a\x1b[2J.pt': Permission denied\n" * 2)  # a raw ESC
    (logs / "stdout.log").write_text("")
    monkeypatch.chdir(work)
    out = io.StringIO()
    environ = {"DDP_CODE_SNAPSHOT": "abc", "DDP_CKPT_DIR": "/ckpt"}
    said = snapshot_hint.explain(snapshot_hint.tails(str(tmp_path / "torchelastic")), environ, out, str(snap))
    assert said == ["agent.launch: a\\x1b[2J.pt is a file of your code, a link to the read-only code snapshot: it "
                    "cannot be written; leave it out of train.code (train.code.ignore) so that the program writes "
                    "its own, or write to $DDP_CKPT_DIR (/ckpt)"]
    assert "\x1b" not in out.getvalue()
    assert snapshot_hint.explain(snapshot_hint.tails(str(tmp_path / "torchelastic")), {"DDP_CKPT_DIR": "/ckpt"},
                                 io.StringIO(), str(snap)) == []
