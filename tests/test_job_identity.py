"""A process is taken for one of the job's by what the kernel says of it, never by its environment
alone: it runs with the job's uid, and (for the discovery `doctor` and the launcher's watchdog use)
it descends from the job's launcher. Another user's process that sets the job's
``DDP_HEARTBEAT_DIR`` or ``DDP_DEPLOY_RUN`` is never listed, signalled or killed; nor is a process of
the same user outside the launcher's tree. The node programs run for real in sh."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import contract
from deploy.job import scripts
from deploy.observe import doctor
from procs import alive, descendants_of, parent_of
from agent import heartbeat
from agent.heartbeat.procs import _one_uid
from waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a process of another uid needs root to start")


def _started(proc_pid: int, marker: str) -> int:
    """``proc_pid`` once it has exec'd with ``marker`` in its environment (before, /proc shows its parent's)."""
    wait_until(lambda: marker.encode() in _environ(proc_pid), 10, f"process {proc_pid} to start", interval=0.02)
    return proc_pid


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


class Processes:
    """Sleepers with a given environment: this test's children, another user's, or orphans (their parent
    gone, init or a subreaper above this test has them). Every one is killed at the end."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []
        self.orphans: list[int] = []

    def child(self, env: dict[str, str], marker: str, **user) -> int:
        proc = subprocess.Popen(["sleep", "120"], env={"PATH": os.environ["PATH"], **env}, **user)
        self.children.append(proc)
        return _started(proc.pid, marker)

    def other_user(self, env: dict[str, str], marker: str) -> int:
        pid = self.child(env, marker, user=NOBODY, group=NOBODY, extra_groups=[])
        assert Path(f"/proc/{pid}/status").read_text().count(f"\t{NOBODY}") >= 8  # its uids and gids
        return pid

    def orphan(self, env: dict[str, str], marker: str, argv: tuple[str, ...] = ("sleep", "120"), cwd=None) -> int:
        """A process of this user whose parent has ended: it is no descendant of this test's."""
        said = subprocess.run(["sh", "-c", '"$@" > /dev/null 2>&1 < /dev/null & echo $!', "sh", *argv],
                              env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, check=True,
                              cwd=cwd, timeout=30)
        pid = int(said.stdout)
        self.orphans.append(pid)
        _started(pid, marker)
        assert pid not in descendants_of(os.getpid())
        return pid

    def close(self) -> None:
        for proc in self.children:
            proc.kill()
            proc.wait()
        for pid in self.orphans:
            for each in [*descendants_of(pid), pid]:
                try:
                    os.kill(each, signal.SIGKILL)
                except OSError:
                    pass


@pytest.fixture
def procs():
    made = Processes()
    yield made
    made.close()


def _rank_env(beats: Path, local: int) -> dict[str, str]:
    return {contract.HEARTBEAT_DIR_ENV: str(beats), "LOCAL_RANK": str(local), "RANK": str(local)}


