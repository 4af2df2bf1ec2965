"""tools/suite/budget.py: the suite's time budget is reported, never enforced by failing a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent / "tools" / "suite"  # the plugins under test
CHEAP_REFERENCE = f"{sys.executable} -c pass"  # the inner runs' own reference: not two imports of torch each

INNER = '''
import subprocess
import sys
import time
import pytest

@pytest.mark.budget(0.05)
def test_slow_beyond_its_own_limit():
    time.sleep(0.3)

def test_quick():
    pass

@pytest.mark.e2e
def test_an_e2e_within_its_kinds_limit():
    pass

SPIN = "import time\\nt = time.process_time() + 0.5\\nwhile time.process_time() < t: pass"

def test_work_in_a_child():
    subprocess.run([sys.executable, "-c", SPIN], check=True)

@pytest.fixture(scope="session")
def shared():
    """A session's fixture with a costly teardown (a test cluster's): in the last test's teardown."""
    yield
    t = time.process_time() + 0.5
    while time.process_time() < t: pass
    time.sleep(0.3)

def test_uses_a_shared_fixture(shared):
    pass

LEFT = []

def test_zz_starts_a_child_it_leaves():
    LEFT.append(subprocess.Popen([sys.executable, "-c", SPIN + "\\nprint(1, flush=True)"], stdout=subprocess.PIPE))
    LEFT[0].stdout.readline()  # it has done its work, and is not reaped here

def test_zz_zreaps_a_child_another_test_left():
    for child in LEFT:
        child.wait()
