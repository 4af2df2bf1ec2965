"""One operator at a time: the fleet lock (deploy/job/lock.py), for real, on `connection: local` nodes.

Holders are real processes that take the lock as `launch` does (HOLDER below) and are raced,
killed, frozen or interrupted; the operator's side goes through the CLI. Each test has its own
lock directory (tests/conftest.py); where several local nodes must each have their own, as
separate machines would, ``{address}`` in it gives every node its directory.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deploy.job import lock
from deploy.errors import RuntimeFailure
from deploy.inventory import load, loads
from deploy.nodes.remote import Remote
from fakes import free_port
from waiting import wait_until

REPO = Path(__file__).resolve().parents[1]

# Says "ready", takes the fleet lock as `launch` does once it reads a line, says so, and holds it
# until the next line (or an interrupt); refused, it prints the one line the operator would see.
HOLDER = """
import os, sys
from deploy.job import lock
from deploy.errors import DeployError
from deploy.inventory import load
from deploy.nodes.remote import Remote

hosts = sys.argv[1]
inv = load(hosts)
print("ready", flush=True)
sys.stdin.readline()
with Remote(inv) as remote:
    try:
        with lock.held(inv, remote, "launch", hosts):
            print("acquired", os.getpid(), flush=True)
            sys.stdin.readline()
    except DeployError as e:
        print("refused", *e.lines(), flush=True)
        sys.exit(1)
