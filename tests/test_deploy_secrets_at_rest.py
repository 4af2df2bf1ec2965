"""Secrets at rest: what a program prints of a secret is masked on the node, before any log holds
it (the run's log on the shared volume, Docker's, Slurm's), and torch's own per-worker log
folders go with the run."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from local_job import beats_dir, local_hosts
from procs import alive, descendants_of, kill
from test_deploy_local import LONG_ARGS, _records, _wait_for
from torch_ends import torch_python  # noqa: F401  (the fixture: the tested points of the torch range)
from agent import launch
from waiting import wait_until

REPO = Path(__file__).resolve().parents[1]

SECRET = 's3cr"et\\-välue-7f3a'
SPELLINGS = {"as is": SECRET, "json.dumps": json.dumps(SECRET)[1:-1], "repr": repr(SECRET)[1:-1]}

LEAK = """
import json, os, sys
value = os.environ["API_TOKEN"]
print("plain:", value, flush=True)
print("METRICS " + json.dumps({"kind": "train", "epoch": 0, "step": 1, "loss": 1.0, "token": value}), flush=True)
print("repr:", repr({"token": value}), file=sys.stderr, flush=True)
"""


def _files_holding(root: Path, text: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and text.encode() in p.read_bytes()]


def _job(tmp_path: Path, monkeypatch, train: dict) -> Path:
    """A one-node host-runtime job here with the secret API_TOKEN, its TMPDIR its own (the
    launcher's torch log folders, apart from other tests')."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))
    monkeypatch.setenv("TEST_API_TOKEN", SECRET)
    return local_hosts(tmp_path, job="atrest", train={"secrets": {"API_TOKEN": {"env": "TEST_API_TOKEN"}}, **train})



def _torch_folders(tmp_path: Path) -> list[str]:
    """torch's own (torchelastic_*) and the launcher's (launch.TORCH_LOG_PREFIX)."""
    return [p.name for p in (tmp_path / "tmp").iterdir()
            if "torchelastic" in p.name or p.name.startswith(launch.TORCH_LOG_PREFIX)]


@pytest.mark.e2e
def test_a_printed_secret_is_masked_in_every_file_the_run_leaves(ddp, tmp_path, monkeypatch):
    project = tmp_path / "leaky"
    project.mkdir()
    (project / "leak.py").write_text(LEAK)
    hosts = _job(tmp_path, monkeypatch, {"script": "leak.py", "code": str(project)})
    launched = ddp(hosts, "launch", "--wait", "--timeout", "240")
    assert launched.exit_code == 0, launched.output

    logs = ddp(hosts, "logs").stdout
    assert "plain: ***" in logs and "repr: {'token': '***'}" in logs and '"token": "***"' in logs, logs
    kept = list((tmp_path / "nas/ckpt/.ddp-deploy/atrest/runs").glob("*/here/log"))
    assert len(kept) == 1 and "plain: ***" in kept[0].read_text()
    for how, spelt in SPELLINGS.items():
        assert spelt not in logs, how
        assert not _files_holding(tmp_path, spelt), how  # the kept log, records, the debug log, torch's folders
    assert not _torch_folders(tmp_path)


PRINTS_AND_WAITS = LEAK + """
open(os.path.join(os.environ["DDP_CKPT_DIR"], "printed"), "w").close()
import time
time.sleep(600)
"""


def _leaks(tmp_path: Path, *more: Path) -> dict[str, list[Path]]:
    """The files under ``tmp_path`` (TMPDIR, the shared volume with the run's log, the debug log)
    and ``more`` that hold the secret in one of its spellings."""
    found = {how: [f for root in (tmp_path, *more) if root.exists() for f in _files_holding(root, spelt)]
             for how, spelt in SPELLINGS.items()}
    return {how: files for how, files in found.items() if files}


@pytest.mark.e2e
@pytest.mark.parametrize("prefork", ["1", "0"], ids=["forked workers", "torchrun's own start"])
def test_a_printed_secret_rests_in_no_file_while_running_nor_after_stop_now(ddp,
        tmp_path, monkeypatch, prefork):
    """Every file the launcher, torchrun and the workers write on the node (TMPDIR, the run's log,
    the heartbeats), while the job runs, and once ``stop --now`` has SIGKILLed it all, holds no spelling
    of the value; the output still shows the line, masked, behind the worker's rank."""
    project = tmp_path / "leaky"
    project.mkdir()
    (project / "leak.py").write_text(PRINTS_AND_WAITS)
    hosts = _job(tmp_path, monkeypatch, {"script": "leak.py", "code": str(project), "env": {"DDP_PREFORK": prefork}})
    assert ddp(hosts, "launch").exit_code == 0
    beats = Path(beats_dir(hosts))
    try:
        _wait_for(lambda: (tmp_path / "nas/ckpt/printed").exists(), "the program to print the secret")
        _wait_for(lambda: "[rank0]: repr: {'token': '***'}" in _kept_log(tmp_path), "the lines in the run's log")
        assert not _leaks(tmp_path, beats)
    finally:
        stopped = ddp(hosts, "stop", "--now")
    assert stopped.exit_code == 0, stopped.output
    assert "[rank0]: plain: ***" in _kept_log(tmp_path)
    assert not _leaks(tmp_path, beats)


