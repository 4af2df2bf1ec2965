"""Workers forked from a process that has torch imported already, instead of each importing it again.

A worker's first seconds go to ``import torch`` and, in DDP's constructor, ``torch._dynamo``: about
3.5 s of a core each on the test machine, paid by every worker of every start and restart, and the
largest phase of a node's recovery (tests/FAULTS.md). The launcher has imported torch (torchrun is
torch's) before its agent starts any worker. With ``DDP_PREFORK=1`` it forks a *zygote* of itself
first, before it starts a thread; the zygote imports the rest (``torch._dynamo``, torchvision) while
the rendezvous runs, and forks each worker that torchrun's agent asks for.

What torchrun's agent sees is unchanged: its worker start (``SubprocessHandler._popen``, through
agent.torch_private) returns a :class:`Forked` instead of a ``Popen``, with the same ``pid``,
``poll()``, ``wait()``, ``returncode`` and ``send_signal()``. The worker is a session leader, as torchrun's own are, so
the agent's ``killpg`` reaches it and its children (and a worker the zygote has reaped already
is closed without one: its group is gone). It gets the agent's standard input and the
output torchrun gave it (its files, or the launcher's pipes), no other descriptor (as ``close_fds``),
its environment, working directory and arguments exactly;
``python -u`` (torchrun's) is kept as unbuffered standard streams; ``OMP_NUM_THREADS`` (which
torchrun sets for the workers, and which the OpenMP runtime read when torch was loaded in the
launcher) is applied with ``torch.set_num_threads``. It runs its module or script as ``python -u
-m MODULE`` / ``python -u SCRIPT`` would: ``__main__``, its directory first on ``sys.path``, none
of this bundle's ``agent`` or ``trainer`` modules imported yet (a program's own package of either
name is found first, as with ``-m``); an uncaught exception prints its traceback and exits 1, ``SystemExit`` its code,
an uncaught ``KeyboardInterrupt`` ends it by SIGINT, as Python does; threads that are not daemons
are joined and ``atexit`` runs before it exits (agent/exits.py: without the interpreter's teardown).

Lifetimes: the zygote ends when the launcher does (its end of a pipe closes) and kills any worker
left; a worker dies with the zygote (``PR_SET_PDEATHSIG``); a worker whose agent drops its handle
is killed. Identity: a forked worker's ``/proc/PID/environ`` shows the environment the launcher
started with (the run's markers, ``DDP_HEARTBEAT_DIR``, but not the worker's own ``RANK``), so the
zygote writes ``$DDP_HEARTBEAT_DIR/workers/LOCAL_RANK`` = ``PID RANK`` for each worker it forks
(agent/heartbeat/ reads it to find and diagnose the workers).

Only on Linux, and only where no GPU is in use: the zygote must never initialise CUDA before it
forks, which no test here can check (deploy sets ``DDP_PREFORK`` for CPU nodes). Any program
torchrun starts other than ``python -u -m MODULE`` or ``python -u SCRIPT`` with this interpreter,
or a zygote that does not answer, gets torchrun's own ``Popen``. A zygote is waited for while it
makes its imports (READY_S: minutes on a loaded machine), then each fork gets HANDSHAKE_S; one that
does not answer in time is killed, with every worker it forked, before torchrun starts its own:
it may have forked the worker still, and two workers of one rank would both train.
"""

from __future__ import annotations

import array
import ctypes
import gc
import glob
import io
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading

from . import exits, torch_private
from .contract import HEARTBEAT_DIR_ENV, LAUNCHER_PID_ENV, PREFORK_ENV, WORKERS_DIR

GPU_DEVICES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")
"""The device nodes through which a process reaches a GPU (NVIDIA's, ROCm's, WSL's). Where none
exists, nothing the zygote imports can initialise a GPU before it forks."""
PRELOAD = (*torch_private.DDP_IMPORTS, "torchvision")
"""What the zygote imports before it forks (torch itself the launcher has): DDP's constructor
imports ``torch._dynamo``; the trainer's models come from torchvision."""
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
HANDSHAKE_S = 30.0
"""How long a worker's fork may take once the zygote serves."""
READY_S = 600.0
"""How long the zygote's imports (PRELOAD) may take before it serves: minutes on a loaded machine."""
READY = b"ready"
BUNDLE = ("agent", "trainer")
"""This bundle's top-level packages, none of them left imported when a worker's program starts."""