"""


def _inventory(path: Path, nodes: list[tuple[str, str]], python: str = sys.executable) -> Path:
    """Local nodes (name, address) running the host runtime; storage beside the file."""
    nas = path.parent / "nas"
    path.write_text(json.dumps({  # JSON is YAML
        "job": {"name": "locktest", "runtime": "host", "max_restarts": 0},
        "rendezvous": {"node": nodes[0][0], "port": free_port(), "join_timeout": 60},
        "nodes": [{"name": name, "address": address, "connection": "local", "procs": 1} for name, address in nodes],
        "storage": {"data": {"host": str(nas / "data"), "container": "/data"},
                    "checkpoints": {"host": str(nas / "ckpt"), "container": "/ckpt"}, "min_free_gb": 0.01},
        "train": {"python": python,
                  "args": ["--dataset", "synthetic", "--epochs", "1000", "--synthetic-size", "256", "--batch-size", "32"]},
    }))
    return path


ONE = [("here", "127.0.0.1")]
FLEET = [("a", "127.0.0.1"), ("b", "127.0.0.2"), ("c", "127.0.0.3")]


@pytest.fixture
def per_node_locks(tmp_path, monkeypatch) -> Path:
    """Every local node its own lock directory, <dir>/<address>, as if each were its own machine."""
    d = tmp_path / "locks"
    d.mkdir()
    monkeypatch.setenv(lock.PATH_ENV, str(d / "{address}"))
    return d



class Holder:
    """A HOLDER process on ``hosts``."""

    def __init__(self, hosts: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(hosts)], cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ready(self) -> None:
        said = self.answer()
        assert said == "ready", said

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        return self.proc.stdout.readline().strip()

    def take(self) -> int:
        """Takes the lock now; its pid."""
        self.ready()
        self.go()
        said = self.answer()
        assert said.startswith("acquired "), said
        return int(said.split()[1])

    def let_go(self) -> int:
        self.proc.stdin.close()
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def holders():
    made: list[Holder] = []

    def make(hosts: Path) -> Holder:
        made.append(Holder(hosts))
        return made[-1]

    yield make
    for h in made:
        h.proc.send_signal(signal.SIGCONT)
        h.kill()


def _locks(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


WHO = f"{getpass.getuser()}@{socket.gethostname()}"


@pytest.mark.parametrize("second", [FLEET, [("z", "127.0.0.3"), ("y", "127.0.0.2"), ("x", "127.0.0.4")]],
                         ids=["the same fleet", "an overlapping fleet named and ordered otherwise"])
def test_two_operators_at_once_one_proceeds_and_the_other_is_told_who(
        tmp_path, per_node_locks, holders, second):
    first = _inventory(tmp_path / "first.yaml", FLEET)
    other = _inventory(tmp_path / "second.yaml", second)
    for _ in range(3):
        racers = [holders(first), holders(other)]
        for r in racers:
            r.ready()
        for r in racers:  # at the same moment: both wait for their line
            r.go()
        said = [r.answer() for r in racers]
        assert sorted(s.split()[0] for s in said) == ["acquired", "refused"], said
        winner, loser = (racers[0], racers[1]) if said[0].startswith("acquired") else (racers[1], racers[0])
        pid = int(said[racers.index(winner)].split()[1])
        refusal = said[racers.index(loser)]
        assert loser.proc.wait(timeout=60) == 1
        assert refusal.startswith("refused launch refused, nothing started: ")
        assert f" is locked by launch of job locktest by {WHO} (pid {pid}), started " in refusal
        assert refusal.endswith("if that command no longer runs: `ddp-deploy unlock --force`)")
        # The loser left nothing behind: only the winner's nodes are locked, by the winner.
        won = load(tmp_path / ("first.yaml" if winner is racers[0] else "second.yaml"))
        assert _locks(per_node_locks) == sorted(n.address for n in won.nodes)
        holders_seen = {json.loads((per_node_locks / a / "owner").read_text())["pid"] for a in _locks(per_node_locks)}
        assert holders_seen == {pid}
        assert winner.let_go() == 0
        assert _locks(per_node_locks) == []


def test_the_order_is_by_address_then_ssh_port_whatever_the_inventory_says():
    inv = loads("job: {name: j}\nrendezvous: {node: z}\nstorage:\n  data: {host: /d, container: /data}\n"
                "  checkpoints: {host: /c, container: /ckpt}\nnodes:\n"
                "  - {name: z, address: 10.0.0.3}\n"
                "  - {name: y, address: 10.0.0.1, ssh: {port: 2222}}\n"
                "  - {name: x, address: 10.0.0.2}\n")
    assert [n.name for n in lock.canonical(inv)] == ["y", "x", "z"]


def test_nodes_that_share_one_lock_directory_are_locked_once(tmp_path, fleet_lock_path):
    # Local nodes of one machine (and the test cluster's nodes) share /tmp: the lock is taken
    # on the first node, and is already ours on the others.
    inv = load(_inventory(tmp_path / "hosts.yaml", FLEET))
    with Remote(inv) as remote, lock.held(inv, remote, "deploy", "hosts.yaml") as held:
        assert held.nodes == ["a", "b", "c"]
        owner = json.loads((fleet_lock_path / "owner").read_text())
        assert owner["command"] == "deploy" and owner["job"] == "locktest" and owner["pid"] == os.getpid()
    assert not fleet_lock_path.exists()


def test_a_held_lock_s_heartbeat_keeps_it_fresh(tmp_path, fleet_lock_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_EVERY", 0.1)
    inv = load(_inventory(tmp_path / "hosts.yaml", ONE))
    with Remote(inv) as remote, lock.held(inv, remote, "launch", "hosts.yaml"):
        past = time.time() - 300
        os.utime(fleet_lock_path / "heartbeat", (past, past))
        deadline = time.time() + 30
        while time.time() < deadline and (fleet_lock_path / "heartbeat").stat().st_mtime < past + 60:
            time.sleep(0.1)
        seen = lock.survey(inv, remote).locks["here"]
        assert seen.quiet <= 2 and seen.stale() is None


def test_a_lock_whose_process_has_ended_is_refused_as_stale_until_unlock_clears_it(ddp, tmp_path, holders,
                                                                                  fleet_lock_path):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    crashed = holders(hosts)
    pid = crashed.take()
    crashed.kill()  # the operator's process dies holding the lock

    r = ddp(hosts, "deploy")
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith(f"error: deploy refused, nothing started: here is locked by launch of job locktest "
                               f"by {WHO} (pid {pid}), started ")
    assert r.stderr.rstrip().endswith(f" ago; the lock is stale: process {pid} on this machine has ended (clear it "
                                      "with `ddp-deploy unlock`, then run deploy again)")
    assert not (tmp_path / "nas").exists()  # nothing started

    r = ddp(hosts, "unlock")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"here: removed the lock of launch of job locktest by {WHO} (pid {pid}), started ")
    assert f"(process {pid} on this machine has ended)" in r.stdout
    assert not fleet_lock_path.exists()

    r = ddp(hosts, "deploy")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "nas/ckpt").is_dir() and not fleet_lock_path.exists()


def test_a_lock_without_heartbeat_for_a_minute_is_stale_though_its_process_exists(ddp, tmp_path, holders,
                                                                                fleet_lock_path):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    hung = holders(hosts)
    pid = hung.take()
    hung.proc.send_signal(signal.SIGSTOP)  # alive, but its heartbeat no longer beats
    past = time.time() - 300
    os.utime(fleet_lock_path / "heartbeat", (past, past))

    r = ddp(hosts, "launch")
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1
    assert f"here is locked by launch of job locktest by {WHO} (pid {pid})" in r.stderr
    assert "the lock is stale: no heartbeat for 30" in r.stderr and "`ddp-deploy unlock`" in r.stderr

    r = ddp(hosts, "unlock")  # stale: no --force needed
    assert r.exit_code == 0, r.output
    assert "here: removed the lock of launch of job locktest" in r.stdout and "(no heartbeat for 30" in r.stdout
    assert not fleet_lock_path.exists()
    hung.proc.send_signal(signal.SIGCONT)
    assert hung.let_go() == 0  # its release finds its lock gone and leaves the rest alone


def test_unlock_refuses_a_live_lock_without_force(ddp, tmp_path, holders, fleet_lock_path):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    live = holders(hosts)
    pid = live.take()
    refused = ddp(hosts, "launch")  # its hint is what clears a live lock: plain unlock would refuse it
    assert refused.exit_code == 1
    assert refused.stderr.rstrip().endswith("if that command no longer runs: `ddp-deploy unlock --force`)")

    r = ddp(hosts, "unlock")
    assert r.exit_code == 1
    assert r.stderr.startswith(f"error: unlock refused, nothing removed: here is locked by launch of job locktest "
                               f"by {WHO} (pid {pid}), started ")
    assert "--force" in r.stderr and fleet_lock_path.is_dir()

    r = ddp(hosts, "unlock", "--force")
    assert r.exit_code == 0, r.output
    assert "here: removed the lock of launch of job locktest" in r.stdout and "(live, --force)" in r.stdout
    assert not fleet_lock_path.exists()
    assert ddp(hosts, "unlock").stdout == "here: no lock\n"
    assert live.let_go() == 0


def test_unlock_names_the_nodes_it_cannot_reach_and_exits_1(ddp, tmp_path):
    hosts = tmp_path / "hosts.yaml"
    config = json.loads(_inventory(hosts, ONE).read_text())
    config["nodes"].append({"name": "away", "address": "127.0.0.1", "ssh": {"port": free_port(), "connect_timeout": 2},
                            "procs": 1})
    hosts.write_text(json.dumps(config))
    r = ddp(hosts, "unlock")
    assert r.exit_code == 1
    assert "here: no lock\n" in r.stdout and "away: unreachable: " in r.stdout
    assert r.stderr.startswith("error: unlock: not cleared on away (unreachable: ")


def test_the_lock_is_released_after_a_launch_refused_by_a_check(ddp, tmp_path, fleet_lock_path):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE, python="/nonexistent/bin/python")
    r = ddp(hosts, "launch")
    assert r.exit_code == 1 and "here torch: cannot run /nonexistent/bin/python" in r.stderr
    assert not fleet_lock_path.exists()


def test_the_lock_is_released_when_its_holder_is_interrupted_or_fails(tmp_path, holders, fleet_lock_path):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    holder = holders(hosts)
    holder.take()
    assert fleet_lock_path.is_dir()
    holder.proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert holder.proc.wait(timeout=60) != 0
    assert not fleet_lock_path.exists()

    inv = load(hosts)
    with pytest.raises(RuntimeError), Remote(inv) as remote, lock.held(inv, remote, "launch", str(hosts)):
        assert fleet_lock_path.is_dir()
        raise RuntimeError("the command failed")
    assert not fleet_lock_path.exists()


def test_dry_runs_name_the_lock_and_take_nothing(ddp, tmp_path, fleet_lock_path):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    r = ddp(hosts, "launch", "--dry-run")
    assert r.exit_code == 0
    assert f"[all] the fleet lock ({fleet_lock_path} on every node, taken in address order), held until the job " \
           "has started\n" in r.stdout
    r = ddp(hosts, "deploy", "--dry-run")
    assert r.exit_code == 0 and "[all] the fleet lock (" in r.stdout
    assert not fleet_lock_path.exists()


@pytest.mark.e2e
def test_launch_releases_the_lock_once_started_and_wait_follows_without_it(tmp_path, fleet_lock_path):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    env = {**os.environ, "DDP_DEPLOY_LOG": str(tmp_path / "debug.log")}
    deploy = [sys.executable, "-m", "deploy", "--hosts", str(hosts)]
    launch = subprocess.Popen([*deploy, "launch", "--wait"], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        said = [launch.stdout.readline()]
        while said[-1] and not said[-1].startswith("started locktest run "):
            said.append(launch.stdout.readline())
        assert said[-1], "".join(said)
        assert launch.poll() is None and not fleet_lock_path.exists()  # following, without the lock
    finally:
        launch.terminate()
        launch.wait(timeout=60)
        stopped = subprocess.run([*deploy, "stop"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 0, stopped.stderr
    assert not fleet_lock_path.exists()


# Whose machine holds the lock: told by machine id and boot id, not by the hostname alone.

def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=60)
    return gone.pid


THIS_MACHINE = "feedc0de" * 4
OTHER_MACHINE = "0123456789abcdef0123456789abcdef"
THIS_BOOT = Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@pytest.fixture
def this_machine(tmp_path, monkeypatch) -> str:
    """This machine's id, THIS_MACHINE, from a machine-id file of the test's own."""
    f = tmp_path / "machine-id"
    f.write_text(THIS_MACHINE + "\n")
    monkeypatch.setattr(lock, "MACHINE_ID", (str(tmp_path / "absent"), str(f)))
    return THIS_MACHINE


def _lock_by(path: Path, **owner) -> dict:
    """A lock directory as a holder would leave it, its heartbeat fresh; an owner field given as
    None is left out (owner files written before that field existed)."""
    fields = {"user": "alice", "host": socket.gethostname(), "pid": _dead_pid(), "command": "launch",
              "job": "locktest", "hosts": "/elsewhere/hosts.yaml", "started": "2026-01-01T00:00:00+00:00",
              "token": "f" * 32, "machine": THIS_MACHINE, "boot": THIS_BOOT, **owner}
    fields = {k: v for k, v in fields.items() if v is not None}
    path.mkdir()
    (path / "owner").write_text(json.dumps(fields))
    (path / "heartbeat").touch()
    return fields


def _seen(hosts: Path) -> lock.Seen:
    inv = load(hosts)
    with Remote(inv) as remote:
        return lock.survey(inv, remote).locks["here"]


def test_a_lock_appears_whole_free_or_with_its_owner_to_whoever_looks(
        tmp_path, fleet_lock_path, this_machine):
    """The taker is parked at the one step that puts its lock in place (a `mv` of our own on its
    PATH that waits for a file): meanwhile a look finds no lock, another operator takes it and is
    told so, and the parked taker then names that operator. Where the lock's directory came before
    its owner file, the look and the other operator would find a lock without owner."""
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    park, shims = tmp_path / "park", tmp_path / "bin"
    park.mkdir(), shims.mkdir()
    (shims / "mv").write_text(f'#!/bin/sh\n: > "{park}/at"\nwhile [ ! -e "{park}/go" ]; do sleep 0.05; done\n'
                              f'exec {shutil.which("mv")} "$@"\n')
    (shims / "mv").chmod(0o755)
    (tmp_path / "owner.json").write_bytes(lock.Owner.here("deploy", "locktest", str(hosts)).encode())
    with open(tmp_path / "owner.json", "rb") as owner:
        taker = subprocess.Popen(["sh", "-c", lock.TAKE, "sh", str(fleet_lock_path)], stdin=owner,
                                 stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"})
    try:
        wait_until(lambda: (park / "at").exists() or taker.poll() is not None, 60, "the taker's mv", interval=0.05)
        assert (park / "at").exists(), "the taker ended before its mv"
        started = time.monotonic()
        inv = load(hosts)
        with Remote(inv) as remote:
            assert lock.survey(inv, remote).locks["here"] is None
            other = lock.acquire(inv, remote, "launch", str(hosts))
            assert time.monotonic() - started < 5  # nobody waited for an owner file
            try:
                (park / "go").touch()
                out, _ = taker.communicate(timeout=60)
                assert taker.returncode == 0, out
                seen = lock.parse("here", out)
                assert seen is not None and seen.owner is not None and seen.owner.token == other.owner.token, out
                assert sorted(p.name for p in fleet_lock_path.parent.iterdir()) == [fleet_lock_path.name]
            finally:
                assert other.release() == []
        assert list(fleet_lock_path.parent.iterdir()) == []  # neither left a directory of its own beside it
    finally:
        (park / "go").touch()
        if taker.poll() is None:
            taker.kill()
        taker.wait(timeout=60)


def test_an_earlier_version_s_lock_is_named_by_its_owner_or_as_never_completed(
        tmp_path, fleet_lock_path, this_machine):
    """Versions before the whole lock made its directory, then wrote the owner file: one who looks
    in between waits a moment for it (a refusal then names who holds the lock), and says so where
    none comes."""
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    fleet_lock_path.mkdir()

    def write_owner() -> None:
        _lock_by(tmp_path / "whole")
        (tmp_path / "whole" / "owner").rename(fleet_lock_path / "owner")
    writer = threading.Timer(0.5, write_owner)
    writer.start()
    try:
        seen = _seen(hosts)
    finally:
        writer.join()
    assert seen.owner is not None and seen.owner.user == "alice", seen
    (fleet_lock_path / "owner").unlink()
    started = time.monotonic()
    seen = _seen(hosts)
    assert seen.owner is None and seen.holder().startswith("a ddp-deploy that has written no owner file (yet)")
    assert time.monotonic() - started < 10  # it waited a moment, not for ever


def test_this_machine_s_id_is_systemd_s_else_d_bus_s():
    there = [p for p in ("/etc/machine-id", "/var/lib/dbus/machine-id") if os.path.exists(p)]
    if not there:
        pytest.skip("this machine has no machine id")
    assert lock.machine_id() == Path(there[0]).read_text().strip() != ""


def test_a_lock_s_owner_names_this_machine_s_id_and_boot_id(this_machine):
    owner = json.loads(lock.Owner.here("launch", "j", "hosts.yaml").encode())
    assert (owner["machine"], owner["boot"]) == (this_machine, THIS_BOOT)


def test_a_live_lock_of_another_machine_with_this_hostname_is_not_stale(
        ddp, tmp_path, fleet_lock_path, this_machine):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    owner = _lock_by(fleet_lock_path, machine=OTHER_MACHINE)  # its pid does not exist here: it runs there

    seen = _seen(hosts)
    assert seen.stale() is None
    r = ddp(hosts, "unlock")
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith(f"error: unlock refused, nothing removed: here is locked by launch of job locktest "
                               f"by alice@{owner['host']} (pid {owner['pid']}, on another machine of that name), ")
    assert json.loads((fleet_lock_path / "owner").read_text()) == owner

    r = ddp(hosts, "launch")  # refused as live: wait, or --force if it is known to be gone
    assert r.exit_code == 1 and "on another machine of that name" in r.stderr and "the lock is stale" not in r.stderr

    past = time.time() - 300  # its heartbeat is what tells that it ended
    os.utime(fleet_lock_path / "heartbeat", (past, past))
    assert _seen(hosts).stale().startswith("no heartbeat for 30")
    r = ddp(hosts, "unlock")
    assert r.exit_code == 0, r.output
    assert not fleet_lock_path.exists()


def test_a_lock_of_this_machine_is_stale_once_its_process_ended(
        ddp, tmp_path, fleet_lock_path, this_machine):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    owner = _lock_by(fleet_lock_path, host="the-old-name")

    assert _seen(hosts).stale() == f"process {owner['pid']} on this machine has ended"
    r = ddp(hosts, "unlock")
    assert r.exit_code == 0, r.output
    assert f"(process {owner['pid']} on this machine has ended)" in r.stdout
    assert not fleet_lock_path.exists()


def test_a_lock_taken_before_the_last_boot_is_stale_whoever_has_its_pid_now(
        tmp_path, fleet_lock_path, this_machine):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    _lock_by(fleet_lock_path, pid=os.getpid(), boot="00000000-0000-0000-0000-000000000000")
    assert _seen(hosts).stale() == f"this machine has restarted since process {os.getpid()} took the lock"


@pytest.mark.parametrize("pid, stale", [("dead", True), ("live", False)])
def test_an_owner_without_machine_id_is_judged_by_hostname_and_pid_and_says_so(
        tmp_path, fleet_lock_path, this_machine, pid, stale):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    owner = _lock_by(fleet_lock_path, machine=None, boot=None, pid=_dead_pid() if pid == "dead" else os.getpid())
    why = _seen(hosts).stale()
    if stale:
        assert why == (f"process {owner['pid']} on this machine has ended (this machine told by its hostname "
                       f"{owner['host']}: the lock names no machine id)")
    else:
        assert why is None


def test_an_owner_without_machine_id_of_another_host_is_judged_by_heartbeat(
        tmp_path, fleet_lock_path, this_machine):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    _lock_by(fleet_lock_path, machine=None, boot=None, host=socket.gethostname() + "-not")
    assert _seen(hosts).stale() is None


def test_on_a_machine_without_machine_id_the_hostname_decides_and_the_reason_says_so(
        tmp_path, fleet_lock_path, monkeypatch):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    owner = _lock_by(fleet_lock_path, machine=OTHER_MACHINE)
    monkeypatch.setattr(lock, "MACHINE_ID", (str(tmp_path / "no-machine-id"),))
    assert _seen(hosts).stale() == (f"process {owner['pid']} on this machine has ended (this machine told by its "
                                    f"hostname {owner['host']}: this machine has no machine id "
                                    f"({tmp_path / 'no-machine-id'}))")


@pytest.mark.parametrize("pid", [10**30, -1, 0])
def test_an_owner_file_with_an_impossible_pid_is_a_stale_lock_not_a_crash(ddp, tmp_path, fleet_lock_path,
                                                                          this_machine, pid):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    _lock_by(fleet_lock_path, pid=pid)
    r = ddp(hosts, "unlock")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert f"(process {pid} on this machine has ended)" in r.stdout
    assert not fleet_lock_path.exists()


# A lock removed under its holder.

def test_a_lock_removed_under_its_heartbeat_makes_confirm_refuse_naming_the_node(
        tmp_path, fleet_lock_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_EVERY", 0.1)
    inv = load(_inventory(tmp_path / "hosts.yaml", ONE))
    with Remote(inv) as remote, lock.held(inv, remote, "launch", "hosts.yaml") as held:
        held.confirm("launch")  # ours: goes on
        (fleet_lock_path / "owner").unlink()  # `unlock --force`, from another terminal
        (fleet_lock_path / "heartbeat").unlink()
        fleet_lock_path.rmdir()
        deadline = time.time() + 30
        while "here" not in held.lost and time.time() < deadline:
            time.sleep(0.05)
        assert held.lost == {"here": None}
        with pytest.raises(RuntimeFailure) as e:
            held.confirm("launch")
    assert str(e.value).startswith("the fleet lock on here was removed (`ddp-deploy unlock --force`, or a reboot of "
                                   "the node) while this launch prepared; nothing was started (")


def _unlock_force(hosts: Path, tmp_path: Path) -> None:
    """A real `ddp-deploy unlock --force`, as another terminal would run it."""
    forced = subprocess.run([sys.executable, "-m", "deploy", "--hosts", str(hosts), "unlock", "--force"], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DDP_DEPLOY_LOG": str(tmp_path / "unlock.log")})
    assert forced.returncode == 0 and "here: removed the lock of " in forced.stdout, forced


@pytest.mark.parametrize("meanwhile", ["removed", "taken", "taken after a beat"])
def test_a_launch_whose_lock_is_removed_starts_nothing_and_names_the_node(
        ddp, tmp_path, holders, monkeypatch, fleet_lock_path, meanwhile):
    """Taken after a beat: the launch's heartbeat found the lock removed, then stopped beating,
    before the other operator took it; the launch still names who holds it now."""
    from deploy.engines.fleet import actions

    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    other = holders(hosts) if meanwhile.startswith("taken") else None
    took = []
    one_image = actions.one_image
    held: list[lock.FleetLock] = []
    if meanwhile == "taken after a beat":
        monkeypatch.setattr(lock, "HEARTBEAT_EVERY", 0.1)
        start = lock.FleetLock.__init__
        monkeypatch.setattr(lock.FleetLock, "__init__", lambda self, *a: (held.append(self), start(self, *a))[1])

    def then_unlocked(inv, remote):  # the last step of the preparation
        image = one_image(inv, remote)
        _unlock_force(hosts, tmp_path)
        if held:
            wait_until(lambda: "here" in held[0].lost, 30, "the heartbeat to find the lock removed")
            held[0]._stop.set()  # no beat after the other's take
            held[0]._beat.join()
        if other is not None:  # another operator's launch, let in by the unlock
            took.append(other.take())
        return image

    monkeypatch.setattr(actions, "one_image", then_unlocked)  # as launch looks it up
    try:
        r = ddp(hosts, "launch")
        assert r.exit_code == 1, r.output
        assert len(r.stderr.splitlines()) == 1
        if meanwhile == "removed":
            assert r.stderr.startswith("error: the fleet lock on here was removed (`ddp-deploy unlock --force`, or a "
                                       "reboot of the node) while this launch prepared; nothing was started (")
        else:
            assert r.stderr.startswith(f"error: the fleet lock on here was taken by launch of job locktest by {WHO} "
                                       f"(pid {took[0]}), started ")
            assert " while this launch prepared; nothing was started (" in r.stderr
            assert json.loads((fleet_lock_path / "owner").read_text())["pid"] == took[0]  # left to its holder
        assert "started locktest run" not in r.stdout
        inv = load(hosts)
        from deploy.job import runs
        assert not Path(runs.runs_dir(inv)).exists()  # no run record: nothing started
        status = ddp(hosts, "status", "--json")
        assert json.loads(status.stdout)[0]["state"] == "absent", status.output
    finally:
        ddp(hosts, "stop")


def test_a_deploy_whose_lock_is_removed_while_it_builds_ships_nothing(ddp, tmp_path, monkeypatch):
    # The docker runtime's build and ship cannot run here: a deployer whose build is the forced
    # unlock, handing over to the engine's ship step, and a record of what reaches the shipping.
    from deploy.images import deliveries, prepare

    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    shipped = []

    class UnlockedWhileItBuilds(prepare.Deployer):
        def run(self, remote, echo, *, build, ship):
            _unlock_force(hosts, tmp_path)
            ship("sha256:" + "0" * 64, {})

    monkeypatch.setattr(prepare, "deployer", UnlockedWhileItBuilds)
    class Recorded:  # a delivery that records what reaches it
        def ship(self, remote, image_id, held, report):
            shipped.append(image_id)
            return {}

    monkeypatch.setattr(deliveries, "for_inventory", lambda inv: Recorded())
    r = ddp(hosts, "deploy")
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("error: the fleet lock on here was removed (`ddp-deploy unlock --force`, or a "
                               "reboot of the node) while this deploy prepared; no image was shipped (")
    assert shipped == []


def test_unlock_shows_a_holder_whose_owner_file_holds_escape_sequences_as_text(ddp, tmp_path, fleet_lock_path,
                                                                                 this_machine):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    _lock_by(fleet_lock_path, user="\x1b]52;c;cm0gLXJmIH4=\x07eve", job="[red]j[/red]\x1b[2J")  # a planted owner file

    r = ddp(hosts, "unlock", "--force")
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output
    assert "\\x1b]52;c;cm0gLXJmIH4=\\x07eve" in r.stdout and "[red]j[/red]" in r.stdout


# An owner file any local user can plant: read bounded, shown as text, cut, never a crash.

SURVEY = """
import resource, sys
from deploy.inventory import load
from deploy.job import lock
from deploy.nodes.remote import Remote

