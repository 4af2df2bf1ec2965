"""How the bundle's torch programs end: as the interpreter ends a program, without its teardown.

After a program's last line the interpreter tears down every module and its objects, and the
libraries' destructors run: with torch imported that takes 0.5 to 0.7 s of a core, with
``torch._dynamo`` (which DDP's constructor imports) about 1 s (bench/bench_exit.py), in every
launcher, probe and worker of every start. None of it is the program's work. What a program does
leave to its end is done here, in the interpreter's order: an uncaught exception's traceback
(``SystemExit``'s code, an uncaught ``KeyboardInterrupt`` ending the process by SIGINT), the
threads that are not daemons joined, the ``atexit`` handlers (logging's flush, ``tempfile``'s and
``weakref.finalize``'s cleanups, multiprocessing's children), the standard streams flushed; then
``os._exit``. A file a program leaves open and unflushed would lose its buffer: the trainer, the
launcher and the probe close theirs (the zygote's workers have ended this way from the start).

    if __name__ == "__main__":
        exits.main(main)   # instead of sys.exit(main())
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import traceback
from typing import Callable, NoReturn


def finish(call: Callable[[], object], skip: tuple[str, ...] = ()) -> int:
    """Runs ``call`` as the interpreter runs a program and does what the interpreter does at its
    end, but the teardown; returns the exit code (``-SIGINT``: ended by an uncaught Ctrl-C).
    ``call``'s result is taken as ``sys.exit`` takes its argument. A traceback starts at the
    program's first frame: this module's, runpy's and those of the files in ``skip`` (the
    caller's) before it are left out, as the interpreter shows none above the program's."""
    try:
        code = exit_code(call())
    except SystemExit as exc:
        code = exit_code(exc.code)
    except KeyboardInterrupt as exc:
        traceback.print_exception(exc.with_traceback(_program_frames(exc.__traceback__, skip)))
        code = -signal.SIGINT
    except BaseException as exc:
        exc.with_traceback(_program_frames(exc.__traceback__, skip))
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    try:
        threading._shutdown()  # as the interpreter does at exit: threads that are not daemons end first
    except Exception:
        pass
    atexit._run_exitfuncs()
    flush()
    return code


def flush() -> None:
    """The standard streams flushed, as the interpreter does last (a closed or broken one skipped)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def end(code: int) -> NoReturn:
    """Ends this process with ``code`` at once; ``-SIGINT`` ends it by SIGINT, as Python does
    after an uncaught ``KeyboardInterrupt``."""
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def main(call: Callable[[], object]) -> NoReturn:
    """``sys.exit(call())`` for a module's ``__main__`` block, ended by :func:`end`."""
    end(finish(call))


def _program_frames(tb, skip: tuple[str, ...]):
    first = tb
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>", *skip)
                              or os.path.basename(tb.tb_frame.f_code.co_filename) == "runpy.py"):
        tb = tb.tb_next
    return tb or first


def exit_code(value) -> int:
    """The exit code of ``sys.exit(value)``: None 0, an int its low byte, anything else printed
    to stderr and 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    try:
        sys.stderr.write(f"{value}\n")
    except Exception:
        pass
    return 1