def wanted(environ=os.environ, gpu_devices=GPU_DEVICES) -> bool:
    """``DDP_PREFORK=1``, or unset on a machine without a GPU device node, on a Linux whose kernel
    (and seccomp profile) has pidfd_open."""
    choice = environ.get(PREFORK_ENV, "")
    if choice == "0" or (choice != "1" and any(glob.glob(pattern) for pattern in gpu_devices)):
        return False
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def _die_with_parent() -> None:
    """This process gets SIGKILL when the thread that forked it ends (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _name(name: bytes) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError("the other end closed")
        out += chunk
    return bytes(out)


def _recv(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return _recv_exact(sock, n)


# ---------------------------------------------------------------------------- the launcher's side

class Zygote:
    """The launcher's handle on its zygote: :meth:`spawn` forks a worker there."""

    def __init__(self, pid: int, control: socket.socket, alive_w: int) -> None:
        self.pid, self.control, self._alive_w = pid, control, alive_w
        self.lock = threading.Lock()
        self._serving = False

    @classmethod
    def start(cls, preload=PRELOAD) -> "Zygote":
        """Forks the zygote. Call it before this process starts any thread."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        alive_r, alive_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the zygote
            code = 1
            try:
                parent.close()
                os.close(alive_w)
                _die_with_parent()
                _name(b"ddp-zygote")  # what ps and top show
                code = _Server(child, alive_r, preload).serve()
            finally:
                os._exit(code)
        child.close()
        os.close(alive_r)
        os.set_inheritable(alive_w, False)
        return cls(pid, parent, alive_w)

    def spawn(self, args, env: dict, stdin, stdout, stderr) -> "Forked":
        """A worker running ``args`` (torchrun's: this interpreter, ``-u``, ``-m MODULE`` or a
        script, then its arguments); ``stdin``/``stdout``/``stderr``: file descriptors."""
        program = program_of(args)
        if program is None:
            raise ValueError(f"not a program the zygote runs: {list(args)[:3]}")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self.lock:
                self._wait_serving()
                fds = array.array("i", [theirs.fileno(), stdin, stdout, stderr])
                self.control.sendmsg([b"spawn"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            theirs.close()
            mine.settimeout(HANDSHAKE_S)
            _send(mine, json.dumps({"program": program, "env": dict(env), "cwd": os.getcwd(),
                                    "name": os.path.basename(str(args[0]))}).encode())
            reply = _recv(mine).decode()
            mine.settimeout(None)
        except BaseException:
            mine.close()
            theirs.close()
            # It may have the request and fork the worker yet: torchrun's own would be a second
            # worker of the rank. Ended now, nothing it forks runs (its workers die with it).
            self.end()
            raise
        if not reply.startswith("PID "):
            mine.close()  # it forked nothing, or killed what it forked
            raise OSError(f"the zygote could not fork the worker: {reply}")
        return Forked(list(args), int(reply.split()[1]), mine)

    def _wait_serving(self) -> None:
        """Until the zygote has made its imports and takes requests: a request's handshake is timed
        from then, not from a wait behind imports that a loaded machine makes long."""
        if self._serving:
            return
        self.control.settimeout(READY_S)
        try:
            said = self.control.recv(16)
        finally:
            self.control.settimeout(None)
        if said != READY:
            raise EOFError(f"the zygote ended before it served ({said!r})")
        self._serving = True

    def end(self) -> None:
        """Kills the zygote, and with it every worker it forked, and reaps it."""
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def program_of(args) -> dict | None:
    """``python -u -m MODULE ...`` / ``python -u SCRIPT ...`` (torchrun's worker command) as
    ``{"module" or "script": ..., "argv": [...]}``; None for anything else."""
    args = [str(a) for a in args]
    if len(args) < 3 or os.path.realpath(args[0]) != os.path.realpath(sys.executable) or args[1] != "-u":
        return None
    if args[2] == "-m" and len(args) >= 4:
        return {"module": args[3], "argv": args[4:]}
    if args[2].startswith("-"):
        return None
    return {"script": args[2], "argv": args[3:]}


class Forked:
    """A forked worker as torchrun's agent handles a ``Popen``."""

    def __init__(self, args: list[str], pid: int, sock: socket.socket) -> None:
        self.args, self.pid, self._sock = args, pid, sock
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._wait(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _wait(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            if not select.select([self._sock], [], [], timeout)[0]:
                return None
            try:  # its one message is written whole once the worker has ended
                self._sock.settimeout(HANDSHAKE_S)
                status = _recv(self._sock).decode()
            except (EOFError, OSError):
                status = f"EXIT {-signal.SIGKILL}"  # the zygote went: its workers died with it
            self.returncode = int(status.split()[1])
            self._sock.close()
            return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def install(zygote: Zygote) -> None:
    """torchrun's agent starts its workers through ``zygote`` (falling back to its own ``Popen``
    for a program the zygote does not run, or when the zygote fails)."""
    failed: list[BaseException] = []  # (not torch's start put back: what wraps this one stays in place)

    def forking(popen):
        def forked(self, args, env):
            if not failed and program_of(args) is not None:
                out, err = torch_private.worker_files(self)
                try:
                    return zygote.spawn(args, env, 0, _fd(out, 1), _fd(err, 2))
                except (OSError, EOFError, ValueError) as exc:
                    sys.stderr.write(f"agent.launch: warning: workers start on their own (the zygote: {exc})\n")
                    failed.append(exc)
            return popen(self, args, env)
        return forked

    def reaped(close):
        def closed(self, death_sig=None):
            # A forked worker is the zygote's child, reaped there the moment it ends: its process group
            # can be gone while the agent has yet to read its end (a Popen's zombie would hold the group
            # until the agent reaps it). torch's killpg then raises ProcessLookupError and the agent dies
            # of it: a stall's restart SIGKILLs a node's workers while its agent closes them for the
            # first one's end, and that node never came back. Nothing is left to signal.
            try:
                close(self, death_sig)
            except ProcessLookupError:
                if not isinstance(self.proc, Forked):
                    raise
                for handle in torch_private.worker_files(self):
                    if handle:
                        handle.close()
        return closed

    torch_private.wrap_worker_start(forking)
    torch_private.wrap_worker_close(reaped)


def _fd(handle, default: int) -> int:
    return handle.fileno() if handle is not None else default


# ---------------------------------------------------------------------------- the zygote

class _Server:
    def __init__(self, control: socket.socket, alive_r: int, preload) -> None:
        self.control, self.alive_r, self.preload = control, alive_r, preload
        self.sel = selectors.DefaultSelector()
        self.workers: dict[int, tuple[socket.socket, int, dict]] = {}  # pid -> (its agent's socket, pidfd, env)

    def serve(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)  # a signal to the launcher's group is the agent's to pass on
        for name in self.preload:
            try:
                __import__(name)
            except Exception:  # an optional part missing: its workers import it themselves
                pass
        # What is imported now lives as long as every worker: out of the collector's reach, a
        # worker's full collections (the trainer's teardown makes one) no longer walk torch's
        # objects, about 0.2 s of a core each, nor copy the pages they sit on (bench/RESULTS.md)
        gc.freeze()
        try:
            self.control.send(READY)
        except OSError:
            return 0
        self.sel.register(self.control, selectors.EVENT_READ, ("control", None))
        self.sel.register(self.alive_r, selectors.EVENT_READ, ("launcher", None))
        while True:
            for key, _ in self.sel.select():
                kind, pid = key.data
                if kind == "launcher" or (kind == "control" and not self._take()):
                    self._end()
                    return 0
                if kind == "exited":
                    self._reap(pid)
                elif kind == "agent":
                    self._dropped(pid)

    def _take(self) -> bool:
        """One spawn request; False when the launcher has gone."""
        try:
            _, ancdata, _, _ = self.control.recvmsg(16, socket.CMSG_SPACE(4 * array.array("i").itemsize))
        except OSError:
            return False
        fds = array.array("i")
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if not fds:
            return False
        agent = socket.socket(fileno=fds[0])
        stdio = list(fds[1:4])
        try:
            agent.settimeout(HANDSHAKE_S)
            spec = json.loads(_recv(agent))
            spec["launcher"] = os.getppid()
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                self._become_worker(agent, stdio, spec, ready_w)  # never returns
            os.close(ready_w)
            try:  # its own session and its death with this process are in place before the agent hears of it
                os.read(ready_r, 1)
                pidfd = os.pidfd_open(pid)
            except OSError:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise
            finally:
                os.close(ready_r)
            _note(spec["env"], pid)
            try:
                _send(agent, f"PID {pid}".encode())
            except OSError:  # the agent gave up waiting: it must not run beside the one it starts instead
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                _note(spec["env"], pid, gone=True)
                os.close(pidfd)
                raise
            self.workers[pid] = (agent, pidfd, spec["env"])
            agent.settimeout(None)
            self.sel.register(pidfd, selectors.EVENT_READ, ("exited", pid))
            self.sel.register(agent, selectors.EVENT_READ, ("agent", pid))
        except (OSError, EOFError, ValueError, KeyError) as exc:
            try:
                _send(agent, f"ERROR {exc}".encode())
            except OSError:
                pass
            agent.close()
        finally:
            for fd in stdio:
                os.close(fd)
        return True

    def _reap(self, pid: int) -> None:
        agent, pidfd, env = self.workers.pop(pid)
        _, status = os.waitpid(pid, 0)
        _note(env, pid, gone=True)
        for fd in (pidfd, agent):
            try:
                self.sel.unregister(fd)
            except (KeyError, ValueError):
                pass  # the agent's handle, unregistered when it went
        os.close(pidfd)
        try:
            _send(agent, f"EXIT {os.waitstatus_to_exitcode(status)}".encode())
        except OSError:
            pass
        agent.close()

    def _dropped(self, pid: int) -> None:
        """The agent's handle went (or it wrote, which it never does): the worker goes too."""
        agent = self.workers[pid][0]
        self.sel.unregister(agent)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass

    def _end(self) -> None:
        for pid in list(self.workers):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in list(self.workers):
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
            _note(self.workers[pid][2], pid, gone=True)

    def _become_worker(self, agent: socket.socket, stdio: list[int], spec: dict, ready: int) -> None:
        code = 1
        try:
            zygote = os.getppid()
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(sig, signal.SIG_DFL)  # as a new process has them (the zygote ignores them)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.setsid()
            _die_with_parent()
            if os.getppid() != zygote:  # the zygote ended before the line above took effect
                return
            _name(spec.get("name", "python").encode())  # as exec would name it, not the zygote
            os.write(ready, b"1")
            os.close(ready)
            for i, fd in enumerate(stdio):
                if fd != i:
                    os.dup2(fd, i)
            _close_above_stderr()
            code = _run(spec)
        finally:
            exits.end(code)


def _close_above_stderr() -> None:
    """Closes every descriptor but 0, 1 and 2, as torchrun's ``Popen`` (``close_fds``) starts a worker:
    the zygote's sockets, pipes and pidfds, and whatever the launcher held when it forked the zygote
    (its log folder's lock, handed down by its tee) are not the worker's, nor a daemon's it leaves."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every number up to the limit
        fds = list(range(3, os.sysconf("SC_OPEN_MAX")))
    for fd in fds:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:  # the listing's own, closed already
                pass


def _note(env: dict, pid: int, gone: bool = False) -> None:
    """``$DDP_HEARTBEAT_DIR/workers/LOCAL_RANK``: ``PID RANK`` of the worker forked for that local
    rank, removed when it ends (if it still names it)."""
    directory, local = env.get(HEARTBEAT_DIR_ENV), env.get("LOCAL_RANK", "")
    if not directory or not local.isdigit():
        return
    path = os.path.join(directory, WORKERS_DIR, local)
    try:
        if gone:
            with open(path) as fh:
                if fh.read().split()[:1] == [str(pid)]:
                    os.unlink(path)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = f"{path}.{pid}"
        with open(temp, "w") as fh:
            fh.write(f"{pid} {env.get('RANK', '?')}\n")
        os.replace(temp, path)
    except OSError:
        pass


# ---------------------------------------------------------------------------- the worker

HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "progress_hook", "ddp_deploy_progress.py")


def _progress_hook() -> None:
    """The progress hook (agent/progress_hook) a started worker's ``sitecustomize`` installs, here
    before the program runs: by its own top-level name, nothing of it under ``trainer``."""
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location("ddp_deploy_progress", HOOK)
        module = importlib.util.module_from_spec(spec)
        sys.modules["ddp_deploy_progress"] = module
        spec.loader.exec_module(module)
        module.install()
    except Exception as exc:  # the program runs whatever happens here, without beats
        sys.stderr.write(f"ddp_deploy_progress: warning: no progress beats ({exc!r})\n")

def _run(spec: dict) -> int:
    """The worker's program, as ``python -u`` runs it; returns its exit code."""
    import runpy

    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    os.environ[LAUNCHER_PID_ENV] = str(spec["launcher"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    for name in [m for m in sys.modules if m.split(".")[0] in BUNDLE]:
        del sys.modules[name]  # the program's own modules are found as `python -m` finds them
    _progress_hook()
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    program = spec["program"]

    def program_main() -> None:
        if "module" in program:
            sys.path.insert(0, os.getcwd())
            sys.argv = [program["module"], *program["argv"]]
            runpy.run_module(program["module"], run_name="__main__", alter_sys=True)
        else:
            script = program["script"]
            sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
            sys.argv = [script, *program["argv"]]
            runpy.run_path(script, run_name="__main__")

    return exits.finish(program_main, skip=(__file__,))
