"""Code snapshots: what is in one, how it is named, and what a node's store accepts (the node side
runs for real, as a local node's interpreter runs it)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from deploy.job import codesync
from deploy.nodes.remote import Remote
from local_job import local_nodes, on_paper



def _project(root: Path) -> Path:
    files = {
        "pkg/__init__.py": "", "pkg/train.py": "print('train')\n", "run.sh": "#!/bin/sh\n",
        ".gitignore": "runs/\n*.pyc\n!keep.pyc\n", "keep.pyc": "k", "pkg/x.pyc": "x",
        "runs/ckpt.pt": "big", "debug.log": "log", "data/.gitignore": "*.csv\n", "data/a.csv": "1",
        "data/readme.txt": "r", ".git/HEAD": "ref",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "run.sh").chmod(0o755)
    return root


def _inv(tmp_path: Path):
    return on_paper(local_nodes("a", "b"), job="codejob", nas=tmp_path / "nas", job_fields={"runtime": "host"},
                    train={"python": sys.executable, "module": "pkg.train",
                           "code": {"path": str(tmp_path / "proj"), "ignore": ["*.log"]}}, base_dir=tmp_path)


def test_a_snapshot_holds_what_git_would_track_and_is_named_by_its_content(tmp_path):
    root = _project(tmp_path / "proj")
    snap = codesync.scan(root, ["*.log"])
    assert [f.path for f in snap.files] == [".gitignore", "data/.gitignore", "data/readme.txt", "keep.pyc",
                                            "pkg/__init__.py", "pkg/train.py", "run.sh"]
    assert next(f for f in snap.files if f.path == "run.sh").key.endswith(".x")  # the executable bit travels
    assert codesync.scan(root, ["*.log"]).id == snap.id
    (root / "runs/other.pt").write_text("ignored: same snapshot")
    assert codesync.scan(root, ["*.log"]).id == snap.id
    (root / "pkg/train.py").write_text("print('edited')\n")
    assert codesync.scan(root, ["*.log"]).id != snap.id


def test_a_missing_code_directory_is_an_input_error_naming_the_field(tmp_path):
    with pytest.raises(codesync.CodeError, match=r"train.code: .*nope is not a directory"):
        codesync.scan(tmp_path / "nope")


def test_only_files_a_store_lacks_travel_and_a_shared_store_serves_every_node(tmp_path):
    _project(tmp_path / "proj")
    inv = _inv(tmp_path)
    snap = codesync.snapshot_of(inv)
    with Remote(inv) as remote:
        first = codesync.sync(inv, remote, snap)
        assert first["a"].files == len(snap.files) and first["b"].present  # b sees a's copy
        (tmp_path / "proj/pkg/train.py").write_text("print('edited')\n")
        edited = codesync.snapshot_of(inv)
        second = codesync.sync(inv, remote, edited)
    assert (second["a"].files, second["a"].bytes) == (1, len("print('edited')\n"))
    tree = Path(codesync.code_dir(inv, edited).host)
    assert (tree / "pkg/train.py").read_text() == "print('edited')\n"
    assert (tree / "run.sh").stat().st_mode & 0o111
    assert not (tree / "pkg/train.py").stat().st_mode & 0o222
    manifest = json.loads((tree / ".ddp-manifest.json").read_text())
    assert [e[0] for e in manifest] == [f.path for f in edited.files]


def _put(tmp_path: Path, members: dict[str, bytes], snapshot: str = "s1") -> subprocess.CompletedProcess:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return subprocess.run([sys.executable, "-c", codesync.NODE_PROGRAM.read_text(), "put", str(tmp_path / "store"),
                           snapshot], input=buf.getvalue(), capture_output=True)


def test_a_damaged_object_is_refused_and_nothing_enters_the_store(tmp_path):
    import hashlib

    key = hashlib.sha256(b"print(1)\n").hexdigest()
    manifest = json.dumps([["train.py", key, 9]]).encode()
    r = _put(tmp_path, {f"objects/{key}": b"print(2)\n", "manifest.json": manifest})
    assert r.returncode == 1 and b"arrived damaged" in r.stderr
    assert list((tmp_path / "store/objects").iterdir()) == []
    assert not (tmp_path / "store/snapshots/s1").exists()
    r = _put(tmp_path, {f"objects/{key}": b"print(1)\n", "manifest.json": manifest})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "store/snapshots/s1/train.py").read_bytes() == b"print(1)\n"


def test_a_manifest_path_leaving_the_snapshot_is_refused(tmp_path):
    import hashlib

    key = hashlib.sha256(b"x").hexdigest()
    r = _put(tmp_path, {f"objects/{key}": b"x", "manifest.json": json.dumps([["../evil", key, 1]]).encode()})
    assert r.returncode == 1 and b"unsafe path" in r.stderr
    assert not (tmp_path / "store/evil").exists() and not (tmp_path / "store/snapshots/s1").exists()


def test_a_symlinked_file_inside_the_project_travels_as_its_content(tmp_path):
    _project(tmp_path / "proj")
    (tmp_path / "proj/lib").mkdir()
    (tmp_path / "proj/lib/shared.py").write_text("X = 1\n")
    (tmp_path / "proj/pkg/shared.py").symlink_to("../lib/shared.py")
    inv = _inv(tmp_path)
    snap = codesync.snapshot_of(inv)
    with Remote(inv) as remote:
        codesync.sync(inv, remote, snap)
    tree = Path(codesync.code_dir(inv, snap).host)
    assert (tree / "pkg/shared.py").read_text() == "X = 1\n" and not (tree / "pkg/shared.py").is_symlink()
