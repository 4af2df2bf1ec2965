import argparse
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer.checkpoint import CheckpointError, CheckpointManager


def state(step: int) -> dict:
    return {"step": step, "weights": torch.full((64,), float(step))}


def test_save_then_latest_loads_the_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        mgr.save(state(step), step)
    assert mgr.load(mgr.latest())["step"] == 3


def test_keeps_only_the_last_k(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        mgr.save(state(step), step)
    assert [s for s, _ in mgr.complete()] == [5, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000004.pt", "ckpt-000000004.pt.ok", "ckpt-000000005.pt", "ckpt-000000005.pt.ok"]


def test_the_checkpoint_just_written_is_never_pruned_even_below_older_higher_steps(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (900, 1000):
        mgr.save(state(step), step)
    mgr.save(state(8), 8)
    assert [s for s, _ in mgr.complete()] == [1000, 8]


def test_truncated_checkpoint_is_skipped_never_loaded(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(state(1), 1)
    newest = mgr.save(state(2), 2)
    with open(newest, "r+b") as handle:
        handle.truncate(newest.stat().st_size // 2)
    assert mgr.latest().name == "ckpt-000000001.pt"


def test_corrupted_bytes_of_the_same_size_are_detected(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(state(1), 1)
    newest = mgr.save(state(2), 2)
    data = bytearray(newest.read_bytes())
    data[-20] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert mgr.latest().name == "ckpt-000000001.pt"


def test_a_checkpoint_without_its_marker_does_not_count(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(state(1), 1)
    torch.save(state(2), tmp_path / "ckpt-000000002.pt")  # written, but never marked complete
    assert mgr.latest().name == "ckpt-000000001.pt"


def test_loading_refuses_arbitrary_pickled_objects(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save({"evil": argparse.Namespace(cmd="rm -rf /")}, 1)
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        mgr.load(path)


CRASHER = textwrap.dedent("""
    import os, sys, torch
    from trainer import checkpoint
    def half_written_then_die(fd):
        os.ftruncate(fd, os.fstat(fd).st_size // 2)
        os._exit(9)  # the process dies in the middle of the save: half the bytes, no rename
    os.fsync = half_written_then_die
    checkpoint.CheckpointManager(sys.argv[1]).save({"step": 2, "weights": torch.ones(100000)}, 2)
""")


def test_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(state(1), 1)
    proc = subprocess.run([sys.executable, "-c", CRASHER, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers, "the crash should have left a half-written temporary file behind"
    assert mgr.load(mgr.latest())["step"] == 1
    mgr.save(state(3), 3)  # the next save sweeps the dead writer's temporary file
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert mgr.load(mgr.latest())["step"] == 3


@pytest.fixture
def tiny_volume(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real full disk needs root to mount a small tmpfs")
    mnt = tmp_path / "vol"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_says_so(tiny_volume):
    mgr = CheckpointManager(tiny_volume, keep_last=3)
    mgr.save({"weights": torch.zeros(1000)}, 1)
    with pytest.raises(CheckpointError, match="no space left on the device; the previous checkpoint ckpt-000000001.pt is intact"):
        mgr.save({"weights": torch.zeros(1_000_000)}, 2)  # 4 MB into a 2 MB volume
    assert mgr.latest().name == "ckpt-000000001.pt"
    assert not [p for p in tiny_volume.iterdir() if "000000002" in p.name]
