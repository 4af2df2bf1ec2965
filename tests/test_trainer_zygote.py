"""agent/zygote.py: workers forked from the launcher's zygote behave as the processes torchrun's
agent would have started itself: their program, environment, directory, arguments, output, exit
codes, signals and ends; and they are found by exact identity. Each test drives a real launcher-like
process (the zygote forked from it, the worker forked from that) through ``DRIVER``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from procs import alive
from agent import contract
from agent import heartbeat, zygote
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]

# argv: a JSON spec {"torch": bool, "args": [...], "env": {...}, "cwd": ..., "out": ..., "err": ...}
# (the worker's output files; "held": an inheritable descriptor open before the zygote forks); prints "PID n", then
# "EXIT code" once the worker ends (as torchrun's agent polls it), and follows "kill" on stdin.
DRIVER = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, sys.argv[2])
    spec = json.loads(sys.argv[1])
    if spec.get("torch"):
        import torch
    from agent import zygote
    sys.path.insert(0, spec["cwd"])  # where a test's own preload modules are
    for name in ("handshake_s", "ready_s"):
        if name in spec:
            setattr(zygote, name.upper(), spec[name])
    if spec.get("held"):  # as the launcher holds its log folder's lock, handed down by its tee (pass_fds)
        held = os.open(spec["cwd"], os.O_RDONLY | os.O_DIRECTORY)
        os.set_inheritable(held, True)
    z = zygote.Zygote.start(preload=tuple(spec.get("preload", ())))
    os.chdir(spec["cwd"])
    out, err = open(spec["out"], "w"), open(spec["err"], "w")  # as torchrun redirects a worker's
    try:
        w = z.spawn([sys.executable, *spec["args"]], spec["env"], 0, out.fileno(), err.fileno())
    except Exception as exc:
        try:
            os.kill(z.pid, 0)
            print("FAILED", type(exc).__name__, "zygote alive", flush=True)
        except ProcessLookupError:
            print("FAILED", type(exc).__name__, "zygote gone", flush=True)
        sys.exit(0)
    print("PID", w.pid, flush=True)
    while w.poll() is None:
        time.sleep(0.02)
    print("EXIT", w.returncode, flush=True)
""")


def _drive(tmp_path: Path, args, env=None, torch=False, launcher_env=None, **zygote_spec):
    """The launcher-like driver; ``env``: what the worker's environment adds to this one's (torchrun's
    variables); ``launcher_env``: the driver's own; ``zygote_spec``: ``preload`` (modules in
    ``tmp_path``), ``handshake_s``, ``ready_s``."""
    spec = {"args": args, "env": {**os.environ, **(env or {})}, "cwd": str(tmp_path), "torch": torch,
            "out": str(tmp_path / "worker.out"), "err": str(tmp_path / "worker.err"), **zygote_spec}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(spec), str(ROOT)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=launcher_env)
    driver.files = tmp_path / "worker.out", tmp_path / "worker.err"
    return driver


def _pid(driver) -> int:
    """The worker's pid, as the driver prints it."""
    line = driver.stdout.readline()
    assert line.startswith("PID "), line + driver.stderr.read()
    return int(line.split()[1])


def _ended(driver, timeout=60) -> tuple[int, str, str]:
    """(the worker's exit code as the driver saw it, the worker's output, its errors); read through
    the same buffered file as _pid (communicate would miss what it holds already)."""
    said = driver.stdout.read()
    problems = driver.stderr.read()
    driver.wait(timeout)
    lines = [line for line in said.splitlines() if line.startswith("EXIT ")]
    assert lines, said + problems
    out, err = (f.read_text() for f in driver.files)
    return int(lines[-1].split()[1]), out, err


def _program(tmp_path: Path, name: str, body: str) -> None:
    (tmp_path / name).write_text(textwrap.dedent(body))