inv = load(sys.argv[1])
with Remote(inv) as remote:
    seen = lock.survey(inv, remote).locks["here"]
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB
print(seen.holder())
"""


def _survey_peak(hosts: Path) -> tuple[int, str]:
    """The operator's peak memory (KiB) while it surveys the lock, and how it names the holder."""
    r = subprocess.run([sys.executable, "-c", SURVEY, str(hosts)], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    peak, holder = r.stdout.split("\n", 1)
    return int(peak), holder.strip()


def _planted(path: Path, size: int) -> None:
    """A lock directory whose owner file is ``size`` bytes: a few of text, then a sparse hole."""
    path.mkdir()
    with open(path / "owner", "wb") as f:
        f.write(b"planted by another user ")
        f.truncate(size)
    (path / "heartbeat").touch()


def test_a_planted_50_mb_owner_file_is_read_bounded_and_shown_cut(ddp, tmp_path, fleet_lock_path):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    _planted(fleet_lock_path, 16 << 10)
    small, _ = _survey_peak(hosts)
    shutil.rmtree(fleet_lock_path)
    _planted(fleet_lock_path, 50 << 20)
    big, holder = _survey_peak(hosts)
    assert big - small < 8 << 10, (small, big)  # KiB: of the 50 MB it read no more than of the 16 KiB
    assert holder.startswith("an owner file that names no ddp-deploy (planted by another user")
    assert len(holder) < 300, holder

    r = ddp(hosts, "deploy")
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1 and len(r.stderr) < 600, r.stderr[:600]
    assert "here is locked by an owner file that names no ddp-deploy (planted by another user" in r.stderr
    r = ddp(hosts, "unlock", "--force")
    assert r.exit_code == 0, r.output[:600]
    assert not fleet_lock_path.exists()


def test_the_node_side_programs_read_the_owner_file_only_through_its_bounded_reader():
    assert f'head -c {lock.OWNER_MAX} "$1/owner"' in lock.LOOK
    for name, program in (("LOOK", lock.LOOK), ("TAKE", lock.TAKE), ("BEAT", lock.BEAT), ("RELEASE", lock.RELEASE)):
        readers = [line for line in program.splitlines() if "/owner" in line and not line.lstrip().startswith("#")]
        unbounded = [line for line in readers if "head -c" not in line and ("cat " in line or "grep " in line)]
        assert unbounded == [], (name, unbounded)


GARBAGE = {
    "binary": bytes(range(256)) * 8,
    "a JSON list": b'["launch", "job"]',
    "nested past the parser's depth": b"[" * 12000,
    "an infinite pid": b'{"user": "u", "host": "h", "pid": 1e999, "command": "launch", "job": "j", "hosts": "/h",'
                       b' "started": "s"}',
    "a pid of 4000 digits": b'{"user": "u", "host": "h", "pid": ' + b"9" * 4000 + b', "command": "launch", '
                            b'"job": "j", "hosts": "/h", "started": "s"}',
    "fields that are not text": b'{"user": {"a": 1}, "host": ["h"], "pid": 1, "command": null, "job": 3, '
                                b'"hosts": "/h", "started": "s"}',
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_an_owner_file_naming_no_owner_is_shown_as_text_and_force_unlocked(
        ddp, tmp_path, fleet_lock_path, kind):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    fleet_lock_path.mkdir()
    (fleet_lock_path / "owner").write_bytes(GARBAGE[kind])
    (fleet_lock_path / "heartbeat").touch()
    r = ddp(hosts, "deploy")
    assert r.exit_code == 1 and r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert len(r.stderr.splitlines()) == 1 and len(r.stderr) < 800, r.stderr
    assert "here is locked by an owner file that names no ddp-deploy (" in r.stderr
    r = ddp(hosts, "unlock", "--force")
    assert r.exit_code == 0, r.output[:800]
    assert "here: removed the lock of an owner file that names no ddp-deploy (" in r.stdout
    assert not fleet_lock_path.exists()


def test_an_owner_whose_fields_are_long_is_named_with_each_field_cut(tmp_path, fleet_lock_path, this_machine):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    _lock_by(fleet_lock_path, user="u" * 3000, job="j" * 3000, pid=10**3000)
    holder = _seen(hosts).holder()
    assert len(holder) < 6 * lock.SHOWN and "u" * (lock.SHOWN - 1) + "…@" in holder, holder
