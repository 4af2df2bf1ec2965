"""The launcher on every node: torchrun options, then ``--``, then trainer flags.

``--entry MODULE`` or ``--script PATH`` among the options (taken here, not passed to torchrun)
runs that module or script instead of the trainer, through the same launcher: a user's own
training code (hosts.yaml's train.module / train.script), and ``ddp-deploy check --network``,
which runs ``trainer.netcheck`` with the job's image, interpreter and interfaces.

``python -m agent.launch --nnodes 3 ... -- --dataset mnist`` runs torchrun (in this process)
with ``--nnodes 3 ... -m trainer --dataset mnist``. Without ``--`` every argument is a trainer
flag and torchrun runs standalone on this machine: one process per visible GPU, or one process
on a CPU-only machine, or ``$NPROC_PER_NODE``. (``$DDP_DATA_DIR`` and ``$DDP_CKPT_DIR``, set in
the image to its volumes, are read by the trainer's config as defaults.)

With ``--local-addr ADDR``, the c10d rendezvous store that torchrun hosts on the endpoint node
listens on ADDR alone: torch's TCPStore otherwise binds every address of the machine.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import gc
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from string import Template

from .compat import binds_stores, listening_fd
from . import contract, exits, formed, heartbeat, holds, snapshot_hint, torch_private, workdir, zygote
from .contract import LOG_DIR_ENV, SECRET_NAMES_ENV, Mask, module_argv
from .masking import StreamMask


def default_nproc() -> str:
    import torch

    return str(torch.cuda.device_count() or 1)


DEFAULT_ENTRY = contract.TRAINER_MODULE


# Each worker's lines, printed by the launcher (Relay), start with its global rank: `logs` shows and
# filters them by rank. torch prints an uncaught exception's lines with the same prefix.
RANK_PREFIX = "[rank${rank}]: "


def torchrun_args(args: list[str], environ: dict[str, str]) -> list[str]:
    """The arguments torchrun receives (its options, then ``-m MODULE`` and that module's flags).
    On a fleet (options before ``--``) every worker's output reaches this process's through a pipe
    and is printed with its rank in front (:class:`Relay`), unless the options choose their own
    ``--tee`` or ``--redirects``."""
    if "--" in args:
        cut = args.index("--")
        launcher, trainer = args[:cut], args[cut + 1:]
    else:
        nproc = environ.get("NPROC_PER_NODE") or default_nproc()
        launcher, trainer = ["--standalone", "--nproc-per-node", nproc], args
    launcher, program = _take_program(launcher)
    return [*launcher, *program, *trainer]


def torch_writes_output(args: list[str]) -> bool:
    """Whether the options (before ``--``) have torchrun write its workers' output into files:
    ``--tee`` or ``--redirects``, the operator's own choice."""
    options = args[:args.index("--")] if "--" in args else []
    return any(option(options, name) for name in ("--tee", "--redirects")) or any(
        a.split("=")[0] in ("-t", "-r") for a in options)


def relays_output(args: list[str]) -> bool:
    """On a fleet (options before ``--``), unless torchrun writes its workers' output itself: each
    worker's lines reach this process through pipes, printed with the worker's prefix (:class:`Relay`)."""
    return "--" in args and not torch_writes_output(args)


# Our options -> how torchrun names the program: a module (-m), or a script path as is.
PROGRAM_OPTIONS = {"--entry": ("-m",), "--script": ()}


def _take_program(launcher: list[str]) -> tuple[list[str], list[str]]:
    """Removes ``--entry MODULE`` / ``--script PATH`` (also spelt ``--entry=MODULE``) from the
    launcher options: (torchrun's options, the program as torchrun takes it)."""
    rest, program = [], ["-m", DEFAULT_ENTRY]
    it = iter(launcher)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in PROGRAM_OPTIONS:
            value = value if eq else next(it, None)
            if not value:
                _usage(f"{name} needs a value")
            program = [*PROGRAM_OPTIONS[name], value]
        else:
            rest.append(arg)
    return rest, program


def _usage(message: str):
    sys.exit(f"agent.launch: error: {message}")


def option(args: list[str], name: str) -> str | None:
    """The value of torchrun option ``--name`` (also spelt ``--name=V`` or with underscores)."""
    spellings = {name, "--" + name[2:].replace("-", "_")}
    for i, arg in enumerate(args):
        if arg == "-m":
            return None
        if arg in spellings and i + 1 < len(args):
            return args[i + 1]
        key, eq, value = arg.partition("=")
        if eq and key in spellings:
            return value
    return None


def bind_rendezvous_store(address: str) -> None:
    """Makes the store torchrun hosts for the c10d rendezvous listen on ``address`` only.

    TCPStore has no bind address, but it accepts an already listening socket
    (``master_listen_fd``); the c10d backend's store is created through the name below.
    """

    def bound(tcp_store):
        def bound_store(host, port, *args, is_master=False, **kwargs):
            if is_master and kwargs.get("master_listen_fd") is None:
                kwargs["master_listen_fd"] = listening_fd(address, port)
            return tcp_store(host, port, *args, is_master=is_master, **kwargs)
        return bound_store

    torch_private.wrap_rendezvous_store(bound)


# The rendezvous watch: a probe every WATCH_EVERY_S s, each given PROBE_TIMEOUT_S s to connect; the
# launcher gives up after join_timeout + WATCH_SLACK_S s without an answer. So a lost store ends it
# within join_timeout + WATCH_SLACK_S + WATCH_EVERY_S + PROBE_TIMEOUT_S of its last answer.
WATCH_EVERY_S, WATCH_SLACK_S, PROBE_TIMEOUT_S = 10, 30, 5


def watch_rendezvous(args: list[str], every: float = WATCH_EVERY_S, slack: float = WATCH_SLACK_S
                     ) -> threading.Thread | None:
    """On a node that does not host the rendezvous: ends this process when the rendezvous store
    has not accepted a connection for ``join_timeout + 30`` s.

    When the rendezvous node is lost for good (link down, power), torchrun's agent blocks in a
    store call on a connection that never answers (for as long as the kernel retransmits, about
    15 minutes), its workers gone, and the job neither ends nor goes on. No round of the job can
    form without the store, so after longer than any round may take, the agent gives up here:
    exit 1, and the node's restart budget (Docker's policy, the host supervisor) runs out as for
    any other lost node. A connection that opens and closes costs the store nothing.
    """
    endpoint, conf = option(args, "--rdzv-endpoint"), option(args, "--rdzv-conf") or ""
    settings = dict(item.partition("=")[::2] for item in conf.split(",") if item)
    if not endpoint or settings.get("is_host", "").lower() in ("1", "true"):
        return None
    host, _, port = endpoint.rpartition(":")
    bound = int(settings.get("join_timeout", 600)) + slack
    thread = threading.Thread(target=_watch, args=(host.strip("[]"), int(port), bound, every),
                              name="rendezvous-watch", daemon=True)
    thread.start()
    return thread


def _watch(host: str, port: int, bound: float, every: float) -> None:
    silent_since = None
    while True:
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            silent_since = None
        except OSError as exc:
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > bound:
                sys.stderr.write(f"agent.launch: error: the rendezvous store at {host}:{port} has not answered "
                                 f"for {bound:.0f} s ({exc.strerror or exc}): its node is lost, and no round of "
                                 "the job can form without it; giving up (ddp-deploy --without NODE launch runs "
                                 "the job on the other nodes)\n")
                sys.stderr.flush()
                os._exit(1)
        time.sleep(every)


def elastic(args: list[str]) -> bool:
    """``--nnodes MIN:MAX`` with MIN < MAX: the job may go on with fewer nodes."""
    low, sep, high = (option(args, "--nnodes") or "").partition(":")
    return bool(sep) and low.strip() != high.strip()


def keep_rendezvous_open_on_failure() -> None:
    """An elastic job's rendezvous stays open when this node's agent ends on an error.

    torchrun's agent closes the rendezvous for every node whenever it ends, unless a signal
    ended it. A node that lost its link long enough for its agent to give up, once the link is
    back, closes it on its way out: no agent can join any round again (RendezvousClosedError),
    so that node never comes back, and the others die at their next round. In an elastic job
    the others go on without a failed node, so only an agent whose job is done closes the
    rendezvous. torch's launcher calls ``shutdown`` from a ``finally``: an exception on its way
    out is the agent failing.
    """
    def kept_open(close):
        def shutdown(self) -> bool:
            if sys.exc_info()[0] is not None:
                return False
            return close(self)
        return shutdown

    torch_private.wrap_rendezvous_shutdown(kept_open)


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def run_teed(directory: str | None, argv: list[str], mask: Mask | None = None, keep: tuple[int, ...] = ()) -> int:
    """Runs ``argv`` with its output (stdout and stderr, in order) printed here and appended to
    ``directory/log``; then appends ``TIME CODE`` to ``directory/exits``. Its exit code (128+N
    after signal N), as a shell reports it. With ``mask``, the output is masked before either:
    no secret value the job prints reaches a log at rest (the run's, Docker's, Slurm's, the
    host runtime's), in any spelling ``mask`` knows. ``directory`` None: printed here only.
    ``keep``: descriptors the child inherits (the lock of torch's log directory, :func:`torch_log_dir`).

    A container's own log goes with the container (a relaunch removes it); this copy stays with
    the run on the shared volume, and a node lost mid-run keeps its lines up to the loss. Signals
    to this process (``docker stop``'s SIGTERM) are passed on. A log that cannot be written (disk
    full) costs the copy, never the job.
    """
    # The child in a session of its own: a signal to this process's whole group (the host runtime's
    # stop, Ctrl-C in a terminal) reaches it once, forwarded from here, never twice. torchrun's
    # agent, hit again while it handles the first SIGTERM, drops its workers' last lines and leaves
    # a traceback in the log. What outlives this process is the run's own (kill_run's marker).
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, pass_fds=keep)
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda number, frame: child.send_signal(number))
    copy = _append(os.path.join(directory, "log")) if directory else None
    out = sys.stdout.buffer
    masking = StreamMask(mask) if mask else None
    done = False
    while not done:
        chunk = os.read(child.stdout.fileno(), 1 << 16)
        done = not chunk
        if masking is not None:  # holds back an unfinished line's end, which may be part of a value
            chunk = masking.end() if done else masking.feed(chunk)
        if not chunk:
            continue
        out.write(chunk)
        out.flush()
        if copy is not None:
            try:
                copy.write(chunk)
                copy.flush()
            except OSError as exc:
                _warn(f"stopped copying the output to {copy.name}: {exc.strerror or exc}")
                copy = None
    code = child.wait()
    code = code if code >= 0 else 128 - code
    if not directory:
        return code
    ended = _append(os.path.join(directory, "exits"))
    if ended is not None:
        try:
            with ended:
                ended.write(f"{time.time():.3f} {code}\n".encode())
        except OSError as exc:
            _warn(f"exit code not recorded in {ended.name}: {exc.strerror or exc}")
    return code