'''


def _run(tmp_path: Path, budget_s: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    e2e: x\n")
    times = tmp_path / "times.json"
    env = {**os.environ, "PYTHONPATH": str(HERE), "DDP_TEST_BUDGET_S": budget_s, "DDP_TEST_TIMES": str(times),
           "DDP_TEST_REFERENCE": CHEAP_REFERENCE}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "budget", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc, json.loads(times.read_text())


@pytest.mark.parametrize("lanes", [(), ("-n", "2")], ids=["one process", "two xdist workers"])
def test_a_test_or_a_suite_over_its_limit_is_named_and_nothing_fails(tmp_path, lanes):
    """A test over its own limit and a suite over its limit are named, and nothing fails."""
    proc, times = _run(tmp_path, "0.1", *lanes)
    assert proc.returncode == 0, proc.stdout  # a report, not a failure
    report = proc.stdout[proc.stdout.index("time budget"):]
    over = report[report.index("over their own limit (1):"):].splitlines()
    assert over[1].endswith("> 0 s  test_inner.py::test_slow_beyond_its_own_limit")
    assert "the suite is over its limit" in report and "min > 0.0 min ($DDP_TEST_BUDGET_S)" in report
    assert report.index("test_slow_beyond_its_own_limit") < report.index("test_quick")  # slowest first
    assert times["tests"]["test_inner.py::test_slow_beyond_its_own_limit"]["s"] >= 0.3
    assert times["tests"]["test_inner.py::test_an_e2e_within_its_kinds_limit"]["kind"] == "e2e"
    assert set(times["tests"]) == {f"test_inner.py::{t}" for t in (
        "test_slow_beyond_its_own_limit", "test_quick", "test_an_e2e_within_its_kinds_limit", "test_work_in_a_child",
        "test_zz_starts_a_child_it_leaves", "test_zz_zreaps_a_child_another_test_left", "test_uses_a_shared_fixture")}


@pytest.mark.parametrize("lanes", [(), ("-n", "2")], ids=["one process", "two xdist workers"])
def test_session_fixtures_torn_down_in_a_process_s_last_test_are_counted_apart(tmp_path, lanes):
    """The session's fixtures torn down in a process's last test are counted apart from it."""
    proc, times = _run(tmp_path, "600", *lanes)
    assert sum(t["cpu_s"] for t in times["session_teardown"]) >= 0.45, times["session_teardown"]
    assert sum(t["s"] for t in times["session_teardown"]) >= 0.75, times["session_teardown"]
    for name, t in times["tests"].items():  # none of the tests carries the teardown's 0.5 core-s and 0.8 s
        if not name.endswith(("test_work_in_a_child", "test_zz_starts_a_child_it_leaves", "test_slow_beyond_its_own_limit")):
            assert t["cpu_s"] < 0.3 and t["s"] < 0.3, (name, t)
    report = proc.stdout[proc.stdout.index("time budget"):]
    assert "the session's fixtures torn down after each process's last test, in no test's figures: " in report


@pytest.mark.parametrize("lanes", [(), ("-n", "2")], ids=["one process", "two xdist workers"])
def test_each_test_s_cpu_counts_its_children_and_the_report_names_the_most_costly(tmp_path, lanes):
    """Each test's CPU counts its children's work, and the report names the most costly."""
    proc, times = _run(tmp_path, "600", *lanes)
    cpu = {name.split("::")[1]: t["cpu_s"] for name, t in times["tests"].items()}
    assert cpu["test_work_in_a_child"] >= 0.5  # the child's half second, and its interpreter's start
    assert cpu["test_slow_beyond_its_own_limit"] < 0.25  # it sleeps: its 0.3 s are not CPU
    report = proc.stdout[proc.stdout.index("most CPU"):]
    assert report.splitlines()[1].split("core-s  ")[1] in ("test_inner.py::test_work_in_a_child",
                                                         "test_inner.py::test_zz_starts_a_child_it_leaves")


@pytest.mark.skipif(not os.access("/sys/fs/cgroup/cpuacct", os.W_OK), reason="needs a writable cgroup v1 cpuacct (root)")
def test_a_child_s_work_counts_in_the_test_it_ran_in_not_the_one_that_reaped_it(tmp_path):
    _, times = _run(tmp_path, "600")
    cpu = {name.split("::")[1]: t["cpu_s"] for name, t in times["tests"].items()}
    assert cpu["test_zz_starts_a_child_it_leaves"] >= 0.5, cpu
    assert cpu["test_zz_zreaps_a_child_another_test_left"] < 0.2, cpu


def test_a_run_within_its_limits_says_so_and_names_no_test(tmp_path):
    proc, _ = _run(tmp_path, "600")
    report = proc.stdout[proc.stdout.index("time budget"):]
    assert "within the suite's limit" in report
    assert "over their own limit (1):" in report  # only the test that sets a tiny limit of its own
    assert "test_quick" not in report[report.index("over their own limit"):]


def test_the_report_says_how_busy_the_cores_were_and_the_figure_counts_work_done(tmp_path, monkeypatch):
    import budget

    monkeypatch.setenv("DDP_TEST_REFERENCE", CHEAP_REFERENCE)

    before = budget.busy_core_seconds()
    spin_until = time.process_time() + 0.5
    while time.process_time() < spin_until:
        pass
    assert budget.busy_core_seconds() - before >= 0.4  # the machine's count holds this process's work
    made = budget.Budget()
    made.disk.stop()
    line = made.lines(600.0, 1500.0, busy=900.0, cores=2)[1]
    assert line == "cores busy 75% of the run: 15.0 core-min of 20.0 (2 cores, every process of the machine)"
    proc, times = _run(tmp_path, "600")
    assert "cores busy " in proc.stdout[proc.stdout.index("time budget"):]
    # a number, whatever it is: a run of a second may fall between two of /proc/stat's ticks (the
    # count itself is checked above)
    assert isinstance(times["busy_core_s"], float) and times["busy_core_s"] >= 0 and times["cores"] == os.cpu_count()


def test_the_machine_s_speed_is_a_fresh_torch_import_s_cpu_at_the_start_and_the_end(tmp_path, monkeypatch):
    """The machine's speed is the CPU of a fresh import of torch, at the start and at the end."""
    import budget

    monkeypatch.delenv("DDP_TEST_REFERENCE", raising=False)
    assert budget.reference_command() == [sys.executable, "-c", "import torch"]
    took = budget.reference_core_seconds(tries=1)
    assert took is not None and 0.05 < took < 120  # torch's import is real work, in the child, counted
    spin = [sys.executable, "-c", "import time\nt = time.process_time() + 0.5\nwhile time.process_time() < t: pass"]
    assert 0.45 <= budget.reference_core_seconds(spin, tries=1) < 30  # the child's CPU, not its wall time
    assert budget.reference_core_seconds([sys.executable, "-c", "raise SystemExit(3)"]) is None
    monkeypatch.setenv("DDP_TEST_REFERENCE", "")
    assert budget.reference_core_seconds() is None  # none asked for: none measured, none reported
    made = budget.Budget()
    made.disk.stop()
    assert made.reference_at_start is None
    assert not any("speed" in line for line in made.lines(600.0, 1500.0))
    monkeypatch.delenv("DDP_TEST_REFERENCE")
    line = made.lines(600.0, 1500.0, reference=(2.314, 3.5))[1]
    assert line == ("the machine's speed: a fresh `python -c 'import torch'` took 2.31 core-s at the start, "
                    "3.50 at the end (lower is faster; compare runs by it)")
    proc, times = _run(tmp_path, "600")
    assert f"the machine's speed: a fresh `{CHEAP_REFERENCE}` took " in proc.stdout
    said = times["reference_core_s"]
    assert set(said) == {"start", "end"} and all(isinstance(v, float) and v >= 0 for v in said.values())


DISK_INNER = '''
import os
import time

