"""remote.py over real SSH: a throwaway sshd on 127.0.0.1 with generated keys.

Covers key auth, strict host-key checking (unknown and changed keys refused), accept-new,
refused auth and an unreachable port, each reported as one line naming the node."""

from __future__ import annotations

import json
import os
import shutil
import socket
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from deploy.cli import cli
from deploy.inventory import loads
from deploy.remote import Remote
from fakes import free_port

SSHD = "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(
    not (os.path.exists(SSHD) and shutil.which("ssh-keygen") and os.geteuid() == 0),
    reason="needs root, sshd and ssh-keygen")


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    d = tmp_path_factory.mktemp("sshd")
    _keygen(d / "host_key")
    _keygen(d / "client_key")
    _keygen(d / "other_key")
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.chmod(d, 0o755)
    port = free_port()
    (d / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1:{port}\nListenAddress 127.0.0.2:{port}\nListenAddress 127.0.0.3:{port}\nHostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\nPidFile none\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.DEVNULL)
    for _ in range(50):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    host_pub = (d / "host_key.pub").read_text().split()
    yield {"dir": d, "port": port, "host_key": f"{host_pub[0]} {host_pub[1]}"}
    proc.terminate()
    proc.wait()


def _inv(sshd, tmp_path, **kw):
    text, kh = _inventory_text(sshd, tmp_path, **kw)
    return loads(text), kh


def _inventory_text(sshd, tmp_path, *, key="client_key", known="good", policy="strict", port=None, nodes=1):
    d = sshd["dir"]
    kh = tmp_path / "known_hosts"
    p = port or sshd["port"]
    if known == "good":
        kh.write_text(f"[127.0.0.1]:{p} {sshd['host_key']}\n")
    elif known == "wrong":
        other = (d / "other_key.pub").read_text().split()
        kh.write_text(f"[127.0.0.1]:{p} {other[0]} {other[1]}\n")
    text = json.dumps({
        "job": {"name": "sshtest", "runtime": "host"},
        "rendezvous": {"node": "n1"},
        "ssh": {"user": "root", "port": p, "key": str(d / key), "known_hosts": str(kh),
                "host_key_policy": policy, "connect_timeout": 3},
        "nodes": [{"name": f"n{i}", "address": f"127.0.0.{i}"} for i in range(1, nodes + 1)],
        "storage": {"data": {"host": str(tmp_path / "data"), "container": "/data"},
                    "checkpoints": {"host": str(tmp_path / "ckpt"), "container": "/ckpt"}},
    })
    return text, kh


def _run(inv, argv):
    with Remote(inv) as r:
        return r.run_all(argv, check=False)["n1"]


def test_runs_an_argv_over_ssh_with_hostile_arguments_intact(sshd, tmp_path):
    inv, _ = _inv(sshd, tmp_path)
    hostile = "a'b $(id) `id`; echo pwned"
    res = _run(inv, ["printf", "%s", hostile])
    assert res.ok, res.summary()
    assert res.stdout == hostile


def test_unknown_host_key_is_refused_by_default(sshd, tmp_path):
    inv, _ = _inv(sshd, tmp_path, known="none")
    res = _run(inv, ["true"])
    assert res.exit_code is None and res.error.startswith("host key unknown")


def test_changed_host_key_is_refused_even_with_accept_new(sshd, tmp_path):
    for policy in ("strict", "accept-new"):
        inv, _ = _inv(sshd, tmp_path, known="wrong", policy=policy)
        res = _run(inv, ["true"])
        assert res.error and res.error.startswith("host key mismatch"), policy


def test_accept_new_records_an_unknown_key_then_uses_it(sshd, tmp_path):
    inv, kh = _inv(sshd, tmp_path, known="none", policy="accept-new")
    assert _run(inv, ["true"]).ok
    assert sshd["host_key"].split()[1] in kh.read_text()
    strict, _ = _inv(sshd, tmp_path, known="keep", policy="strict")
    assert _run(strict, ["true"]).ok


def test_wrong_key_is_reported_as_auth_refused(sshd, tmp_path):
    inv, _ = _inv(sshd, tmp_path, key="other_key")
    res = _run(inv, ["true"])
    assert res.error and res.error.startswith("auth refused")


def test_closed_port_is_reported_as_unreachable(sshd, tmp_path):
    inv, _ = _inv(sshd, tmp_path, port=free_port())
    res = _run(inv, ["true"])
    assert res.error and res.error.startswith("unreachable")


def test_cli_stop_reports_a_refused_node_as_one_line(sshd, tmp_path):
    inv, _ = _inv(sshd, tmp_path, key="other_key")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(json.dumps(inv.model_dump()))
    r = CliRunner().invoke(cli, ["--hosts", str(hosts), "stop"], env={"DDP_DEPLOY_LOG": str(tmp_path / "log")})
    assert r.exit_code == 1
    errors = r.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: n1: stop: auth refused")


def test_send_streams_bytes_into_a_remote_command_with_progress(sshd, tmp_path):
    inv, _ = _inv(sshd, tmp_path)
    target = tmp_path / "received"
    chunks = [os.urandom(300_000) for _ in range(4)]
    seen = []
    with Remote(inv) as r:
        res = r.send("n1", iter(chunks), ["sh", "-c", 'cat > "$1"', "sh", str(target)], seen.append)
    assert res.ok, res.summary()
    assert target.read_bytes() == b"".join(chunks)
    assert sum(seen) == 1_200_000


def test_accept_new_records_every_node_met_for_the_first_time_at_once(sshd, tmp_path):
    inv, kh = _inv(sshd, tmp_path, known="none", policy="accept-new", nodes=3)
    with Remote(inv) as r:
        assert all(res.ok for res in r.run_all(["true"], check=False).values())
    recorded = {line.split()[0] for line in kh.read_text().splitlines()}
    assert recorded == {f"[127.0.0.{i}]:{sshd['port']}" for i in (1, 2, 3)}  # none lost to a race
    strict, _ = _inv(sshd, tmp_path, known="keep", policy="strict", nodes=3)
    with Remote(strict) as r:
        assert all(res.ok for res in r.run_all(["true"], check=False).values())


def test_logs_follow_ends_on_one_ctrl_c(sshd, tmp_path):
    """The follow's threads wait on SSH reads that never end: one Ctrl-C closes them and exits."""
    text, _ = _inventory_text(sshd, tmp_path)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(text)
    run = tmp_path / "ckpt/.ddp-deploy/sshtest/n1"
    run.mkdir(parents=True)
    (run / "log").write_text("epoch 0 started\n")
    env = {**os.environ, "DDP_DEPLOY_LOG": str(tmp_path / "debug.log")}
    follow = subprocess.Popen([sys.executable, "-m", "deploy", "--hosts", str(hosts), "logs", "--follow"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        label, said = follow.stdout.readline().split(" | ", 1)  # torchrun's own line: the node, no rank
        assert (label.strip(), said) == ("n1", "epoch 0 started\n")
        follow.send_signal(signal.SIGINT)
        rc = follow.wait(timeout=15)
    finally:
        follow.kill()
    assert rc == 130