def _append(path: str):
    try:
        return open(path, "ab")
    except OSError as exc:
        _warn(f"cannot write {path}: {exc.strerror or exc}")
        return None


def _warn(message: str) -> None:
    sys.stderr.write(f"agent.launch: warning: {message}\n")
    sys.stderr.flush()


PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
TORCH_PREFIX_TEMPLATE = "[${role_name}${local_rank}]:"
"""torchrun's prefix of a teed worker's lines when neither its option nor PREFIX_TEMPLATE_ENV gives one."""
CHILD_LABEL = b"\x1eddp-rank "
"""Begins a line of a rank of its own that a worker started (agent/progress_hook: its ``LABEL``)."""
RELAY_LINE_BYTES = 1 << 16
"""A line longer than this is printed in parts, each with the worker's prefix."""
RELAY_DRAIN_S = 10.0
"""How long the launcher waits, once torchrun is done, for the workers' last lines: a pipe stays open
while a process the program left (a daemon in a session of its own) still holds it."""


class Relay:
    """Each worker's stdout and stderr are pipes to this process (torchrun's agent), whose lines it
    prints on its own stdout and stderr, each behind the worker's prefix (torchrun's
    ``--log-line-prefix-template`` or PREFIX_TEMPLATE_ENV): what torchrun's ``--tee`` prints, without
    the files ``--tee`` reads the lines from.

    ``--tee`` has each worker write into ``LOG_DIR/.../stdout.log`` and ``stderr.log`` and the agent
    follow those files: all a worker prints, a secret value included, rests there for the whole run,
    and after the launcher is SIGKILLed until another launcher removes them; no mask applies before
    the worker has written the file. Through a pipe, the output is only ever in the kernel's pipe
    buffer and in this process, and :func:`run_teed` masks it before any log holds it. The pipes'
    write ends are the worker's stdout and stderr whether torchrun's ``Popen`` or the zygote
    (agent/zygote.py) starts it. ``tails``: with ``keep_tails``, the last bytes of each output, for
    :func:`snapshot_hint.explain`.
    """

    def __init__(self, template: str, keep_tails: bool = False) -> None:
        self.template = template
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.tails: list[collections.deque] | None = [] if keep_tails else None

    def prefix(self, env: dict) -> bytes:
        """The prefix of a worker's lines, from its environment, as torchrun's agent makes it."""
        return Template(self.template).safe_substitute(
            role_name=env.get("ROLE_NAME", ""), rank=env.get("RANK", ""), local_rank=env.get("LOCAL_RANK", ""),
            hostname=socket.gethostname()).encode()

    def install(self) -> None:
        """torchrun's agent starts each worker with pipes to this relay as its stdout and stderr,
        unless torchrun opened files for them (``--tee``, ``--redirects``: the operator's choice)."""
        def piped(popen):
            def start(handler, args, env):
                if any(f is not None for f in torch_private.worker_files(handler)):
                    return popen(handler, args, env)
                prefix = self.prefix(env)
                (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
                files = open(out_w, "wb", buffering=0), open(err_w, "wb", buffering=0)
                torch_private.set_worker_files(handler, *files)
                try:
                    proc = popen(handler, args, env)
                except BaseException:
                    os.close(out_r)
                    os.close(err_r)
                    raise
                finally:  # the worker holds the write ends: a pipe ends once it and its children are gone
                    for f in files:
                        f.close()
                    torch_private.set_worker_files(handler, None, None)
                self._follow(out_r, sys.stdout, prefix)
                self._follow(err_r, sys.stderr, prefix)
                return proc
            return start

        torch_private.wrap_worker_start(piped)

    def _follow(self, fd: int, stream, prefix: bytes) -> None:
        tail = None
        if self.tails is not None:
            tail = collections.deque()
            self.tails.append(tail)
        thread = threading.Thread(target=self._copy, args=(fd, stream.buffer, prefix, tail), name="worker-output",
                                  daemon=True)
        thread.start()
        self.threads.append(thread)

    def _copy(self, fd: int, out, prefix: bytes, tail: collections.deque | None) -> None:
        kept = 0
        with open(fd, "rb") as pipe:
            for line in iter(lambda: pipe.readline(RELAY_LINE_BYTES), b""):
                line = line if line.endswith(b"\n") else line + b"\n"
                if tail is not None:
                    tail.append(line)
                    kept += len(line)
                    while kept > snapshot_hint.TAIL_BYTES and len(tail) > 1:
                        kept -= len(tail.popleft())
                if out is None:
                    continue
                said = prefix
                if line.startswith(CHILD_LABEL):  # a rank of its own the worker started (progress hook)
                    said, line = self.relabel(line, prefix)
                try:
                    with self.lock:
                        out.write(said + line)
                        out.flush()
                except (OSError, ValueError):
                    # This process's output is gone (its tee killed): the lines are dropped, and the
                    # worker, whose writes would fill the pipe, is never held up by it.
                    out = None

    def relabel(self, line: bytes, prefix: bytes) -> tuple[bytes, bytes]:
        """The prefix of a line a rank of its own labelled (``CHILD_LABEL RANK LOCAL_RANK \\x1e``), and
        the line without the label; a label that is not exactly that is text of the worker's ``prefix``."""
        head, sep, rest = line[len(CHILD_LABEL):].partition(b"\x1e")
        words = head.split(b" ")
        if not sep or len(words) != 2 or not all(w.isdigit() and len(w) <= 9 for w in words):
            return prefix, line
        return Template(self.template).safe_substitute(
            role_name="", rank=words[0].decode(), local_rank=words[1].decode(),
            hostname=socket.gethostname()).encode(), rest

    def drain(self, timeout: float = RELAY_DRAIN_S) -> None:
        """Waits for the workers' last lines: up to ``timeout`` for a pipe a process still holds."""
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))

    def lines(self) -> list[str]:
        """The kept tails' lines (none without ``keep_tails``)."""
        return [line.decode(errors="replace") for tail in self.tails or () for line in list(tail)]