def test_a_forked_worker_runs_its_module_as_python_u_m_would(tmp_path):
    """A forked worker runs its module as python -u -m would: with its environment, directory, arguments and
    exit code."""
    _program(tmp_path, "prog.py", """
        import os, sys
        print("name", __name__, "argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0])
        print("env", os.environ.get("ZYGOTE_TEST"), os.environ.get("ONLY_IN_LAUNCHER"))
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    """)
    driver = _drive(tmp_path, ["-u", "-m", "prog", "--flag", "x y"], {"ZYGOTE_TEST": "worker's own"})
    _pid(driver)
    code, out, err = _ended(driver)
    assert code == 3
    assert f"name __main__ argv ['--flag', 'x y'] cwd {tmp_path} path0 {tmp_path}" in out
    assert "env worker's own None" in out and "to stderr" in err


def test_a_script_runs_from_its_own_directory_and_an_uncaught_exception_exits_1(tmp_path):
    """A script runs with its own directory first, and an uncaught exception prints its traceback and
    exits 1."""
    (tmp_path / "sub").mkdir()
    _program(tmp_path / "sub", "script.py", """
        import sys
        print("path0", sys.path[0], "argv0", sys.argv[0], flush=True)
        raise RuntimeError("the worker's own error")
    """)
    driver = _drive(tmp_path, ["-u", str(tmp_path / "sub" / "script.py")])
    _pid(driver)
    code, out, err = _ended(driver)
    assert code == 1
    assert f"path0 {tmp_path / 'sub'} argv0 {tmp_path / 'sub' / 'script.py'}" in out
    assert "Traceback (most recent call last)" in err and "RuntimeError: the worker's own error" in err
    assert "zygote.py" not in err and "runpy" not in err  # the program's frames alone, as `python SCRIPT` prints


def test_the_agent_s_killpg_reaches_the_worker_s_own_session_and_sets_its_exit_code(tmp_path):
    """The agent's killpg reaches the worker in a session of its own, and its signal is its exit code."""
    _program(tmp_path, "sleeper.py", """
        import time
        print("up", flush=True)
        time.sleep(60)
    """)
    driver = _drive(tmp_path, ["-u", "-m", "sleeper"])
    pid = _pid(driver)
    assert os.getsid(pid) == pid  # as torchrun's own workers (start_new_session)
    os.killpg(pid, signal.SIGTERM)  # what SubprocessHandler.close does
    code, _, _ = _ended(driver)
    assert code == -signal.SIGTERM


# torch's own handler, its _popen given to the zygote (zygote.install); prints "PID n", reads a line,
# then closes the worker as torchrun's agent does when another worker ended, and prints what happened.
CLOSER = textwrap.dedent("""
    import inspect, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh
    from agent import zygote
    zygote.install(zygote.Zygote.start(preload=()))
    extra = {"numa_options": None} if "numa_options" in inspect.signature(sh.SubprocessHandler).parameters else {}
    handler = sh.SubprocessHandler(sys.executable, ("-u", "-m", "sleeper"), dict(os.environ), None, None, 0, **extra)
    print("PID", handler.proc.pid, type(handler.proc).__name__, flush=True)
    sys.stdin.readline()
    try:
        handler.close(signal.SIGTERM)
        print("CLOSED", flush=True)
    except OSError as exc:
        print("CLOSE FAILED", repr(exc), flush=True)
    print("EXIT", handler.proc.wait(30), flush=True)
""")


def test_the_agent_closes_a_worker_already_ended_and_reaped_without_failing(tmp_path):
    """The zygote reaps its workers at once, so a worker killed from outside (a stall's restart) can be
    gone, its process group with it, while the agent still holds it running: torch's close() killpgs
    it, and a ProcessLookupError there ended torchrun's agent. The close succeeds, the end is the kill."""
    _program(tmp_path, "sleeper.py", """
        import time
        time.sleep(60)
    """)
    driver = subprocess.Popen([sys.executable, "-c", CLOSER, str(ROOT)], cwd=tmp_path, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = driver.stdout.readline()
    assert line.startswith("PID ") and line.split()[2] == "Forked", line + driver.stderr.read()
    pid = int(line.split()[1])
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10, "the zygote to reap its killed worker", interval=0.05)
    out, err = driver.communicate("close\n", timeout=60)
    assert out.splitlines() == ["CLOSED", f"EXIT {-signal.SIGKILL}"], out + err


