"""The working directory of a synced program (agent/workdir.py): a tutorial script that reads
``data/`` beside it and saves ``checkpoint.pth`` and ``model.pth`` where it stands runs unchanged
through ``train.code`` on a local host-runtime node with real torchrun, resumes from its own
checkpoint at the next launch, and never writes into the snapshot; a save through a file of the
code fails, and ``launch --wait``'s own error line says which and what to do. Then the link tree
on its own: a refresh keeps what the program wrote, a link the job planted never takes the
launcher's writes outside, and a write through a link fails."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from local_job import local_hosts
from agent import workdir

TUTORIAL = """\
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
import helpers  # a module beside the script, as in the project directory
rows = [float(x) for x in open(os.path.join("data", "train.csv")).read().split()]  # data/ beside it
os.makedirs("data/FashionMNIST/raw", exist_ok=True)  # what download=True writes under root="data"
model = torch.nn.Linear(1, 1)
start = 0
if os.path.exists("checkpoint.pth"):  # resume from its own checkpoint
    state = torch.load("checkpoint.pth")
    model.load_state_dict(state["model"])
    start = state["epoch"] + 1
    print(f"resumed from epoch {state['epoch']}", flush=True)
dist.barrier()  # every rank has looked for the checkpoint before one is saved
if rank == 0:
    print("WHERE " + repr([os.getcwd(), os.path.abspath(__file__), sys.path[0], helpers.__file__]), flush=True)
for epoch in range(start, start + 1):
    loss = sum((model(torch.tensor([x])) - 2 * x).pow(2).sum() for x in rows)
    loss.backward()
    if local_rank == 0:  # each node saves "its own copy"
        torch.save({"epoch": epoch, "model": model.state_dict()}, "checkpoint.pth")
if local_rank == 0:
    torch.save(model.state_dict(), "model.pth")
