"""agent/exits.py: a program ended by ``exits.main`` ends as the interpreter ends it (its exit code,
its traceback, Ctrl-C, its atexit handlers, its threads, its buffered output, its log files) but
without the interpreter's teardown. Each program runs both ways in a fresh interpreter, its output a
pipe, and the two ends are compared."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ENDINGS = {
    "the interpreter": "sys.exit(main())",
    "exits": "from agent import exits; exits.main(main)",
}


def _run(body: str, ending: str, cwd: Path) -> subprocess.CompletedProcess:
    program = f"import sys\n{textwrap.dedent(body)}\n{ENDINGS[ending]}\n"
    return subprocess.run([sys.executable, "-c", program], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def _both(body: str, tmp_path: Path) -> dict[str, subprocess.CompletedProcess]:
    got = {}
    for ending in ENDINGS:
        (tmp_path / ending).mkdir()
        got[ending] = _run(body, ending, tmp_path / ending)
    return got


@pytest.mark.parametrize("body, code, err", [
    ("def main():\n    return 3", 3, ""),
    ("def main():\n    return None", 0, ""),
    ("def main():\n    return 257", 1, ""),
    ("def main():\n    sys.exit('main: error: no such file')", 1, "main: error: no such file\n"),
    ("def main():\n    raise SystemExit(4)", 4, ""),
], ids=["an int", "None", "an int past 255", "a message", "SystemExit"])
def test_what_main_returns_or_exits_with_is_the_exit_code_as_sys_exit_makes_it(body, code, err, tmp_path):
    got = _both(body, tmp_path)
    for ending, proc in got.items():
        assert (proc.returncode, proc.stderr) == (code, err), ending


def test_an_uncaught_exception_prints_the_program_s_traceback_and_exits_1(tmp_path):
    """An uncaught exception prints its traceback from the program's frames, and exits 1."""
    body = """
        def inner():
            raise ValueError("boom")

        def main():
            inner()
    """
    got = _both(body, tmp_path)
    for proc in got.values():
        assert proc.returncode == 1
        assert proc.stderr.startswith("Traceback (most recent call last):\n")
        assert proc.stderr.endswith("ValueError: boom\n")
        assert "in main\n" in proc.stderr and "in inner\n" in proc.stderr
    assert "exits.py" not in got["exits"].stderr


def test_an_uncaught_keyboard_interrupt_ends_the_program_by_sigint(tmp_path):
    got = _both("def main():\n    raise KeyboardInterrupt", tmp_path)
    for proc in got.values():
        assert proc.returncode == -signal.SIGINT
        assert proc.stderr.rstrip().endswith("KeyboardInterrupt")


def test_buffered_output_atexit_handlers_threads_and_logs_all_finish_before_the_end(tmp_path):
    """Buffered output, atexit handlers, threads and log files are all done before it ends."""
    body = """
        import atexit, logging, threading, time
        from pathlib import Path

        def main():
            logging.basicConfig(filename="log.txt", level=logging.INFO)
            logging.info("logged at the end")
            atexit.register(lambda: Path("atexit.txt").write_text("ran"))
            def late():
                time.sleep(0.3)
                print("from a thread that outlived main")
            threading.Thread(target=late).start()
            sys.stdout.write("buffered, never flushed\\n")
    """
    got = _both(body, tmp_path)
    for ending, proc in got.items():
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "buffered, never flushed\nfrom a thread that outlived main\n", ending
        assert (tmp_path / ending / "atexit.txt").read_text() == "ran"
        assert (tmp_path / ending / "log.txt").read_text() == "INFO:root:logged at the end\n"


def test_the_interpreter_s_teardown_is_what_it_leaves_out(tmp_path):
    # a module's global is freed only by the teardown: its __del__ is what shows that one ran
    body = """
        class Freed:
            def __del__(self):
                print("torn down")

        kept = Freed()

        def main():
            return 0
    """
    got = _both(body, tmp_path)
    assert got["the interpreter"].stdout == "torn down\n"
    assert got["exits"].stdout == ""
    assert got["exits"].returncode == 0