TORCH_LOG_PREFIX = "ddp-torchlog-"
"""torchrun's log directories of launchers of this version, in $TMPDIR: each held (``flock``) by
the launcher that made it for as long as it runs. Versions before it named theirs
``ddp-torchelastic-*`` and held none: they are left alone, since one may belong to a launcher of
such a version that is still running."""
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
"""How a log directory is opened to be locked: never through a link."""


class LogDirArgs(list):
    """torchrun's ``--log-dir DIR`` options, and ``held``: the descriptor whose lock holds DIR (None:
    none made here). A child that runs torchrun with them inherits it: the lock is held while either
    runs (a launcher killed alone leaves its child torchrun writing there)."""

    held: int | None = None


@contextlib.contextmanager
def torch_log_dir(args: list[str]):
    """torchrun's ``--log-dir`` (:class:`LogDirArgs`): ``[]`` when the options (before ``--``) name a
    log directory; ``/dev/null`` unless they have torchrun write the workers' output (``--tee``,
    ``--redirects``); else a directory new and private to this run, removed with everything in it
    at the end.

    With ``/dev/null`` torchrun writes no file: the workers' output reaches this process through
    pipes (:class:`Relay`), and a worker has no error file (``TORCHELASTIC_ERROR_FILE`` empty): the
    one torch's ``@record`` writes holds the exception's message, which a secret may be part of;
    the worker prints its traceback all the same. A directory torchrun makes itself otherwise, a new
    ``$TMPDIR/torchelastic_*`` per run, is left: each worker's raw output, secrets a program printed
    included, piling up. A launcher killed before it could remove its own (``stop --now``, the OOM
    killer) leaves it too: the next launcher on this machine removes every such directory that no
    running launcher holds.
    """
    if "--" in args and option(args[:args.index("--")], "--log-dir") is not None:
        yield LogDirArgs()
        return
    _remove_unheld(tempfile.gettempdir())
    if not torch_writes_output(args):
        yield LogDirArgs(["--log-dir", os.devnull])
        return
    directory, held = _held_directory()
    given = LogDirArgs(["--log-dir", directory])
    given.held = held
    try:
        yield given
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        os.close(held)


