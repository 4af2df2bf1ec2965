"""The pieces behind Remote without a network: the fan-out, the one place an exception becomes a
node's result, and where ~/.ssh/config sends a node (aliases, ProxyJump chains, precedence)."""

from __future__ import annotations

import os
import signal
import threading
import time

import paramiko
import pytest

from deploy.nodes.fanout import fan_out, outcome
from deploy.nodes.ssh import endpoint, read_config
from deploy.nodes.transport import NodeError, Result, TimedOut
from local_job import on_paper


def test_every_kind_of_failure_becomes_that_nodes_result_naming_the_cause():
    def raising(e):
        raise e
    assert outcome("n1", lambda: Result("n1", 0)).ok
    assert outcome("n1", raising, NodeError("auth refused for x")).error == "auth refused for x"
    assert outcome("n1", raising, TimedOut(60)).error == "timed out after 60 s"
    assert outcome("n1", raising, EOFError()).error == "connection lost: EOFError"
    assert outcome("n1", raising, BrokenPipeError(32, "Broken pipe")).error == "connection lost: [Errno 32] Broken pipe"
    assert outcome("n1", raising, KeyError("x")).error == "KeyError: 'x'"


def test_one_nodes_surprise_does_not_hide_the_others_results():
    def fn(node, x):
        if node == "bad":
            raise ValueError("surprise")
        return Result(node, x)
    got = fan_out({"a": 0, "bad": 0, "c": 3}, fn)
    assert [(n, r.exit_code, r.error) for n, r in got.items()] == [
        ("a", 0, None), ("bad", None, "ValueError: surprise"), ("c", 3, None)]


def test_ctrl_c_closes_what_the_waiting_threads_read_from_and_propagates_at_once():
    released = threading.Event()

    def stuck(node, _):
        released.wait(30)  # a dead node, or a follow: only closing its connection ends the wait
        return Result(node, None, error="closed")

    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        fan_out({"n1": None, "n2": None}, stuck, on_abort=released.set)
    assert released.is_set() and time.monotonic() - t0 < 5


def _inv(tmp_path, config: str, ssh: dict | None = None, node_ssh: dict | None = None):
    (tmp_path / "ssh_config").write_text(config)
    return on_paper([{"name": "n1", "address": "10.0.0.1", **({"ssh": node_ssh} if node_ssh else {})}],
                    job_fields={"runtime": "host"},
                    ssh={"config": str(tmp_path / "ssh_config"), "connect_timeout": 6, **(ssh or {})})


def _endpoint(inv):
    return endpoint(inv, inv.nodes[0], read_config(inv.ssh.config))


def test_the_ssh_host_is_looked_up_in_the_config_and_the_address_stays_the_nodes(tmp_path):
    inv = _inv(tmp_path, "Host n1-ssh\n  HostName 192.0.2.7\n  User admin\n  Port 2222\n  IdentityFile ~/k\n"
                         "  ServerAliveInterval 1\n  ServerAliveCountMax 4\n", node_ssh={"host": "n1-ssh"})
    ep = _endpoint(inv)
    assert (ep.host, ep.user, ep.port, ep.timeout, ep.via) == ("192.0.2.7", "admin", 2222, 6, None)
    assert ep.keys[0].endswith("/k") and not ep.keys[0].startswith("~")
    assert ep.silence == 4
    assert inv.nodes[0].address == "10.0.0.1"


def test_values_written_in_hosts_yaml_win_and_its_defaults_lose(tmp_path):
    config = "Host 10.0.0.*\n  User admin\n  Port 2222\n  IdentityFile /k\n  ConnectTimeout 20\n"
    ep = _endpoint(_inv(tmp_path, config))
    assert (ep.user, ep.port, ep.keys, ep.timeout) == ("admin", 2222, ("/k",), 6)
    ep = _endpoint(_inv(tmp_path, config, node_ssh={"user": "root", "port": 22, "key": "/mine"}))
    assert (ep.user, ep.port, ep.keys) == ("root", 22, ("/mine",))
    assert _endpoint(_inv(tmp_path, config, ssh={"config": None})).port == 22


def test_a_proxyjump_chain_is_resolved_hop_by_hop_through_the_config(tmp_path):
    ep = _endpoint(_inv(tmp_path, "Host 10.0.0.1\n  ProxyJump ops@outer:2200,inner\n"
                                  "Host outer\n  HostName 192.0.2.1\nHost inner\n  HostName 192.0.2.2\n  User jump\n"))
    inner = ep.via
    assert (inner.host, inner.user, inner.port) == ("192.0.2.2", "jump", 22)
    outer = inner.via
    assert (outer.host, outer.user, outer.port, outer.via) == ("192.0.2.1", "ops", 2200, None)


def test_a_wildcard_proxyjump_does_not_make_the_jump_host_jump_through_itself(tmp_path):
    ep = _endpoint(_inv(tmp_path, "Host *\n  ProxyJump bastion\nHost bastion\n  HostName 192.0.2.9\n"))
    assert ep.via.host == "192.0.2.9" and ep.via.via is None


def test_a_proxyjump_loop_is_refused_with_its_cause(tmp_path):
    with pytest.raises(NodeError, match="ProxyJump hops"):
        _endpoint(_inv(tmp_path, "Host a\n  ProxyJump b\nHost b\n  ProxyJump a\nHost 10.0.0.1\n  ProxyJump a\n"))


def test_no_config_file_is_no_config():
    assert read_config("/nonexistent/ssh_config").lookup("x") == paramiko.SSHConfig().lookup("x")


def test_a_command_that_ends_before_reading_its_stdin_gives_its_exit_code_not_a_lost_connection():
    """A refusal that exits before reading its stdin (a lock program's, under a planted lock root)
    is that exit code: taken for a lost connection, the node would be skipped and its lock with it."""
    import time
    from types import SimpleNamespace

    from deploy.nodes.transport import LocalTransport

    def late():
        time.sleep(0.5)  # the command has ended by now: the bytes stay buffered until the close
        yield b"owner\n"

    r = LocalTransport().send(SimpleNamespace(name="here"), late(), ["sh", "-c", "exit 3"], lambda n: None, 30)
    assert r.connected and r.exit_code == 3, r