def test_an_uncaught_keyboard_interrupt_ends_the_worker_by_sigint_as_python_does(tmp_path):
    _program(tmp_path, "interrupted.py", "raise KeyboardInterrupt\n")
    driver = _drive(tmp_path, ["-u", "-m", "interrupted"])
    _pid(driver)
    code, _, err = _ended(driver)
    assert code == -signal.SIGINT and "KeyboardInterrupt" in err


def test_a_zygote_slower_to_import_than_the_handshake_is_waited_for_and_forks_once(tmp_path):
    """A zygote whose imports outlast a fork's handshake is waited for, and forks the worker once."""
    # Imports that take longer than a fork's handshake (a loaded machine's): the last version timed
    # the handshake from the request, gave up, and torchrun started the rank's worker itself while
    # the zygote forked it too once its imports were done: two workers of one rank.
    _program(tmp_path, "slowimport.py", "import time\ntime.sleep(2)\n")
    _program(tmp_path, "once.py", "import os\nwith open('ran', 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n")
    driver = _drive(tmp_path, ["-u", "-m", "once"], preload=["slowimport"], handshake_s=0.5)
    pid = _pid(driver)
    code, _, err = _ended(driver)
    assert code == 0, err
    assert (tmp_path / "ran").read_text().split() == [str(pid)]


def test_a_zygote_that_never_serves_is_killed_and_torchrun_starts_the_worker_itself(tmp_path):
    """A zygote that never serves is killed before torchrun starts the worker itself."""
    _program(tmp_path, "hangs.py", "import time\ntime.sleep(60)\n")
    _program(tmp_path, "once.py", "open('ran', 'a').close()\n")
    driver = _drive(tmp_path, ["-u", "-m", "once"], preload=["hangs"], ready_s=1)
    said, problems = driver.communicate(timeout=60)
    assert said.strip() == "FAILED TimeoutError zygote gone", said + problems  # so it forks nothing later
    assert not (tmp_path / "ran").exists()


OPEN_FDS = """
import os
fds = []
for name in os.listdir("/proc/self/fd"):
    try:
        os.fstat(int(name))  # the listing's own descriptor is closed by now
        fds.append(int(name))
    except OSError:
        pass
print("fds", sorted(fds), flush=True)
"""


def test_a_forked_worker_holds_no_descriptor_above_stderr_like_torchrun_s_own_start(tmp_path):
    """torchrun starts a worker with ``close_fds``: the launcher's descriptors (its log folder's lock,
    inherited from its tee; the zygote's sockets and pipes) are not the worker's, nor a daemon's it leaves."""
    _program(tmp_path, "fds.py", OPEN_FDS)
    held = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    os.set_inheritable(held, True)
    try:  # torchrun's start (subprocess, close_fds) from a process holding an inheritable descriptor
        torchruns = subprocess.run([sys.executable, "-u", "-m", "fds"], cwd=tmp_path, capture_output=True, text=True,
                                   start_new_session=True, timeout=60)
    finally:
        os.close(held)
    assert torchruns.stdout == "fds [0, 1, 2]\n", torchruns.stderr
    driver = _drive(tmp_path, ["-u", "-m", "fds"], held=True)
    _pid(driver)
    code, out, err = _ended(driver)
    assert code == 0 and out == torchruns.stdout, out + err

def test_a_worker_dies_with_its_launcher(tmp_path):
    _program(tmp_path, "sleeper.py", "import time\ntime.sleep(120)\n")
    driver = _drive(tmp_path, ["-u", "-m", "sleeper"])
    pid = _pid(driver)
    driver.kill()  # the launcher killed (kill -9): its zygote, then the worker, go with it
    driver.wait()
    wait_until(lambda: not alive(pid), 10, "the worker to die with its launcher", interval=0.05)