def _held_directory() -> tuple[str, int]:
    """A new log directory and the descriptor that holds its lock (not inherited by children)."""
    while True:
        directory = tempfile.mkdtemp(prefix=TORCH_LOG_PREFIX)
        try:
            held = os.open(directory, _DIRECTORY)
        except FileNotFoundError:  # removed as unheld already
            continue
        fcntl.flock(held, fcntl.LOCK_EX)  # waits while another launcher removes it as unheld
        try:
            now = os.stat(directory)
        except FileNotFoundError:
            now = None
        mine = os.fstat(held)
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return directory, held
        os.close(held)  # removed between its making and its lock: make another


def _remove_unheld(parent: str) -> None:
    """Removes the log directories in ``parent`` whose launcher has ended (nothing holds them);
    other users' and running launchers' are kept."""
    for left in glob.glob(os.path.join(glob.escape(parent), TORCH_LOG_PREFIX + "*")):
        try:
            fd = os.open(left, _DIRECTORY)
        except OSError:  # another user's (mode 0700), a link, or gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(left, ignore_errors=True)
        except OSError:  # held: its launcher runs
            pass
        finally:
            os.close(fd)


def main() -> None:
    argv = sys.argv[1:]
    directory = os.environ.pop(LOG_DIR_ENV, None)
    mask = Mask.from_environ(os.environ.pop(SECRET_NAMES_ENV, ""))
    if directory or mask:
        # The job (torchrun) is this process's child: its output is masked and copied to the run's
        # log, and torch's log directory is made here (the child gets it named, and runs torchrun
        # itself), so that it goes even when the child is killed (the OOM killer, kill -9).
        if directory:  # the child's watchdog keeps a stall with the run (agent/heartbeat/)
            os.environ[contract.STALL_RECORD_ENV] = directory
        with torch_log_dir(argv) if "--" in argv else contextlib.nullcontext(LogDirArgs()) as log_dir:
            keep = () if log_dir.held is None else (log_dir.held,)
            sys.exit(run_teed(directory, [sys.executable, *module_argv("agent.launch"), *log_dir, *argv], mask,
                              keep))
    # With the store shared between agents and workers (torch's default), an agent that joins a
    # later round as a new process (a node's container killed and started again) waits for
    # MASTER_ADDR in that round, which group rank 0 only publishes in its first round: the
    # round times out and the job dies. Unshared, every round publishes it; the workers' own
    # store is then made by the trainer (trainer.dist), bound to the node's address.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault(PREFIX_TEMPLATE_ENV, RANK_PREFIX)
    try:  # train.code: the node's own working directory, before any process (the zygote) starts
        snapshot = workdir.enter()
    except workdir.WorkDirError as exc:
        sys.exit(f"agent.launch: error: {exc}")
    args = torchrun_args(sys.argv[1:], dict(os.environ))
    from torch.distributed.run import main as torchrun

    gc.freeze()  # torch's objects, alive as long as the agent, out of its collections (and its zygote's)
    # The workers forked from a zygote of this process, which has torch (agent/zygote.py): forked
    # here, before any thread starts and before torch is patched below for the agent alone.
    forks = zygote.Zygote.start() if zygote.wanted() else None
    if forks is not None:
        zygote.install(forks)
    try:  # the node's GPUs, held for this job while this launcher lives (after the zygote's fork: a thread)
        hold = holds.from_environ(os.environ)  # kept: the hold ends with this process
    except holds.Held as exc:
        sys.exit(f"agent.launch: error: {exc}; stop that job, or give this job other GPUs (nodes[].gpu_ids)")
    address = option(args, "--local-addr")
    if address and binds_stores():  # before torch 2.8 the store listens on every address (agent.compat)
        bind_rendezvous_store(address)
    if elastic(args):
        keep_rendezvous_open_on_failure()
    watch_rendezvous(args)

    # The workers' heartbeats (agent/heartbeat/): this run's alone, gone with it.
    beats = heartbeat.prepare(os.environ.get(contract.HEARTBEAT_DIR_ENV))
    if beats is None:
        os.environ.pop(contract.HEARTBEAT_DIR_ENV, None)
    else:  # every worker beats on its collectives, whatever its program (agent/progress_hook)
        os.environ["PYTHONPATH"] = heartbeat.hooked_path(os.environ.get("PYTHONPATH"))
    watchdog = heartbeat.Watchdog.from_environ(beats)  # job.on_stall, job.stall_timeout
    if hold is not None and beats is not None:  # `ddp-deploy jobs` is told what the ranks are doing
        setting = heartbeat.stall_setting()
        hold.tell(lambda: contract.state(setting, heartbeat.read_beats(beats)))
    record = os.environ.pop(contract.STALL_RECORD_ENV, None)  # the launcher's, not the workers'
    group = formed.Watch(beats, record).start()  # a rank's heartbeat seen: kept with the run (agent/formed.py)
    if watchdog is not None:
        watchdog.start()
    relay = None
    if relays_output(argv):
        template = option(args, "--log-line-prefix-template") or os.environ.get(PREFIX_TEMPLATE_ENV)
        relay = Relay(template or TORCH_PREFIX_TEMPLATE, keep_tails=bool(os.environ.get(snapshot_hint.SNAPSHOT_ENV)))
        relay.install()  # after the zygote's: the relay's pipes are what the zygote hands its workers
    with torch_log_dir(argv) as log_dir:
        try:
            torchrun([*log_dir, *args])
        except BaseException:
            # job.on_stall: stop decided here: another node's stop ended these workers first (their
            # peers closed), which is this stop too, not a failure of this node
            if watchdog is not None and watchdog.stopping:
                watchdog.end()
            raise
        finally:  # a write into the code snapshot: say so, where the worker's error may name no path
            group.end()
            heartbeat.remove(beats)
            if relay is not None:
                relay.drain()
            snapshot_hint.explain(relay.lines() if relay is not None
                                  else snapshot_hint.tails(option([*log_dir, *args], "--log-dir")), snapshot=snapshot)


if __name__ == "__main__":
    exits.main(main)  # main(), without the interpreter's teardown of torch
