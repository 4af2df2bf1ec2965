"""Small stand-ins shared by the unit tests: a free local port, a fake command on PATH."""

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
