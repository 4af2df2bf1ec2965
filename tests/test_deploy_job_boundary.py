"""The node programs that root runs in the docker runtime's checkpoint directory, run by a real sh
as root on real directories where a job (uid 1000) has planted links and replaced directories:
nothing outside the job's own directories is written, chowned or shown. The whole path on the
cluster, every verb against a job planting everywhere: tests/cluster/test_job_boundary.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from local_job import on_paper
from deploy.job import plan, runs
from deploy.job.runtime import RUN_SUBDIR, runtime
from deploy.job.scripts import RECORD_STOP

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="root hands directories to uid 1000 and reads as it (setpriv)")

JOB_UID = 1000
SECRET = "314159265358979 271828182845904"


@pytest.fixture
def volume():
    """A shared volume uid 1000 can reach (pytest's own directories are root's alone), with a
    root-only canary beside it that every planted link points at."""
    top = Path(tempfile.mkdtemp(prefix="ddp-boundary-", dir="/var/tmp"))
    top.chmod(0o755)
    canary = top / "canary"
    canary.mkdir(mode=0o700)
    (canary / "secret").write_text(SECRET + "\n")
    (canary / "secret").chmod(0o600)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def _inv(top: Path, keep: int = 2):
    return on_paper([{"name": "a", "address": "198.18.0.11"}], job="demo", nas=top, job_fields={"keep_runs": keep})


def _sh(argv, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), input=stdin, capture_output=True)


def _as_job(*argv: str) -> None:
    """What the job can do: ``argv`` as uid 1000."""
    subprocess.run(["setpriv", f"--reuid={JOB_UID}", f"--regid={JOB_UID}", "--clear-groups", "--", *argv], check=True)


def _canary(top: Path) -> tuple:
    st = (top / "canary" / "secret").stat()
    return (top / "canary" / "secret").read_text(), st.st_uid, st.st_mode, (top / "canary").stat().st_uid


def _deployed(top: Path):
    inv = _inv(top)
    made = _sh(plan.make_dirs_argv(inv))
    assert made.returncode == 0, made.stderr
    return inv


def _started(volume: Path):
    """A run started on a deployed volume, and node a's directory of it, the job's."""
    inv = _deployed(volume)
    run = runs.new_id()
    assert _sh(runs.start_argv(inv, run), b"{}").returncode == 0
    mine = volume / "ckpt" / RUN_SUBDIR / "demo" / "runs" / run / "a"
    mine.mkdir()
    os.chown(mine, JOB_UID, JOB_UID)
    return inv, run, mine


def test_deploy_leaves_the_checkpoint_directory_roots_sticky_and_the_jobs_to_write(volume):
    _deployed(volume)
    ckpt, data = (volume / "ckpt").stat(), (volume / "data").stat()
    assert (ckpt.st_uid, ckpt.st_gid, oct(ckpt.st_mode & 0o7777)) == (0, JOB_UID, "0o1775")
    assert (data.st_uid, data.st_gid) == (JOB_UID, JOB_UID)
    _as_job("touch", str(volume / "ckpt" / "model.pt"))  # the job writes its own files there
    _as_job("mv", str(volume / "ckpt" / "model.pt"), str(volume / "ckpt" / "model2.pt"))


def test_a_run_starts_only_in_the_tools_own_directories_and_a_renamed_one_is_refused(volume):
    """A run starts nowhere but in the tool's own directories, and a renamed one is refused."""
    inv = _deployed(volume)
    first = runs.new_id()
    assert _sh(runs.start_argv(inv, first), b"{}").returncode == 0
    tool = volume / "ckpt" / RUN_SUBDIR
    with pytest.raises(subprocess.CalledProcessError):  # sticky: the job cannot move it away
        _as_job("mv", str(tool), str(volume / "ckpt" / "moved"))
    # A layout a job took over before (the checkpoint directory was once the job's): its own
    # .ddp-deploy with links where the records go.
    shutil.move(tool, volume / "ckpt" / "old")
    _as_job("mkdir", "-p", str(tool / "demo" / "runs"))
    _as_job("ln", "-s", str(volume / "canary" / "secret"), str(tool / "demo" / "launch.json.tmp"))
    before = _canary(volume)
    again = _sh(runs.start_argv(inv, runs.new_id()), b'{"run": "x"}')
    assert again.returncode != 0 and f"{tool} is not this tool's own directory" in again.stderr.decode()
    assert _canary(volume) == before


def test_the_node_directory_of_a_run_is_handed_to_the_job_only_inside_the_tools_own(volume):
    inv = _deployed(volume)
    run = runs.new_id()
    node = inv.node("a")
    start = runtime(inv, run=run).start_argv(node, ["--"], (), plan.NodeFacts())
    prefix = start[:start.index("docker")]  # the step that makes the directory, then a harmless command
    made = _sh([*prefix, "true"])
    assert made.returncode == 0, made.stderr
    mine = volume / "ckpt" / RUN_SUBDIR / "demo" / "runs" / run / "a"
    assert mine.stat().st_uid == JOB_UID and (mine.parent.stat().st_uid, mine.parent.stat().st_mode & 0o022) == (0, 0)
    # the job cannot put a link where the next node's directory will be made
    with pytest.raises(subprocess.CalledProcessError):
        _as_job("ln", "-s", str(volume / "canary"), str(mine.parent / "b"))


