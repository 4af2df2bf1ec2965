"""What train.code publishes and what a node's code store trusts: links leading outside the project
are refused by name, a symlinked directory is never dropped, and nothing already on the shared
volume (an object, a snapshot) is used before it is checked (the node side runs for real)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from deploy.job import codesync
from deploy.nodes.remote import Remote
from test_deploy_codesync import _inv, _project, _put


def test_a_link_out_of_the_project_is_refused_naming_the_link_and_its_target(tmp_path):
    """A link to a file outside the project is refused, naming the link and its target."""
    root = _project(tmp_path / "proj")
    (tmp_path / "id_ed25519").write_text("PRIVATE KEY")
    (root / "pkg/key").symlink_to(tmp_path / "id_ed25519")
    with pytest.raises(codesync.CodeError) as e:
        codesync.scan(root)
    said = str(e.value)
    assert said.startswith(f"train.code: pkg/key is a link to {tmp_path / 'id_ed25519'}, outside the project")
    assert "train.code.ignore" in said and "\n" not in said


def test_a_link_outside_the_project_through_a_link_inside_it_is_refused_too(tmp_path):
    root = _project(tmp_path / "proj")
    (tmp_path / "secret").write_text("s")
    (root / "hop").symlink_to(tmp_path / "secret")
    (root / "pkg/via").symlink_to("../hop")
    with pytest.raises(codesync.CodeError, match=r"train.code: (hop|pkg/via) is a link to .*secret, outside"):
        codesync.scan(root, ["hop"])  # the link itself ignored, the one reaching it not


def test_an_ignored_link_outside_the_project_is_left_out_without_complaint(tmp_path):
    root = _project(tmp_path / "proj")
    (tmp_path / "secret").write_text("s")
    (root / "pkg/key").symlink_to(tmp_path / "secret")
    assert "pkg/key" not in [f.path for f in codesync.scan(root, ["pkg/key"]).files]


def test_a_symlinked_directory_inside_the_project_is_followed_under_its_own_name(tmp_path):
    root = _project(tmp_path / "proj")
    (root / "common").mkdir()
    (root / "common/util.py").write_text("U = 1\n")
    (root / "pkg/common").symlink_to("../common")
    paths = [f.path for f in codesync.scan(root).files]
    assert "common/util.py" in paths and "pkg/common/util.py" in paths


def test_a_symlinked_directory_outside_the_project_is_refused_by_name_not_dropped(tmp_path):
    root = _project(tmp_path / "proj")
    (tmp_path / "dot-ssh").mkdir()
    (tmp_path / "dot-ssh/id_ed25519").write_text("PRIVATE KEY")
    (root / "keys").symlink_to(tmp_path / "dot-ssh")
    with pytest.raises(codesync.CodeError, match=r"^train.code: keys is a link to .*dot-ssh, outside the project"):
        codesync.scan(root)


def test_a_link_to_a_directory_that_holds_it_is_refused_as_a_loop(tmp_path):
    root = _project(tmp_path / "proj")
    (root / "pkg/up").symlink_to("..")
    with pytest.raises(codesync.CodeError, match=r"^train.code: pkg/up is a link to a directory that holds it"):
        codesync.scan(root)


def test_two_directories_linked_into_each_other_are_refused_as_a_loop(tmp_path):
    root = _project(tmp_path / "proj")
    (root / "a").mkdir()
    (root / "b").mkdir()
    (root / "a/to_b").symlink_to("../b")
    (root / "b/to_a").symlink_to("../a")
    with pytest.raises(codesync.CodeError, match=r"^train.code: a/to_b/to_a is a link to a directory that holds it"):
        codesync.scan(root)


def _store(inv) -> Path:
    return Path(codesync.store_dir(inv))


def _sync(inv, snap):
    with Remote(inv) as remote:
        return codesync.sync(inv, remote, snap, nodes=["a"])


def _key(snap, path: str) -> str:
    return next(f.key for f in snap.files if f.path == path)


@pytest.mark.parametrize("plant", ["other content", "a link", "writable by all", "another owner", "a directory"])
def test_an_object_planted_in_the_store_is_replaced_before_a_snapshot_is_built(tmp_path, plant):
    """An object planted in the store is replaced before a snapshot is built from it."""
    if plant == "another owner" and os.geteuid() != 0:
        pytest.skip("only root can give a file away")
    _project(tmp_path / "proj")
    inv = _inv(tmp_path)
    snap = codesync.snapshot_of(inv)
    objects = _store(inv) / "objects"
    objects.mkdir(parents=True)
    key = _key(snap, "pkg/train.py")
    planted = objects / key
    if plant == "other content":
        planted.write_text("import os; os.system('evil')\n")
    elif plant == "a link":  # right content today, whatever its owner writes there tomorrow
        (tmp_path / "theirs.py").write_text("print('train')\n")
        planted.symlink_to(tmp_path / "theirs.py")
    elif plant == "writable by all":
        planted.write_text("print('train')\n")
        planted.chmod(0o666)
    elif plant == "another owner":  # right content, but its owner can change it once it is linked
        planted.write_text("print('train')\n")
        planted.chmod(0o444)
        os.chown(planted, 4242, 4242)
    else:
        planted.mkdir()
    sent = _sync(inv, snap)["a"]
    assert sent.files == len({f.key for f in snap.files})  # the planted one travelled with the rest
    tree = Path(codesync.code_dir(inv, snap).host)
    assert (tree / "pkg/train.py").read_text() == "print('train')\n"
    assert planted.is_file() and not planted.is_symlink() and not planted.stat().st_mode & 0o222
    assert hashlib.sha256(planted.read_bytes()).hexdigest() == key


def test_an_object_damaged_after_listing_is_caught_by_the_build_and_removed(tmp_path):
    """An object damaged after the store listed it is caught by the build and removed."""
    good = b"print(1)\n"
    key = hashlib.sha256(good).hexdigest()
    objects = tmp_path / "store/objects"
    objects.mkdir(parents=True)
    (objects / key).write_bytes(b"print('planted')\n")
    (objects / key).chmod(0o444)
    # the stream holds only the manifest: the node said it had the object
    r = _put(tmp_path, {"manifest.json": json.dumps([["train.py", key, len(good)]]).encode()})
    assert r.returncode == 1
    assert f"object {key} for train.py in the store was not what its name says".encode() in r.stderr
    assert not (objects / key).exists() and not (tmp_path / "store/snapshots/s1").exists()
    assert [p.name for p in (tmp_path / "store/snapshots").iterdir()] == []  # no half-built tree left


def test_a_snapshot_written_into_is_moved_aside_naming_the_file_and_built_again(tmp_path):
    """A snapshot a program wrote into is moved aside, naming the file, and built again."""
    _project(tmp_path / "proj")
    inv = _inv(tmp_path)
    snap = codesync.snapshot_of(inv)
    _sync(inv, snap)
    tree = Path(codesync.code_dir(inv, snap).host)
    tree.chmod(0o755)  # as root may, whatever the mode
    (tree / "snapshot.pt").write_bytes(b"weights")
    tree.chmod(0o555)

    sent = _sync(inv, snap)["a"]
    assert not sent.present and len(sent.moved) == 1
    moved, said = sent.moved[0].split(": ", 1)
    assert said == '"snapshot.pt" (not part of the code: written there)'
    assert (Path(moved) / "snapshot.pt").read_bytes() == b"weights"  # kept, never deleted
    assert not (tree / "snapshot.pt").exists() and (tree / "pkg/train.py").read_text() == "print('train')\n"
    assert _sync(inv, snap)["a"].present


def test_a_snapshot_planted_in_the_store_is_checked_against_the_code_and_rebuilt(tmp_path):
    _project(tmp_path / "proj")
    inv = _inv(tmp_path)
    snap = codesync.snapshot_of(inv)
    tree = Path(codesync.code_dir(inv, snap).host)
    tree.mkdir(parents=True)
    for f in snap.files:
        (tree / f.path).parent.mkdir(parents=True, exist_ok=True)
        (tree / f.path).write_bytes((tmp_path / "proj" / f.path).read_bytes())
    (tree / "pkg/train.py").write_text("import os; os.system('evil')\n")
    (tree / ".ddp-manifest.json").write_text(json.dumps(json.loads(snap.manifest())))

    sent = _sync(inv, snap)["a"]
    assert not sent.present and '"pkg/train.py" (changed)' in sent.moved[0]
    assert (tree / "pkg/train.py").read_text() == "print('train')\n"

