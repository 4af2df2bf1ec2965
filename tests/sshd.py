"""A throwaway sshd on 127.0.0.1-3 with generated keys, for tests of the SSH transport."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def start_sshd(d: Path, port: int) -> tuple[subprocess.Popen, dict]:
    """sshd listening on 127.0.0.{1,2,3}:``port``, root login with ``d/client_key`` only;
    returns the process and {dir, port, host_key ('TYPE BASE64')}."""
    keygen(d / "host_key")
    keygen(d / "client_key")
    keygen(d / "other_key")
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.chmod(d, 0o755)
    listen = "".join(f"ListenAddress 127.0.0.{i}:{port}\n" for i in (1, 2, 3))
    (d / "sshd_config").write_text(
        f"{listen}HostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\nPidFile none\nAllowTcpForwarding yes\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.DEVNULL)
    for _ in range(50):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    host_pub = (d / "host_key.pub").read_text().split()
    return proc, {"dir": d, "port": port, "host_key": f"{host_pub[0]} {host_pub[1]}"}