def _diagnose(beats: Path) -> str:
    got = subprocess.run(["sh", "-c", contract.program("diagnose"), "sh", str(beats), "/bin/true"], capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    return got.stdout


# --- what doctor lists (contract.program("diagnose")) and the watchdog takes (heartbeat.workers) --------------

@needs_root
def test_doctor_lists_no_other_user_s_process_nor_one_outside_the_launcher_s_tree(tmp_path, procs):
    """Doctor lists no process of another user, nor one outside the launcher's tree that carries the job's
    environment."""
    beats = tmp_path / "beats"
    beats.mkdir()
    marker = f"{contract.HEARTBEAT_DIR_ENV}={beats}"
    worker = procs.child(_rank_env(beats, 0), marker)  # this test's child: what runs the script is its launcher
    stranger = procs.other_user(_rank_env(beats, 1), marker)
    outside = procs.orphan(_rank_env(beats, 2), marker)
    # a forked worker's environment is the launcher's (no LOCAL_RANK): named by the zygote in workers/
    (beats / contract.WORKERS_DIR).mkdir()
    named_stranger = procs.other_user({contract.HEARTBEAT_DIR_ENV: str(beats)}, marker)
    named_outside = procs.orphan({contract.HEARTBEAT_DIR_ENV: str(beats)}, marker)
    (beats / contract.WORKERS_DIR / "3").write_text(f"{named_stranger} 3\n")
    (beats / contract.WORKERS_DIR / "4").write_text(f"{named_outside} 4\n")

    found = _diagnose(beats)
    assert [(r.pid, r.rank) for r in doctor.parse("node1", found)] == [(worker, 0)], found
    assert "workers 1" in found.splitlines()
    assert heartbeat.workers(str(beats)) == [worker]
    assert heartbeat.ranked(str(beats)) == {0: worker}
    assert all(alive(pid) for pid in (stranger, outside, named_stranger, named_outside))


def test_doctor_finds_the_workers_of_the_directory_s_launcher_and_no_one_else_s(tmp_path, procs):
    """Doctor finds the workers of the launcher named in the directory, and no one else's."""
    beats = tmp_path / "beats"
    marker = f"{contract.HEARTBEAT_DIR_ENV}={beats}"
    said = tmp_path / "worker"
    # a launcher that is no descendant of this test (the host runtime's is started detached): it
    # makes the directory, named in it, and starts one worker
    program = ("import subprocess, sys, time\n"
               "from agent import heartbeat\n"
               "assert heartbeat.prepare(sys.argv[1]) == sys.argv[1]\n"
               "w = subprocess.Popen(['sleep', '120'], env={'PATH': '/usr/bin:/bin', 'DDP_HEARTBEAT_DIR': sys.argv[1],"
               " 'LOCAL_RANK': '0', 'RANK': '5'})\n"
               "open(sys.argv[2], 'w').write(str(w.pid))\n"
               "time.sleep(120)\n")
    launcher = procs.orphan({contract.HEARTBEAT_DIR_ENV: str(beats), "PYTHONPATH": str(ROOT)}, marker,
                            (sys.executable, "-c", program, str(beats), str(said)), cwd=tmp_path)
    wait_until(lambda: said.exists() and said.read_text(), 30, "the launcher's worker", interval=0.05)
    worker = _started(int(said.read_text()), marker)
    assert parent_of(worker) == launcher
    impostor = procs.orphan(_rank_env(beats, 1), marker)  # this user's, the job's environment, another tree

    found = _diagnose(beats)
    assert [(r.pid, r.rank, r.local_rank) for r in doctor.parse("node1", found)] == [(worker, 5, 0)], found
    assert heartbeat.ranked(str(beats)) == {0: worker}
    assert alive(impostor)
    words = (beats / "launcher").read_text().split()  # its pid and its start (/proc/PID/stat's 22nd field)
    assert words == [str(launcher), Path(f"/proc/{launcher}/stat").read_text().rsplit(")", 1)[1].split()[19]]

    # the launcher named is that process while it runs: a pid it no longer holds names no one
    (beats / "launcher").write_text(f"{launcher} {int(words[1]) + 1}\n")
    assert "workers 0" in _diagnose(beats).splitlines() and heartbeat.ranked(str(beats)) == {}


@needs_root
def test_the_watchdog_kills_only_its_own_stalled_workers_never_another_user_s(tmp_path, procs):
    """The watchdog kills its own stalled workers, and never another user's or one outside its tree."""
    beats = tmp_path / "beats"
    assert heartbeat.prepare(str(beats)) == str(beats)  # as the launcher does: this test is the launcher
    marker = f"{contract.HEARTBEAT_DIR_ENV}={beats}"
    worker = procs.child(_rank_env(beats, 0), marker)
    stranger = procs.other_user(_rank_env(beats, 1), marker)
    outside = procs.orphan(_rank_env(beats, 2), marker)
    heartbeat.Heartbeat(str(beats), 0, 0).beat(3)
    old = time.time() - 60
    os.utime(beats / "0", (old, old))
    out = io.StringIO()
    dog = heartbeat.Watchdog(str(beats), 5.0, "restart", out=out, settle=0)
    assert dog.check()
    assert "killing its 1 workers" in out.getvalue(), out.getvalue()
    wait_until(lambda: not alive(worker), 10, "the stalled worker killed", interval=0.02)
    assert alive(stranger) and alive(outside)
    assert [p.name for p in beats.iterdir()] == [contract.LAUNCHER_FILE]  # the beats go; the launcher stays named


def test_a_process_whose_uids_differ_is_no_job_s():
    assert _one_uid(b"\t1000\t1000\t1000\t1000\n") == 1000
    assert _one_uid(b"\t1000\t0\t0\t0\n") is None  # a setuid program run by 1000
    assert _one_uid(b"") is None and _one_uid(b"\tx\tx\tx\tx") is None


# --- what the host runtime's end and stop kill (kill_run.sh) -------------------------------------

@needs_root
def test_kill_run_never_kills_another_user_s_process_that_carries_the_run_s_marker(tmp_path, procs):
    run = str(tmp_path / "nas/.ddp-deploy/job/here")
    marker = f"DDP_DEPLOY_RUN={run}"
    mine = procs.child({"DDP_DEPLOY_RUN": run}, marker)
    stranger = procs.other_user({"DDP_DEPLOY_RUN": run}, marker)
    subprocess.run(["sh", "-c", scripts.KILL_RUN + 'kill_run "$1" ""', "sh", run], check=True, timeout=30)
    assert procs.children[0].wait(timeout=10) == -signal.SIGKILL and not alive(mine)
    assert alive(stranger)