def test_fills_the_disk_for_a_second():
    time.sleep(1.0)  # in a worker, the controller hears of the start a moment later
    fd = os.open(os.path.join(os.environ["DDP_TEST_DISK"], "filler"), os.O_CREAT | os.O_WRONLY)
    os.posix_fallocate(fd, 0, 24 << 20)
    time.sleep(1.0)  # the sampler's every 0.1 s sees it
    os.close(fd)
    os.unlink(os.path.join(os.environ["DDP_TEST_DISK"], "filler"))

def test_quick():
    pass
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs of its own (root)")
@pytest.mark.parametrize("lanes", [(), ("-n", "2")], ids=["one process", "two xdist workers"])
def test_the_report_says_how_full_the_disk_got_and_which_test_was_running_then(tmp_path, lanes):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], check=True)
    try:
        (tmp_path / "test_disk.py").write_text(DISK_INNER)
        times = tmp_path / "times.json"
        env = {**os.environ, "PYTHONPATH": str(HERE), "DDP_TEST_DISK": str(disk), "DDP_TEST_DISK_EVERY_S": "0.1",
               "DDP_TEST_TIMES": str(times), "DDP_TEST_REFERENCE": CHEAP_REFERENCE}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "budget", "-p", "no:cacheprovider", *lanes,
                               str(tmp_path / "test_disk.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    recorded = json.loads(times.read_text())
    said = recorded["disk"]
    assert 0.024 <= recorded["tests"]["test_disk.py::test_fills_the_disk_for_a_second"]["disk_gb"] <= 0.03
    starts = [recorded["tests"][f"test_disk.py::{t}"]["start_s"] for t in ("test_fills_the_disk_for_a_second", "test_quick")]
    assert all(0 <= s < 60 for s in starts)
    if not lanes:  # in two workers, it may run beside the other
        assert starts[0] < starts[1]
        assert recorded["tests"]["test_disk.py::test_quick"]["disk_gb"] == 0
    assert said["path"] == str(disk)
    assert 0.024 <= said["peak_above_start_gb"] <= 0.03  # its 24 MiB (25.2 MB), nothing else writes there
    filler = "test_disk.py::test_fills_the_disk_for_a_second"
    assert said["at_peak"] == [filler] if not lanes else filler in said["at_peak"]  # quick may run beside it
    assert 0.006 <= said["least_free_gb"] <= 0.009  # 32 MiB less 24
    line = next(line for line in proc.stdout.splitlines() if line.startswith("disk ("))
    assert line.startswith(f"disk ({disk}'s filesystem): at most 25 MB more than at the start, 8 MB free at the "
                           f"least, while running: ") and filler in line
