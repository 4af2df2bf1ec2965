"""remote.py over real SSH: a throwaway sshd on 127.0.0.1 with generated keys.

Covers key auth, strict host-key checking (unknown and changed keys refused), accept-new,
refused auth and an unreachable port, each reported as one line naming the node."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.inventory import loads
from deploy.nodes.remote import Remote
from fakes import free_port
from procs import children_of
from sshd import SSHD, start_sshd
from local_job import inventory

pytestmark = pytest.mark.skipif(
    not (os.path.exists(SSHD) and shutil.which("ssh-keygen") and os.geteuid() == 0),
    reason="needs root, sshd and ssh-keygen")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    proc, info = start_sshd(tmp_path_factory.mktemp("sshd"), free_port())
    yield info
    proc.terminate()
    proc.wait()


def _inv(sshd, tmp_path, **kw):
    text, kh = _inventory_text(sshd, tmp_path, **kw)
    return loads(text), kh


def _inventory_text(sshd, tmp_path, *, key="client_key", known="good", policy="strict", port=None, nodes=1,
                    ssh=None, node_ssh=None):
    d = sshd["dir"]
    kh = tmp_path / "known_hosts"
    p = port or sshd["port"]
    if known == "good":
        kh.write_text(f"[127.0.0.1]:{p} {sshd['host_key']}\n")
    elif known == "wrong":
        other = (d / "other_key.pub").read_text().split()
        kh.write_text(f"[127.0.0.1]:{p} {other[0]} {other[1]}\n")
    text = json.dumps(inventory(
        [{"name": f"n{i}", "address": f"127.0.0.{i}", **({"ssh": node_ssh} if node_ssh else {})}
         for i in range(1, nodes + 1)], job="sshtest", nas=tmp_path, job_fields={"runtime": "host"},
        ssh=ssh or {"user": "root", "port": p, "key": str(d / key), "known_hosts": str(kh),
                    "host_key_policy": policy, "connect_timeout": 3}))
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


def test_cli_stop_reports_a_refused_node_as_one_line(ddp, sshd, tmp_path):
    inv, _ = _inv(sshd, tmp_path, key="other_key")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(json.dumps(inv.model_dump()))
    r = ddp(hosts, "stop")
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


def _aliased(sshd, tmp_path, config_text: str, **ssh):
    """One node, 127.0.0.1, that hosts.yaml names only by the alias ``n1-alias`` of ``config``."""
    (tmp_path / "ssh_config").write_text(config_text)
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{sshd['port']} {sshd['host_key']}\n")
    settings = {"known_hosts": str(kh), "config": str(tmp_path / "ssh_config"), "connect_timeout": 3, **ssh}
    text, _ = _inventory_text(sshd, tmp_path, ssh=settings, node_ssh={"host": "n1-alias"}, known="keep")
    return loads(text)


def test_a_host_alias_of_the_ssh_config_gives_hostname_user_port_and_key(sshd, tmp_path):
    d = sshd["dir"]
    inv = _aliased(sshd, tmp_path, f"Host n1-alias\n  HostName 127.0.0.1\n  User root\n  Port {sshd['port']}\n"
                                    f"  IdentityFile {d}/client_key\n")
    res = _run(inv, ["sh", "-c", 'echo "$USER ${SSH_CONNECTION##* }"'])
    assert res.ok, res.summary()
    assert res.stdout.split() == ["root", str(sshd["port"])]


def test_user_port_and_key_written_in_hosts_yaml_win_over_the_ssh_config(sshd, tmp_path):
    d = sshd["dir"]
    config = f"Host n1-alias\n  HostName 127.0.0.1\n  User nobody\n  Port {free_port()}\n  IdentityFile {d}/other_key\n"
    assert _run(_aliased(sshd, tmp_path, config), ["true"]).error.startswith("unreachable")  # the config's port
    inv = _aliased(sshd, tmp_path, config, user="root", port=sshd["port"], key=str(d / "client_key"))
    assert _run(inv, ["true"]).ok


def test_without_the_ssh_config_an_alias_is_an_unreachable_name(sshd, tmp_path):
    inv = _aliased(sshd, tmp_path, f"Host n1-alias\n  HostName 127.0.0.1\n  Port {sshd['port']}\n",
                   config=None, port=sshd["port"], key=str(sshd["dir"] / "client_key"))
    res = _run(inv, ["true"])
    assert res.error.startswith("unreachable: root@n1-alias:"), res.error


def test_a_jump_host_that_cannot_be_reached_is_named_as_the_jump_host(sshd, tmp_path):
    """ProxyJump is taken: the node itself is up, only the jump host's port is closed."""
    closed = free_port()
    inv = _aliased(sshd, tmp_path, f"Host n1-alias\n  HostName 127.0.0.1\n  ProxyJump root@127.0.0.2:{closed}\n",
                   port=sshd["port"], key=str(sshd["dir"] / "client_key"))
    res = _run(inv, ["true"])
    assert res.error.startswith(f"unreachable: root@127.0.0.2:{closed}"), res.error
    assert res.error.endswith(f"(the jump host to root@127.0.0.1:{sshd['port']})")


def test_a_jump_host_is_checked_against_known_hosts_like_a_node(sshd, tmp_path):
    """Fabric's own ProxyJump would accept any key of the jump host: here an unknown one is refused."""
    inv = _aliased(sshd, tmp_path, "Host n1-alias\n  HostName 127.0.0.1\n  ProxyJump 127.0.0.2\n",
                   port=sshd["port"], key=str(sshd["dir"] / "client_key"))
    res = _run(inv, ["true"])
    assert res.error.startswith(f"host key unknown for root@127.0.0.2:{sshd['port']}"), res.error
    (tmp_path / "known_hosts").write_text(
        "".join(f"[127.0.0.{i}]:{sshd['port']} {sshd['host_key']}\n" for i in (1, 2)))
    assert _run(inv, ["true"]).ok


def _tree(pid: int) -> list[int]:
    return [pid, *(p for c in children_of(pid) for p in _tree(c))]


def test_a_node_that_stops_answering_costs_seconds_not_the_commands_timeout(tmp_path):
    """sshd and its sessions stopped (SIGSTOP): the kernel still acknowledges every packet, only
    the SSH server is silent. The open connection is given up on its keepalives, a new one on
    the banner; each within connect_timeout, not the command's 60 s (before: the open connection
    waited for its channel for paramiko's hour, a new one 15 s for the banner)."""
    (tmp_path / "own-sshd").mkdir()
    (tmp_path / "run").mkdir()
    proc, info = start_sshd(tmp_path / "own-sshd", free_port())
    try:
        inv, _ = _inv(info, tmp_path / "run")  # connect_timeout: 3
        with Remote(inv) as r:
            assert r.run_all(["true"], timeout=60)["n1"].ok
            stopped = _tree(proc.pid)
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            try:
                took, errors = [], []
                for _ in range(2):
                    t0 = time.monotonic()
                    errors.append(r.run_all(["true"], timeout=60, check=False)["n1"].error)
                    took.append(time.monotonic() - t0)
            finally:
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
    finally:
        proc.terminate()
        proc.wait()
    print("a silent node cost", [f"{t:.1f} s" for t in took])
    assert errors[0].startswith(f"connection lost: root@127.0.0.1:{info['port']} "), errors  # keepalive or channel
    assert errors[1] == f"unreachable: root@127.0.0.1:{info['port']} did not answer within 3 s", errors
    assert took[0] < 3 * 4 / 3 + 1.5 and took[1] < 3 + 1.5, took