def test_a_stop_is_recorded_beside_the_jobs_directory_never_through_a_link_in_it(volume):
    inv, run, mine = _started(volume)
    for name in ("stopped", "stopped.tmp"):
        _as_job("ln", "-s", str(volume / "canary" / "secret"), str(mine / name))
    before = _canary(volume)
    said = _sh(["sh", "-c", RECORD_STOP + 'record_stop "$@"', "sh", str(mine), "node", "graceful", "me@op", "1700000000"],
               b"[rank0]: stopped by SIGTERM at step 7\n")
    assert said.returncode == 0 and "not recorded" not in said.stdout.decode()
    assert _canary(volume) == before
    kept = mine.parent / "a.stopped"
    assert kept.read_text() == "1700000000 node graceful 7 me@op\n" and kept.stat().st_uid == 0


def test_what_the_job_wrote_is_read_with_its_rights_so_a_link_shows_nothing_of_roots(volume):
    inv, run, mine = _started(volume)
    for name in ("log", "exits", "stalls"):
        _as_job("ln", "-s", str(volume / "canary" / "secret"), str(mine / name))
    _as_job("ln", "-s", str(volume / "canary" / "secret"), str(volume / "ckpt" / "metrics.jsonl"))
    shown = [_sh(runs.log_argv(inv, run, "a", tail=None, follow=False)), _sh(runs.list_argv(inv))]
    from deploy.observe import plot
    shown += [_sh(plot.sources_argv(inv)), _sh(plot.log_metrics_argv(inv, [run]))]
    for out in shown:
        assert SECRET.split()[0] not in out.stdout.decode() + out.stderr.decode()
    listed = runs.parse(shown[1].stdout.decode())
    assert [r.id for r in listed] == [run]  # the tool's own records are still read


def test_a_pruned_run_s_tensorboard_files_are_removed_as_the_job_not_as_root(volume):
    """A pruned run's TensorBoard files are removed as the job, so a link removes nothing of root's."""
    inv = _inv(volume, keep=1)
    _sh(plan.make_dirs_argv(inv))
    first = runs.new_id(1_700_000_000)
    assert _sh(runs.start_argv(inv, first), b"{}").returncode == 0
    precious = volume / "canary" / first
    precious.mkdir()
    (precious / "kept").write_text("kept\n")
    _as_job("ln", "-s", str(volume / "canary"), str(volume / "ckpt" / "tensorboard"))
    second = _sh(runs.start_argv(inv, runs.new_id(1_700_000_100)), b"{}")
    assert second.returncode == 0, second.stderr
    assert (precious / "kept").read_text() == "kept\n"
    assert not (volume / "ckpt" / RUN_SUBDIR / "demo" / "runs" / first).exists()


def test_a_jobs_exits_file_is_read_bounded_and_forges_no_stop_node_or_run(volume):
    inv = _inv(volume)
    run = runs.new_id()
    base = Path(runs.runs_dir(inv)) / run
    (base / "a").mkdir(parents=True)
    (base / "run.json").write_text("{}")
    with open(base / "a" / "exits", "w") as f:
        f.write("1700000000.5 1\n@@stopped 1700000001 node graceful 40 root@op\n@@node forged\n@@run 20990101-000000-beef\n")
        f.truncate(1 << 30)  # a gigabyte of nothing after it (sparse): read no further than the end
        f.seek(0, 2)
        f.write("\n1700000002.5 137\n")
    listed = _sh(runs.list_argv(inv))
    assert len(listed.stdout) < 1 << 17
    (found,) = runs.parse(listed.stdout.decode())
    assert list(found.nodes) == ["a"] and found.nodes["a"].stopped is None
    assert found.nodes["a"].exits[-1] == (1700000002.5, 137)


def test_a_start_refuses_run_directories_the_job_took_over_and_chowns_nothing_there(volume):
    """A start refuses run directories the job took over, and chowns nothing through them."""
    inv = _deployed(volume)
    run = runs.new_id()
    tool = volume / "ckpt" / RUN_SUBDIR
    target = volume / "canary"
    _as_job("mkdir", "-p", str(tool / "demo" / "runs" / run))  # the layout a job could make where it owned the volume
    _as_job("ln", "-s", str(target), str(tool / "demo" / "runs" / run / "a"))
    start = runtime(inv, run=run).start_argv(inv.node("a"), ["--"], (), plan.NodeFacts())
    made = _sh([*start[:start.index("docker")], "true"])
    assert made.returncode != 0 and "is not this tool's own directory" in made.stderr.decode()
    assert (target.stat().st_uid, target.stat().st_mode & 0o7777) == (0, 0o700)


def test_a_stall_the_job_linked_to_a_root_file_shows_nothing_of_it_in_status(volume):
    mine = volume / "ckpt" / "node"
    _deployed(volume)
    _as_job("mkdir", str(mine))
    _as_job("ln", "-s", str(volume / "canary" / "secret"), str(mine / "stalls"))
    from deploy.job.scripts import AS_JOB_LIB, LAST_STALL
    said = _sh(["sh", "-c", AS_JOB_LIB + LAST_STALL + f'job_uid={JOB_UID}; last_stall "$1"', "sh", str(mine)])
    assert said.returncode == 0 and SECRET.split()[0] not in said.stdout.decode()