def test_a_forked_worker_is_named_in_the_heartbeat_directory_and_found_by_its_marker(tmp_path):
    """A forked worker is named in the heartbeat directory, and found by the launcher's marker."""
    beats = tmp_path / "beats"
    beats.mkdir()
    _program(tmp_path, "sleeper.py", "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    env = {contract.HEARTBEAT_DIR_ENV: str(beats), "LOCAL_RANK": "1", "RANK": "7"}
    # the launcher's own environment holds the marker, as deploy's does (the worker's /proc shows it)
    driver = _drive(tmp_path, ["-u", "-m", "sleeper"], env,
                    launcher_env={**os.environ, contract.HEARTBEAT_DIR_ENV: str(beats)})
    pid = _pid(driver)
    try:
        assert (beats / "workers" / "1").read_text() == f"{pid} 7\n"
        assert heartbeat.workers(str(beats)) == [pid]
        found = subprocess.run(["sh", "-c", contract.program("diagnose"), "sh", str(beats), "/nonexistent"],
                               capture_output=True, text=True, timeout=60).stdout
        assert f"rank {pid} 7 1 S" in found and "workers 1" in found, found
        assert heartbeat.workers(str(tmp_path / "another")) == []
    finally:
        os.killpg(pid, signal.SIGKILL)
    _ended(driver)
    assert not (beats / "workers" / "1").exists()  # gone with its worker
    heartbeat.remove(str(beats))
    assert not beats.exists()


def test_torchrun_s_thread_count_applies_in_a_worker_forked_after_torch_was_loaded(tmp_path):
    """torchrun's thread count is applied in a worker forked after torch was loaded."""
    _program(tmp_path, "threads.py", "import torch\nprint('threads', torch.get_num_threads())\n")
    driver = _drive(tmp_path, ["-u", "-m", "threads"], {"OMP_NUM_THREADS": "1"}, torch=True)
    _pid(driver)
    code, out, _ = _ended(driver, timeout=120)
    assert code == 0 and "threads 1" in out


@pytest.mark.parametrize("args", [["-m", "trainer"], ["-c", "pass"], ["-u", "-c", "pass"], ["-u"], ["-u", "-m"]])
def test_only_torchrun_s_python_u_shapes_are_forked_and_the_rest_left_to_torchrun(args):
    """Only torchrun's python -u program shapes are forked; anything else is left to torchrun."""
    assert zygote.program_of([sys.executable, *args]) is None
    assert zygote.program_of(["/bin/python-other", "-u", "-m", "trainer"]) is None
    assert zygote.program_of([sys.executable, "-u", "-m", "trainer", "--x"]) == {"module": "trainer", "argv": ["--x"]}
    assert zygote.program_of([sys.executable, "-u", "a.py"]) == {"script": "a.py", "argv": []}


def test_the_zygote_is_used_if_asked_or_unset_without_a_gpu_and_never_when_refused(tmp_path):
    """The zygote is used when asked for, or unset where no GPU device exists, and never when refused."""
    none, gpus = [str(tmp_path / "nvidia[0-9]*")], [str(tmp_path / "nvidia[0-9]*"), str(tmp_path / "kfd")]
    (tmp_path / "nvidiactl").touch()  # a driver's control node alone opens no GPU
    linux = sys.platform.startswith("linux")
    assert zygote.wanted({}, none) is linux and zygote.wanted({contract.PREFORK_ENV: "1"}, none) is linux
    assert not zygote.wanted({contract.PREFORK_ENV: "0"}, none)
    (tmp_path / "nvidia0").touch()
    assert not zygote.wanted({}, gpus)  # unset where a GPU may be opened: torchrun starts the workers
    assert zygote.wanted({contract.PREFORK_ENV: "1"}, gpus) is linux  # deploy asked for it
    assert not zygote.wanted({contract.PREFORK_ENV: "0"}, gpus)
