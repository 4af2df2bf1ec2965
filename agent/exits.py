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
import ctypes
import os
import signal
import sys
import threading
import traceback
from typing import Callable, NoReturn, Optional


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


class _Sigevent(ctypes.Structure):
    """glibc's ``struct sigevent`` (64 bytes) for a SIGEV_THREAD notification."""
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attribute", ctypes.c_void_p), ("pad", ctypes.c_int * 8)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval_s", ctypes.c_long), ("interval_ns", ctypes.c_long),
                ("value_s", ctypes.c_long), ("value_ns", ctypes.c_long)]


_SIGEV_THREAD, _CLOCK_MONOTONIC = 2, 1


def end_later(seconds: float, code: int, said: str) -> Optional[Callable[[], None]]:
    """Ends this process with ``code`` after ``seconds``, first writing ``said`` to stderr, from
    threads the C library starts (POSIX timers, SIGEV_THREAD), not Python's: they need no GIL,
    which a hung call into torch may hold, so that no Python thread runs again. (The C library's
    ``perror`` writes the line, ending it with ``: Success``.) Returns what disarms both timers;
    None where this C library has no such timers."""
    libc = ctypes.CDLL(None)
    for lib in (libc, None):
        try:
            lib = lib or ctypes.CDLL("librt.so.1")  # before glibc 2.34 the timers were librt's
            create, settime, delete = lib.timer_create, lib.timer_settime, lib.timer_delete
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    message = ctypes.create_string_buffer(said.encode("utf-8", "replace"))
    timers = []

    def disarm(_keep=message) -> None:  # ``message`` lives as long as the timers
        for timer in timers:
            delete(timer)
        timers.clear()

    for after, function, value in ((seconds, libc.perror, ctypes.addressof(message)),
                                   (seconds + 0.2, libc._exit, code & 0xFF)):
        event = _Sigevent(value=value or None, notify=_SIGEV_THREAD,
                          function=ctypes.cast(function, ctypes.c_void_p).value)
        timer = ctypes.c_void_p()
        if create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            disarm()
            return None
        timers.append(timer)
        whole = int(after)
        if settime(timer, 0, ctypes.byref(_Itimerspec(0, 0, whole, int((after - whole) * 1e9))), None) != 0:
            disarm()
            return None
    return disarm


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
