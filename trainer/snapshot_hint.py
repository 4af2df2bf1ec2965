"""Says why a program could not write into its working directory, when that is the code snapshot.

With ``train.code`` the program's working directory is the read-only snapshot of its code
(deploy/job/codesync.py): a tutorial's ``torch.save(state, "snapshot.pt")`` fails there with a bare
``Permission denied`` (``Read-only file system`` for root on the host runtime, whose snapshot is a
read-only mount), and torch's own message may name no path at all. Once the workers have ended,
the launcher reads what they printed (torchrun's log directory, which ``--tee`` fills on every
fleet launch) for such an error on a path inside the snapshot, and prints one line per path:
where it is and where to write instead. It works for any program, whatever it prints otherwise,
and reads only the end of each output: the error that ended a worker is its last words.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable

SNAPSHOT_ENV = "DDP_CODE_SNAPSHOT"
"""Set by ``ddp-deploy launch`` with train.code: the working directory is the code snapshot."""

DENIED = r"(?:Permission denied|Read-only file system)"
# The path a failed write names, as each writer words its error.
WRITE_ERRORS = (
    re.compile(r"\[Errno (?:13|30)\] " + DENIED + r": (?:'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\")"),  # Python
    re.compile(r"\] (\S+) open file failed with strerror: " + DENIED),  # torch.save, torch 2.6+
    re.compile(r"\bFile (.+?) cannot be opened\."),  # torch.save, older torch
    re.compile(r"cannot [a-z ]+'([^']+)': " + DENIED),  # coreutils (touch, mkdir, cp)
    re.compile(r"cannot create ([^:]+): " + DENIED),  # a shell's redirection
)
TAIL_BYTES = 64 << 10
MAX_LINES = 3


def written_paths(lines: Iterable[str], snapshot: str) -> list[str]:
    """The paths, as the program named them, of failed writes inside ``snapshot`` (relative ones
    are taken from the working directory, the snapshot), each once, in order."""
    root = os.path.realpath(snapshot)
    found: list[str] = []
    for line in lines:
        for pattern in WRITE_ERRORS:
            for match in pattern.finditer(line):
                named = next((g for g in match.groups() if g), "")
                where = os.path.realpath(os.path.join(root, named))
                if named and (where == root or where.startswith(root + os.sep)) and named not in found:
                    found.append(named)
    return found


def message(path: str, ckpt_dir: str | None) -> str:
    """One line: the path as the program named it (shown as text: it is the program's), or the
    working directory itself when that is all the error names (torch.save's, since torch 2.6)."""
    where = f"; write to $DDP_CKPT_DIR ({ckpt_dir})" if ckpt_dir else "; write to $DDP_CKPT_DIR"
    if os.path.normpath(path) == ".":
        return f"trainer.launch: the working directory is the read-only code snapshot: a file cannot be written there{where}"
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in path)
    return f"trainer.launch: {shown} is in the read-only code snapshot (the working directory){where}"


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


def explain(lines: Iterable[str], environ=os.environ, out=sys.stderr) -> list[str]:
    """Prints (and returns) the lines for the failed writes into the snapshot that the workers' last
    ``lines`` show (the launcher's relay keeps them; :func:`tails` reads torchrun's files); nothing
    without a snapshot, and ``lines`` not read then."""
    if not environ.get(SNAPSHOT_ENV):
        return []
    said = [message(p, environ.get("DDP_CKPT_DIR")) for p in written_paths(lines, os.getcwd())[:MAX_LINES]]
    for line in said:
        out.write(line + "\n")
    out.flush()
    return said