def _kept_log(tmp_path: Path) -> str:
    """The node's log kept with the run on the shared volume, as the launcher wrote it."""
    kept = list((tmp_path / "nas/ckpt/.ddp-deploy/atrest/runs").glob("*/here/log"))
    return kept[0].read_text() if kept else ""


RECORDED_FAILURE = """
import os, sys, time
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    value = os.environ["API_TOKEN"]
    print("plain:", value, flush=True)
    print("repr:", repr({"token": value}), file=sys.stderr, flush=True)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("refused the token " + value)  # torch's error file would hold it
    open(sys.argv[1], "w").close()
    time.sleep(600)


main()
"""


@pytest.mark.e2e
def test_a_secret_in_a_recorded_error_rests_in_no_file_after_a_restart_or_a_kill(
        tmp_path, torch_python):
    """The launcher as a node runs it with secrets (its tee, torchrun its child): a worker prints the
    value and fails with it in torch's recorded error; torchrun starts it again. Neither during
    that attempt, nor once the launcher has been SIGKILLed alone (its torchrun running on), nor once
    everything is, does a file in TMPDIR or the run's log hold it."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "prog.py").write_text(RECORDED_FAILURE)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "API_TOKEN": SECRET, "DDP_SECRET_NAMES": "API_TOKEN",
           "DDP_DEPLOY_LOG_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("DDP_PREFORK", None)
    started = tmp_path / "second attempt"
    launcher = subprocess.Popen(
        [torch_python.python, "-m", "agent.launch", "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
         "--script", str(tmp_path / "prog.py"), "--", str(started)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    everything: list[int] = []
    try:
        wait_until(lambda: started.exists() or launcher.poll() is not None, 240, "the second attempt", interval=0.05)
        assert launcher.poll() is None, (tmp_path / "run/log").read_text()
        everything = descendants_of(launcher.pid)  # its torchrun, the zygote, the worker
        wait_until(lambda: (tmp_path / "run/log").read_text().count("[rank0]: repr: {'token': '***'}") == 2, 60,
                   "the second attempt's lines in the run's log", interval=0.05)
        assert not _leaks(tmp_path), (tmp_path / "run/log").read_text()
        launcher.send_signal(signal.SIGKILL)  # the launcher alone: its torchrun, in a session of its own, runs on
        launcher.wait(timeout=60)
        assert any(alive(p) for p in everything)
        assert not _leaks(tmp_path)
    finally:
        launcher.kill()
        kill(everything[::-1])
        launcher.wait(timeout=60)
    wait_until(lambda: not any(alive(p) for p in everything), 60, "the job to end", interval=0.05)
    log = (tmp_path / "run/log").read_text()
    assert "[rank0]: plain: ***" in log and "RuntimeError: refused the token ***" in log, log
    assert not _leaks(tmp_path)

@pytest.mark.e2e
def test_a_job_with_secrets_checkpoints_when_stopped_and_leaves_no_torch_folder(ddp, tmp_path, monkeypatch):
    hosts = _job(tmp_path, monkeypatch, {"args": LONG_ARGS})
    assert ddp(hosts, "launch").exit_code == 0
    _wait_for(lambda: any(r["kind"] == "train" and r["step"] >= 3 for r in _records(tmp_path)), "step 3")
    assert not _torch_folders(tmp_path)  # while it runs: torch writes no file of a worker's
    stopped = ddp(hosts, "stop")
    assert stopped.exit_code == 0 and "trainer: stopped by SIGTERM at step" in stopped.stdout, stopped.output
    assert _records(tmp_path)[-1]["kind"] == "stopped"
    assert not _torch_folders(tmp_path)


def _teed(tmp_path: Path, script: str, names: str, env: dict[str, str]) -> tuple[int, str]:
    """The launcher's tee (run_teed) with the mask main() gives it, around ``python -c script``."""
    code = ("import sys; from agent.launch import run_teed; from agent.masking import Mask; "
            f"sys.exit(run_teed({str(tmp_path)!r}, [sys.executable, '-c', {script!r}], Mask.from_environ({names!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    return proc.returncode, proc.stdout


def test_the_launchers_output_and_its_copy_in_the_run_log_are_masked_as_printed(tmp_path):
    script = ("import json, os, sys; v = os.environ['TOKEN']; print('a', v); print(json.dumps([v]), file=sys.stderr); "
              "sys.stdout.write('no newline at the end ' + repr(v)); sys.exit(4)")
    rc, out = _teed(tmp_path, script, "TOKEN", {"TOKEN": SECRET})
    log = (tmp_path / "log").read_text()
    assert rc == 4 and out == log
    assert log.splitlines() == ["a ***", '["***"]', "no newline at the end '***'"]


def test_torchs_log_folder_is_removed_at_the_end_or_by_the_next_launcher(
        tmp_path, monkeypatch):
    """A launcher holds its folder's lock while it runs; one killed (kill -9, in a process of its
    own here) holds nothing, and the next launcher removes its folder but not a running one's, nor
    an earlier version's (``ddp-torchelastic-*``: it held none, so it may run still)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = ["--tee", "3", "--nnodes", "1", "--", "--epochs", "1"]
    killed = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, tempfile; tempfile.tempdir = sys.argv[1]\n"
         "from agent import launch\nwith launch.torch_log_dir(['--tee', '3', '--', 'x']) as d:\n"
         "    open(os.path.join(d[1], 'stdout.log'), 'w').write(sys.argv[2])\n    print(d[1], flush=True)\n"
         "    sys.stdin.readline()\n", str(tmp_path), SECRET],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    left = Path(killed.stdout.readline().strip())
    assert (left / "stdout.log").read_text() == SECRET
    earlier = tmp_path / "ddp-torchelastic-0123456789abcdef-x1y2"
    earlier.mkdir()
    with launch.torch_log_dir(args) as other:  # a launcher running beside the killed one
        assert left.exists()  # its launcher runs: kept
        killed.kill()
        killed.wait(timeout=60)
        Path(other[1], "stdout.log").write_text("another job's, running")
        with launch.torch_log_dir(args) as mine:
            assert mine[0] == "--log-dir" and not left.exists()
            assert Path(other[1], "stdout.log").exists() and earlier.exists()
        assert not Path(mine[1]).exists()
    assert list(tmp_path.iterdir()) == [earlier]
    with launch.torch_log_dir(["--log-dir", "/var/log/mine", "--", "x"]) as given:
        assert given == []  # the operator's own choice, left to them
    for relayed in (["--nnodes", "1", "--", "x"], ["--epochs", "1"]):
        with launch.torch_log_dir(relayed) as nothing:
            assert nothing == ["--log-dir", os.devnull] and nothing.held is None  # torch writes no file
    assert list(tmp_path.iterdir()) == [earlier]


def test_a_launcher_killed_alone_leaves_its_folder_to_its_torchrun_until_it_ends(
        tmp_path, monkeypatch):
    """A launcher that copies its job's output (the run's log) runs torchrun as its child, in a
    session of its own; killed alone (kill -9), its child runs on and writes into the folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    child = ("import os, sys, time\nprint(os.getpid(), flush=True)\n"
             "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n")
    teed = subprocess.Popen(
        [sys.executable, "-c", "import sys, tempfile; tempfile.tempdir = sys.argv[1]\n"
         "from agent import launch\nwith launch.torch_log_dir(['--tee', '3', '--', 'x']) as d:\n    print(d[1], flush=True)\n"
         "    launch.run_teed(None, [sys.executable, '-c', sys.argv[2], sys.argv[3]], keep=(d.held,))\n",
         str(tmp_path / "tmp"), child, str(tmp_path / "end")],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    folder, torchrun = Path(teed.stdout.readline().strip()), int(teed.stdout.readline())
    teed.kill()
    teed.wait(timeout=60)
    try:
        launch._remove_unheld(str(tmp_path / "tmp"))
        assert folder.is_dir()  # its torchrun runs: kept
    finally:
        (tmp_path / "end").touch()
    wait_until(lambda: not alive(torchrun), 30, "the child to end", interval=0.05)
    launch._remove_unheld(str(tmp_path / "tmp"))
    assert not folder.exists()


@pytest.mark.parametrize("when", ["before its maker opened it", "before its maker locked it"])
def test_a_log_folder_removed_before_its_maker_held_it_is_made_again_and_held(
        tmp_path, monkeypatch, when):
    """Between its making and its lock a folder is nobody's: another launcher starting then may
    remove it (here: one sweeps at that moment, once)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made: list[str] = []
    mkdtemp, flock = tempfile.mkdtemp, fcntl.flock

    def another_sweeps() -> None:
        if len(made) == 1:
            launch._remove_unheld(str(tmp_path))

    def mkdtemp_then(*args, **kwargs):
        made.append(mkdtemp(*args, **kwargs))
        if when == "before its maker opened it":
            another_sweeps()
        return made[-1]

    def flock_after(fd, operation):
        if operation == fcntl.LOCK_EX and when == "before its maker locked it":
            another_sweeps()
        return flock(fd, operation)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then)
    monkeypatch.setattr(launch.fcntl, "flock", flock_after)
    with launch.torch_log_dir(["--tee", "3", "--", "x"]) as mine:
        assert len(made) == 2 and not os.path.exists(made[0]) and mine == ["--log-dir", made[1]]
        launch._remove_unheld(str(tmp_path))  # held now: kept
        assert os.path.isdir(made[1])
    assert list(tmp_path.iterdir()) == []
