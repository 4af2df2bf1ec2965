"""Says why a program could not write a file of its code: each is a link to the read-only snapshot.

With ``train.code`` the program runs in its node's own working directory (agent/workdir.py),
whose files of the code are links to the read-only snapshot of that code (deploy/job/codesync.py).
A new file there is the program's own; a write through one of those links fails with a bare
``Permission denied`` (``Read-only file system`` for root on the host runtime, whose snapshot is a
read-only mount): a ``checkpoint.pth`` the project holds (the program ran on a laptop first) is
synced as code, and the program's save then fails. Once the workers have ended, the launcher reads
what they printed (the relay's tails, or torchrun's log directory when ``--tee`` fills it) for
such an error on a path that leads into the snapshot, and prints one line per path: which file,
and what to do. torch.save (2.6 on) names only the file's directory: the line then names the
directory and the code's files there that are not Python, one of which it was. It works for any
program, whatever it prints otherwise, and reads only the end of each output: the error that
ended a worker is its last words. ``launch --wait`` takes the line into its own error line
(deploy/observe/failure.py, :func:`is_hint`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from typing import NamedTuple

from .contract import HINT_MARK as MARK, HINT_PREFIX as PREFIX, SNAPSHOT_ENV

DENIED = r"(?:Permission denied|Read-only file system)"
# The path a failed write names, as each writer words its error.
WRITE_ERRORS = (
    re.compile(r"\[Errno (?:13|30)\] " + DENIED + r": (?:'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\")"),  # Python
    re.compile(r"\bFile (.+?) cannot be opened\."),  # torch.save, older torch
    re.compile(r"cannot [a-z ]+'([^']+)': " + DENIED),  # coreutils (touch, mkdir, cp)
    re.compile(r"cannot create ([^:]+): " + DENIED),  # a shell's redirection
)
DIRECTORY_ERRORS = (
    re.compile(r"\] (\S+) open file failed with strerror: " + DENIED),  # torch.save, torch 2.6+: the directory
)
TAIL_BYTES = 64 << 10
MAX_LINES = 3


class Write(NamedTuple):
    """A failed write into the snapshot: the path as the program named it, and how it got there:
    ``link`` (a file of the code in the working directory), ``directory`` (torch.save's words: a
    directory in which a write failed on such a link) or ``snapshot`` (a path inside the snapshot
    itself, as ``Path(__file__).resolve()`` leads there)."""

    path: str
    kind: str


def written_paths(lines: Iterable[str], snapshot: str, cwd: str | None = None) -> list[Write]:
    """The failed writes into ``snapshot`` the ``lines`` show (relative paths taken from ``cwd``,
    default the current directory), each once, in order."""
    root = os.path.realpath(snapshot)
    here = cwd or os.getcwd()
    found: list[Write] = []
    for line in lines:
        for patterns, directory in ((WRITE_ERRORS, False), (DIRECTORY_ERRORS, True)):
            for pattern in patterns:
                for match in pattern.finditer(line):
                    named = next((g for g in match.groups() if g), "")
                    write = _classify(named, here, root, directory) if named else None
                    if write is not None and write not in found:
                        found.append(write)
    return found


def _classify(named: str, here: str, root: str, directory: bool) -> Write | None:
    path = os.path.join(here, named)
    real = os.path.realpath(path)
    if _under(os.path.realpath(os.path.dirname(os.path.abspath(path))), root) or (directory and _under(real, root)):
        return Write(named, "snapshot")
    if directory:
        return Write(named, "directory") if _under(real, os.path.realpath(here)) and _code_files(real, root) else None
    return Write(named, "link") if _under(real, root) else None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _code_files(directory: str, root: str) -> list[str]:
    """The names in ``directory`` that are links into the snapshot at ``root`` and not Python."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [n for n in names if not n.endswith(".py") and os.path.islink(os.path.join(directory, n))
            and _under(os.path.realpath(os.path.join(directory, n)), root)]


def _text(path: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in path)


def message(write: Write, ckpt_dir: str | None, snapshot: str | None = None, cwd: str | None = None) -> str:
    """One line: the path as the program named it (shown as text: it is the program's); for a
    directory, that directory and the code's files in it (``snapshot``) that are not Python."""
    where = f"$DDP_CKPT_DIR ({ckpt_dir})" if ckpt_dir else "$DDP_CKPT_DIR"
    todo = f"leave it out of train.code (train.code.ignore) so that the program writes its own, or write to {where}"
    if write.kind == "snapshot":
        return (f"{PREFIX}{_text(write.path)} is inside the {MARK} itself (a resolved path leads there, as "
                f"Path(__file__).resolve() does): write relative to the working directory, or to {where}")
    if write.kind == "link":
        return f"{PREFIX}{_text(write.path)} is a file of your code, a link to the {MARK}: it cannot be written; {todo}"
    files = _code_files(os.path.join(cwd or os.getcwd(), write.path), os.path.realpath(snapshot)) if snapshot else []
    which = ", ".join(_text(n) for n in files[:MAX_LINES]) + (f" and {len(files) - MAX_LINES} more"
                                                             if len(files) > MAX_LINES else "")
    shown = "the working directory" if os.path.normpath(write.path) == "." else _text(write.path)
    return (f"{PREFIX}a write in {shown} failed on a file of your code, a link to the {MARK} (torch names no file; "
            f"the code's files there that are not Python: {which or 'none'}); {todo}")



def tails(log_dir: str | None) -> Iterable[str]:
    """The last lines of every worker's output torchrun kept under ``log_dir`` (read as they are
    taken; none without a log directory)."""
    if not log_dir:
        return
    for dirpath, _dirs, files in os.walk(log_dir):
        for name in sorted(files):
            if not name.endswith(".log"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
                    yield from f.read().decode(errors="replace").splitlines()
            except OSError:
                continue


def explain(lines: Iterable[str], environ=os.environ, out=sys.stderr, snapshot: str | None = None) -> list[str]:
    """Prints (and returns) the lines for the failed writes through links into the snapshot (at
    ``snapshot``; default the current directory) that the workers' last ``lines`` show (the
    launcher's relay keeps them; :func:`tails` reads torchrun's files); nothing without a
    snapshot, and ``lines`` not read then."""
    if not environ.get(SNAPSHOT_ENV):
        return []
    snapshot = snapshot or os.getcwd()
    said = [message(w, environ.get("DDP_CKPT_DIR"), snapshot) for w in written_paths(lines, snapshot)[:MAX_LINES]]
    for line in said:
        out.write(line + "\n")
    out.flush()
    return said