dist.barrier()
dist.destroy_process_group()
"""


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "tutorial"
    (project / "data").mkdir(parents=True)
    (project / "data/train.csv").write_text("1 2 3\n")
    (project / "helpers.py").write_text("")
    (project / "train.py").write_text(TUTORIAL)
    return project


def _snapshots(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "nas/ckpt/.ddp-deploy/code/snapshots").iterdir() if ".moved-" not in p.name]


@pytest.mark.e2e
def test_a_tutorial_script_writes_where_it_stands_and_resumes_its_own_checkpoint(ddp, tmp_path):
    """A tutorial script writes where it stands, and resumes from its own checkpoint."""
    project = _project(tmp_path)
    hosts = local_hosts(tmp_path, job="tutorial", train={"script": "train.py", "code": str(project)}, procs=2)

    first = ddp(hosts, "launch", "--wait", "--timeout", "180")
    assert first.exit_code == 0, first.output
    work = tmp_path / "nas/ckpt/work/here"
    assert (work / "checkpoint.pth").is_file() and not (work / "checkpoint.pth").is_symlink()
    assert (work / "model.pth").is_file() and (work / "data/FashionMNIST/raw").is_dir()
    assert (work / "train.py").is_symlink() and (work / "data/train.csv").is_symlink()
    (snap,) = _snapshots(tmp_path)
    assert sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()) == [
        ".ddp-manifest.json", "data/train.csv", "helpers.py", "train.py"]
    logs = ddp(hosts, "logs").stdout
    (where,) = [eval(line.split("WHERE ", 1)[1]) for line in logs.splitlines() if "WHERE " in line]
    assert where[0] == str(work) and where[1] == str(work / "train.py")
    assert where[2] == str(snap) and where[3] == str(snap / "helpers.py")  # the script's real directory, as Python has it
    assert "resumed" not in logs
    assert ddp(hosts, "stop").exit_code == 0

    (project / "helpers.py").write_text("EDITED = True\n")  # a new snapshot: the links follow it
    again = ddp(hosts, "launch", "--wait", "--timeout", "180")
    assert again.exit_code == 0, again.output
    assert "resumed from epoch 0" in ddp(hosts, "logs").stdout
    new = [s for s in _snapshots(tmp_path) if s != snap]
    assert len(new) == 1 and os.readlink(work / "helpers.py") == str(new[0] / "helpers.py")
    assert not (snap / "checkpoint.pth").exists() and not (new[0] / "checkpoint.pth").exists()
    assert ddp(hosts, "stop").exit_code == 0


SAVES_OVER_ITS_CODE = """\
import torch
torch.save({"w": 1}, "model.pth")  # the project holds a model.pth from a run on a laptop
"""


@pytest.mark.e2e
def test_a_save_through_a_file_of_the_code_fails_and_the_error_line_says_which(ddp, tmp_path):
    project = tmp_path / "laptop"
    project.mkdir()
    (project / "train.py").write_text(SAVES_OVER_ITS_CODE)
    (project / "model.pth").write_bytes(b"weights from the laptop")
    (project / "notes.txt").write_text("")
    hosts = local_hosts(tmp_path, job="overcode", train={"script": "train.py", "code": str(project)})

    r = ddp(hosts, "launch", "--wait", "--timeout", "180")
    assert r.exit_code == 1, r.output
    (error,) = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert "here rank 0 failed first (exit 1)" in error
    assert ("agent.launch: a write in the working directory failed on a file of your code, a link to the "
            "read-only code snapshot (torch names no file; the code's files there that are not Python: "
            "model.pth, notes.txt); leave it out of train.code (train.code.ignore)") in error, error
    (snap,) = _snapshots(tmp_path)
    assert (snap / "model.pth").read_bytes() == b"weights from the laptop"
    assert ddp(hosts, "stop").exit_code == 0


# The link tree on its own (agent/workdir.py), on a plain directory as the snapshot.

def _snapshot(tmp_path: Path, files: dict[str, str]) -> Path:
    snap = tmp_path / "snap"
    shutil.rmtree(snap, ignore_errors=True)
    for rel, text in files.items():
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).write_text(text)
    (snap / workdir.MANIFEST).write_text("[]")
    return snap


def _refresh(tmp_path: Path, snap: Path) -> tuple[Path, str]:
    work = tmp_path / "ckpt/work/node1"
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    out = io.StringIO()
    os.close(workdir.refresh(str(work), str(snap), out))
    return work, out.getvalue()


def test_a_refresh_follows_the_new_code_and_keeps_what_the_program_wrote(tmp_path):
    snap = _snapshot(tmp_path, {"train.py": "1", "pkg/a.py": "a", "old/gone.py": "g"})
    work, said = _refresh(tmp_path, snap)
    assert said == "" and not (work / workdir.MANIFEST).exists()
    assert os.readlink(work / "pkg/a.py") == str(snap / "pkg/a.py") and not (work / "pkg").is_symlink()
    (work / "checkpoint.pth").write_text("mine")
    (work / "pkg/out.txt").write_text("mine too")
    (work / "old/notes.txt").write_text("kept")
    os.symlink("/somewhere/of/mine", work / "latest")  # a link the program made: its own

    snap = _snapshot(tmp_path, {"train.py": "2", "pkg/b.py": "b", "old/gone.py": "g", "pkg/c.py": ""})
    os.remove(snap / "old/gone.py")
    work, said = _refresh(tmp_path, snap)
    assert said == ""
    assert (work / "checkpoint.pth").read_text() == "mine" and (work / "pkg/out.txt").read_text() == "mine too"
    assert (work / "old/notes.txt").read_text() == "kept" and os.readlink(work / "latest") == "/somewhere/of/mine"
    assert not os.path.lexists(work / "pkg/a.py") and not os.path.lexists(work / "old/gone.py")
    assert (work / "pkg/b.py").read_text() == "b" and (work / "train.py").read_text() == "2"


def test_a_file_the_program_put_where_the_code_now_has_one_is_kept_and_named(tmp_path):
    snap = _snapshot(tmp_path, {"train.py": "1"})
    work, _ = _refresh(tmp_path, snap)
    (work / "config.yaml").write_text("the program's")
    snap = _snapshot(tmp_path, {"train.py": "1", "config.yaml": "the code's"})
    work, said = _refresh(tmp_path, snap)
    assert (work / "config.yaml").read_text() == "the program's"
    assert said.startswith('agent.launch: warning: "config.yaml" in the working directory ') and "kept" in said


def test_a_link_the_job_planted_never_takes_the_launchers_writes_outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    snap = _snapshot(tmp_path, {"train.py": "1", "pkg/a.py": "a"})
    work, _ = _refresh(tmp_path, snap)
    os.remove(work / "pkg/a.py")
    os.rmdir(work / "pkg")
    os.symlink(outside, work / "pkg")  # where the code has a directory
    record = tmp_path / "ckpt/work/.node1.links"  # the launcher's record of its links
    os.remove(record)
    os.symlink(outside / "links", record)
    snap = _snapshot(tmp_path, {"train.py": "1", "pkg/a.py": "a", "pkg/sub/b.py": "b"})
    work, said = _refresh(tmp_path, snap)
    assert list(outside.iterdir()) == [] and '"pkg"' in said
    assert os.readlink(work / "pkg") == str(outside)
    assert not record.is_symlink() and json.loads(record.read_text()) == {"train.py": str(snap / "train.py")}

    shutil.rmtree(tmp_path / "ckpt/work")
    (tmp_path / "ckpt/work").mkdir()
    os.symlink(outside, tmp_path / "ckpt/work/node1")  # the working directory itself
    with pytest.raises(workdir.WorkDirError, match="is a link or not a directory"):
        _refresh(tmp_path, snap)
    assert list(outside.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="file modes do not stop root (its snapshot is a read-only mount)")
def test_a_write_through_a_link_fails_and_a_new_file_lands_in_the_working_directory(tmp_path):
    snap = _snapshot(tmp_path, {"model.pth": "the code's"})
    os.chmod(snap / "model.pth", 0o444)
    work, _ = _refresh(tmp_path, snap)
    with pytest.raises(PermissionError):
        (work / "model.pth").write_text("over it")
    (work / "new.pth").write_text("mine")
    assert (snap / "model.pth").read_text() == "the code's" and not (snap / "new.pth").exists()


def test_a_write_through_a_link_fails_for_root_in_the_snapshots_read_only_mount(tmp_path):
    snap = _snapshot(tmp_path, {"model.pth": "the code's"})
    work, _ = _refresh(tmp_path, snap)
    script = f"open({str(work / 'model.pth')!r}, 'w').write('over it')"
    # as deploy/programs/in_dir.sh runs root's job: the snapshot bound read-only in a namespace of its own
    argv = ["unshare", "--mount", "--propagation", "slave", "sh", "-c",
            'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && exec "$2" -c "$3"', "sh", str(snap),
            sys.executable, script]
    if os.geteuid() != 0 or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("needs root that can make a mount namespace")
    r = subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 1 and "Read-only file system" in r.stderr, r.stderr
    assert (snap / "model.pth").read_text() == "the code's"


def test_without_a_snapshot_the_launcher_stays_where_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert workdir.enter({"DDP_CKPT_DIR": str(tmp_path), "DDP_NODE_NAME": "n"}) is None
    assert os.getcwd() == str(tmp_path) and not (tmp_path / "work").exists()
    with pytest.raises(workdir.WorkDirError):
        workdir.enter({"DDP_CODE_SNAPSHOT": "x", "DDP_CKPT_DIR": str(tmp_path), "DDP_NODE_NAME": ".."})
    assert json.dumps(workdir.path({"DDP_CKPT_DIR": "/ckpt", "DDP_NODE_NAME": "n1"})) == '"/ckpt/work/n1"'


SAVES_WITHOUT_SYNC = """\
import os
import torch.distributed as dist
dist.init_process_group("gloo")
open("model.pth", "w").write(os.getcwd())
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.e2e
def test_without_train_code_the_host_runtime_runs_in_the_node_s_own_directory(ddp, tmp_path, monkeypatch):
    """Without train.code the host runtime runs check and the job in the node's own directory."""
    shell = tmp_path / "operator-shell"
    shell.mkdir()
    (shell / "train.py").write_text(SAVES_WITHOUT_SYNC)
    monkeypatch.chdir(shell)  # where the operator's shell is: not where the job runs
    work = tmp_path / "nas/ckpt/work/here"
    relative = local_hosts(tmp_path, job="nosync", train={"script": "train.py"}, name="relative.yaml")
    checked = ddp(relative, "check")
    assert checked.exit_code == 1 and f"no file train.py in {work}" in checked.output, checked.output

    hosts = local_hosts(tmp_path, job="nosync", train={"script": str(shell / "train.py")})
    r = ddp(hosts, "launch", "--wait", "--timeout", "180")
    assert r.exit_code == 0, r.output
    assert (work / "model.pth").read_text() == str(work) and not (shell / "model.pth").exists()
    assert ddp(hosts, "stop").exit_code == 0
