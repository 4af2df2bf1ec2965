"""Small stand-ins shared by the unit tests: a free local port, a fake command on PATH, the start of a
fake ``docker``."""

from __future__ import annotations

import socket
import stat
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_command(tmp_path: Path, monkeypatch, name: str, script: str) -> Path:
    """Puts an executable ``name`` running ``script`` first on PATH (before /usr/bin and /bin)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text(script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return exe


FAKE_DOCKER_START = r"""#!PYTHON
import gzip, hashlib, io, json, os, sys, tarfile
d = os.environ["FAKE_DOCKER_DIR"]
a = sys.argv[1:]
def read(name, default=None):
    p = os.path.join(d, name)
    return open(p).read() if os.path.exists(p) else default
def write(name, text):  # whole or not at all: the nodes of one test share this directory
    tmp = os.path.join(d, f".{name}.{os.getpid()}")
    open(tmp, "w").write(text)
    os.replace(tmp, os.path.join(d, name))
"""
"""The start of a fake ``docker`` script: its arguments ``a``, and ``read`` / ``write`` of the files in
its state directory ``d`` ($FAKE_DOCKER_DIR), where the test sets what it answers."""
