import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer.checkpointer import say_skipped
from trainer.checkpoint import CheckpointError, CheckpointStore
from trainer_helpers import SMALL, metrics, run_torchrun


def state(step: int) -> dict:
    return {"step": step, "weights": torch.full((64,), float(step))}


def test_save_then_latest_loads_the_newest(tmp_path):
    mgr = CheckpointStore(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        mgr.save(state(step), step)
    assert mgr.load(mgr.latest())["step"] == 3


def test_keeps_only_the_last_k(tmp_path):
    mgr = CheckpointStore(tmp_path, keep_last=2)
    for step in range(1, 6):
        mgr.save(state(step), step)
    assert [s for s, _ in mgr.complete()] == [5, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000004.pt", "ckpt-000000004.pt.ok", "ckpt-000000005.pt", "ckpt-000000005.pt.ok"]


def test_the_checkpoint_just_written_is_never_pruned_even_below_older_higher_steps(tmp_path):
    mgr = CheckpointStore(tmp_path, keep_last=2)
    for step in (900, 1000):
        mgr.save(state(step), step)
    mgr.save(state(8), 8)
    assert [s for s, _ in mgr.complete()] == [1000, 8]


def test_truncated_checkpoint_is_skipped_never_loaded(tmp_path):
    mgr = CheckpointStore(tmp_path)
    mgr.save(state(1), 1)
    newest = mgr.save(state(2), 2)
    with open(newest, "r+b") as handle:
        handle.truncate(newest.stat().st_size // 2)
    assert mgr.latest().name == "ckpt-000000001.pt"


def test_corrupted_bytes_of_the_same_size_are_detected(tmp_path):
    mgr = CheckpointStore(tmp_path)
    mgr.save(state(1), 1)
    newest = mgr.save(state(2), 2)
    data = bytearray(newest.read_bytes())
    data[-20] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert mgr.latest().name == "ckpt-000000001.pt"


def test_a_checkpoint_without_its_marker_does_not_count(tmp_path):
    mgr = CheckpointStore(tmp_path)
    mgr.save(state(1), 1)
    torch.save(state(2), tmp_path / "ckpt-000000002.pt")  # written, but never marked complete
    assert mgr.latest().name == "ckpt-000000001.pt"


def test_loading_refuses_arbitrary_pickled_objects(tmp_path):
    mgr = CheckpointStore(tmp_path)
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
    checkpoint.CheckpointStore(sys.argv[1]).save({"step": 2, "weights": torch.ones(100000)}, 2)
""")


def test_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    mgr = CheckpointStore(tmp_path)
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
    mgr = CheckpointStore(tiny_volume, keep_last=3)
    mgr.save({"weights": torch.zeros(1000)}, 1)
    with pytest.raises(CheckpointError, match="no space left on the device; the previous checkpoint ckpt-000000001.pt is intact"):
        mgr.save({"weights": torch.zeros(1_000_000)}, 2)  # 4 MB into a 2 MB volume
    assert mgr.latest().name == "ckpt-000000001.pt"
    assert not [p for p in tiny_volume.iterdir() if "000000002" in p.name]


# --- a marked checkpoint that does not load --------------------------------------------------------

class NotAllowedByWeightsOnly:
    """Any class of the writer's: torch.save pickles it, torch.load(weights_only=True) refuses it."""


def remark(path) -> None:
    """Rewrites the marker so that it matches the file as it now is (a forged or miswritten marker)."""
    data = path.read_bytes()
    (path.parent / (path.name + ".ok")).write_text(json.dumps({"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


def refused_by_weights_only(path):
    torch.save({"obj": NotAllowedByWeightsOnly()}, path)
    remark(path)


def truncated_with_a_matching_marker(path):
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)
    remark(path)


def marker_mismatch(path):
    with open(path, "ab") as handle:
        handle.write(b"more")


@pytest.mark.parametrize("breaks, reason", [
    (refused_by_weights_only, "refused by torch.load(weights_only=True): Unsupported global"),
    (truncated_with_a_matching_marker, "does not load: "),
    (marker_mismatch, "bytes, its marker records"),
])
def test_an_unloadable_newest_checkpoint_is_skipped_named_and_the_previous_loaded(tmp_path, breaks, reason):
    """A checkpoint marked newest that does not load is skipped and named, and the previous one loaded."""
    mgr = CheckpointStore(tmp_path, keep_last=5)
    mgr.save(state(32), 32)
    newest = mgr.save(state(40), 40)
    breaks(newest)
    fresh = CheckpointStore(tmp_path, keep_last=5)  # the relaunched process: it knows nothing yet
    assert fresh.latest().name == "ckpt-000000032.pt"
    found = fresh.resume_point()
    assert found.path.name == "ckpt-000000032.pt" and found.state["step"] == 32
    (skipped,) = found.skipped
    assert skipped.name == "ckpt-000000040.pt" and reason in skipped.reason
    assert "\n" not in skipped.reason and len(skipped.reason) <= 200
    # set aside under a name that no longer counts: the next relaunch does not meet it again
    assert skipped.aside == "ckpt-000000040.pt.bad" and (tmp_path / skipped.aside).exists()
    assert [s for s, _ in fresh.complete()] == [32]
    assert CheckpointStore(tmp_path).resume_point().skipped == []


def test_with_no_loadable_checkpoint_resuming_starts_afresh_naming_every_one_skipped(tmp_path, capsys):
    """With no checkpoint that loads, resuming starts afresh and names every one skipped."""
    mgr = CheckpointStore(tmp_path)
    for path in [mgr.save(state(step), step) for step in (8, 16)]:
        truncated_with_a_matching_marker(path)
    found = CheckpointStore(tmp_path).resume_point()
    assert found.path is None and found.state is None
    assert [s.name for s in found.skipped] == ["ckpt-000000016.pt", "ckpt-000000008.pt"]

    say_skipped(found)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2 and all(line.endswith("; no loadable checkpoint left: starting from step 0") for line in said)
    assert said[0].startswith("trainer: skipping ckpt-000000016.pt (renamed to ckpt-000000016.pt.bad): does not load: ")


def test_a_skip_reason_from_a_hostile_file_is_one_printable_line(tmp_path):
    mgr = CheckpointStore(tmp_path)
    mgr.save(state(1), 1)
    newest = mgr.path_for(2)
    # a raw pickle whose global's name carries terminal escapes (a colour, a window title, a bell)
    newest.write_bytes(b"\x80\x02c\x1b[31mos\nsys\x1b]0;pwn\x07tem" + b"x" * 1000 + b"\n)\x81.")
    remark(newest)
    (skipped,) = CheckpointStore(tmp_path).resume_point().skipped
    assert skipped.reason.isprintable() and "\x1b" not in skipped.reason and len(skipped.reason) <= 200
    assert "Unsupported global" in skipped.reason


def test_pruning_keeps_the_newest_loadable_checkpoint_when_the_newest_is_broken(tmp_path):
    mgr = CheckpointStore(tmp_path, keep_last=5)
    mgr.save(state(32), 32)
    refused_by_weights_only(mgr.save(state(40), 40))
    fresh = CheckpointStore(tmp_path, keep_last=1)
    fresh.prune()
    assert fresh.load(fresh.latest())["step"] == 32
    assert (tmp_path / "ckpt-000000040.pt.bad").exists()


def test_broken_checkpoints_do_not_count_towards_keep_last_when_a_save_prunes(tmp_path):
    mgr = CheckpointStore(tmp_path, keep_last=5)
    for step in (24, 32):
        mgr.save(state(step), step)
    truncated_with_a_matching_marker(mgr.save(state(40), 40))
    fresh = CheckpointStore(tmp_path, keep_last=2)
    fresh.save(state(48), 48)
    assert [s for s, _ in fresh.complete()] == [48, 32]
    assert all(fresh.load(p)["step"] == s for s, p in fresh.complete())


@pytest.mark.e2e
def test_a_relaunch_resumes_past_a_broken_newest_checkpoint_and_finishes(torch_python, tmp_path):
    flags = [*SMALL, "--synthetic-size", "256", "--ckpt-every", "4"]  # 1 process: 16 steps an epoch
    first = run_torchrun(torch_python.python, tmp_path, *flags, "--epochs", "1", nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    assert [p.name for p in sorted(ckpt.glob("ckpt-*.pt"))][-2:] == ["ckpt-000000012.pt", "ckpt-000000016.pt"]
    refused_by_weights_only(ckpt / "ckpt-000000016.pt")
    again = run_torchrun(torch_python.python, tmp_path, *flags, nproc=1)  # 2 epochs: 16 steps more
    assert again.returncode == 0, again.stderr[-3000:]
    # the worker's line, wherever the launcher passes it on (with its rank in front when it tees)
    said = set(re.findall(r"trainer: skipping .*", again.stderr + again.stdout))
    (line,) = said
    assert line.startswith("trainer: skipping ckpt-000000016.pt (renamed to ckpt-000000016.pt.bad): "
                           "refused by torch.load(weights_only=True): Unsupported global")
    assert line.endswith("; resuming from ckpt-000000012.pt")
    records = metrics(ckpt)
    assert [r["checkpoint"] for r in records if r["kind"] == "resumed"] == ["ckpt-000000012.pt"]
    assert records[-1]["kind"] == "final" and records[-1]["step"] == 32
    assert (ckpt / "ckpt-000000016.pt.bad").exists()
