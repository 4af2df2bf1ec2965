"""One command at a time per job, jobs side by side: the job's lock (deploy/job/lock.py), for real,
on `connection: local` nodes.

Holders are real processes that take the locks as a command does (HOLDER below) and are raced,
killed, frozen or interrupted; the operator's side goes through the CLI. Each test has its own
root of the locks (tests/conftest.py); where several local nodes must each have their own, as
separate machines would, ``{address}`` in it gives every node its root.
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
from local_job import local_hosts
from waiting import wait_until

REPO = Path(__file__).resolve().parents[1]

# Says "ready", takes the locks of argv[2] (default: launch) as that command does once it reads a
# line, says so, and holds them until the next line (or an interrupt); refused, it prints the one
# line the operator would see.
HOLDER = """
import os, sys
from deploy.job import lock
from deploy.errors import DeployError
from deploy.inventory import load
from deploy.nodes.remote import Remote

hosts = sys.argv[1]
command = sys.argv[2] if len(sys.argv) > 2 else "launch"
inv = load(hosts)
print("ready", flush=True)
sys.stdin.readline()
with Remote(inv) as remote:
    try:
        with lock.held(inv, remote, command, hosts):
            print("acquired", os.getpid(), flush=True)
            sys.stdin.readline()
    except DeployError as e:
        print("refused", *e.lines(), flush=True)
        sys.exit(1)
"""


def _inventory(path: Path, nodes: list[tuple[str, str]], python: str = sys.executable, job: str = "locktest",
               runtime: str = "host") -> Path:
    """Local nodes (name, address) running the host runtime (or ``runtime``); storage beside the file."""
    return local_hosts(path.parent, name=path.name, job=job, nodes=[{"name": n, "address": a} for n, a in nodes],
                       job_fields={"runtime": runtime}, train={
                           "python": python,
                           "args": ["--dataset", "synthetic", "--epochs", "1000", "--synthetic-size", "256",
                                    "--batch-size", "32"]})


ONE = [("here", "127.0.0.1")]
FLEET = [("a", "127.0.0.1"), ("b", "127.0.0.2"), ("c", "127.0.0.3")]


@pytest.fixture
def fleet_lock_path(fleet_lock_path) -> Path:
    """The lock of this module's job (``locktest``) under the test's own root of the locks."""
    return fleet_lock_path / "job-locktest"


@pytest.fixture
def per_node_locks(tmp_path, monkeypatch) -> Path:
    """Every local node its own lock directory, <dir>/<address>, as if each were its own machine."""
    d = tmp_path / "locks"
    d.mkdir()
    monkeypatch.setenv(lock.ROOT_ENV, str(d / "{address}"))
    return d



class Holder:
    """A HOLDER process on ``hosts``."""

    def __init__(self, hosts: Path, command: str = "launch") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(hosts), command], cwd=REPO, text=True,
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

    def make(hosts: Path, command: str = "launch") -> Holder:
        made.append(Holder(hosts, command))
        return made[-1]

    yield make
    for h in made:
        h.proc.send_signal(signal.SIGCONT)
        h.kill()


JOB_LOCK = "job-locktest"


def _locks(d: Path) -> list[str]:
    """The addresses whose own root of the locks holds the job's lock."""
    return sorted(p.name for p in d.iterdir() if (p / JOB_LOCK).exists())


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
        holders_seen = {json.loads((per_node_locks / a / JOB_LOCK / "owner").read_text())["pid"] for a in _locks(per_node_locks)}
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
    # Local nodes of one machine (and nodes sharing a home directory) share their locks: each is
    # taken on the first node, and is already ours on the others.
    inv = load(_inventory(tmp_path / "hosts.yaml", FLEET))
    with Remote(inv) as remote, lock.held(inv, remote, "deploy", "hosts.yaml") as held:
        assert held.taken == [(JOB_LOCK, n) for n in ("a", "b", "c")]
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
        seen = lock.survey(inv, remote, JOB_LOCK).locks["here"]
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
    assert f"[all] the lock of job locktest ({fleet_lock_path} on every node, taken in address order), held until " \
           "the job has started\n" in r.stdout
    r = ddp(hosts, "deploy", "--dry-run")
    assert r.exit_code == 0 and f"[all] the lock of job locktest ({fleet_lock_path} on every node, taken in address " \
                                "order), held while deploy runs\n" in r.stdout
    shipping = _inventory(tmp_path / "docker.yaml", ONE, runtime="docker")  # a deploy that ships an image
    r = ddp(shipping, "deploy", "--dry-run")
    image = fleet_lock_path.parent / lock.image_key(load(shipping))
    assert r.exit_code == 0 and f"[all] the locks of its image and of job locktest ({image} and {fleet_lock_path} " \
                                "on every node, taken in address order), held while deploy runs\n" in r.stdout
    assert not fleet_lock_path.exists()


@pytest.mark.e2e
def test_launch_releases_the_lock_once_started_and_another_job_runs_beside(tmp_path, fleet_lock_path):
    """``launch --wait`` follows without the lock; and another job (its own name and port) starts
    on the same node while this one runs, the two training side by side; ``jobs`` lists both while
    they run, and neither once they are stopped."""
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    beside = _inventory(tmp_path / "beside.yaml", ONE, job="beside")
    env = {**os.environ, "DDP_DEPLOY_LOG": str(tmp_path / "debug.log")}
    deploy = [sys.executable, "-m", "deploy", "--hosts", str(hosts)]
    other = [sys.executable, "-m", "deploy", "--hosts", str(beside)]
    launch = subprocess.Popen([*deploy, "launch", "--wait"], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        said = [launch.stdout.readline()]
        while said[-1] and not said[-1].startswith("started locktest run "):
            said.append(launch.stdout.readline())
        assert said[-1], "".join(said)
        assert launch.poll() is None and not fleet_lock_path.exists()  # following, without the lock
        second = subprocess.run([*other, "launch"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr
        assert second.stdout.startswith("started beside run "), second.stdout
        for argv in (deploy, other):
            states = subprocess.run([*argv, "status", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                                    timeout=120)
            assert [n["state"] for n in json.loads(states.stdout)] == ["running"], states.stdout
        # the fleet view, from either inventory: both jobs, from what the node's kernel says
        seen = subprocess.run([*other, "jobs", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        assert seen.returncode == 0, seen.stderr
        listed = json.loads(seen.stdout)
        # the node is this whole machine: another test's job running meanwhile is listed too
        runs = {said[-1].split()[3]: "locktest", second.stdout.split()[3]: "beside"}
        ours = [j for j in listed["jobs"] if j["run"] in runs]
        assert {j["run"]: j["job"] for j in ours} == runs and listed["unanswered"] == {}, listed
        assert all(j["uid"] == os.getuid() and list(j["nodes"]) == ["here"] for j in ours)
        table = subprocess.run([*deploy, "jobs"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert table.returncode == 0 and "locktest" in table.stdout and "beside" in table.stdout, table.stdout
    finally:
        launch.terminate()
        launch.wait(timeout=60)
        stopped = [subprocess.run([*argv, "stop"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
                   for argv in (deploy, other)]
    assert [s.returncode for s in stopped] == [0, 0], [s.stderr for s in stopped]
    assert not fleet_lock_path.exists()
    after = subprocess.run([*deploy, "jobs", "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert after.returncode == 0 and not [j for j in json.loads(after.stdout)["jobs"] if j["run"] in runs], after.stdout


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
        return lock.survey(inv, remote, JOB_LOCK).locks["here"]


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
        taker = subprocess.Popen(["sh", "-c", lock.TAKE, "sh", str(fleet_lock_path.parent), JOB_LOCK], stdin=owner,
                                 stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"})
    try:
        wait_until(lambda: (park / "at").exists() or taker.poll() is not None, 60, "the taker's mv", interval=0.05)
        assert (park / "at").exists(), "the taker ended before its mv"
        started = time.monotonic()
        inv = load(hosts)
        with Remote(inv) as remote:
            assert lock.survey(inv, remote, JOB_LOCK).locks["here"] is None
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
        (fleet_lock_path / "boot").unlink()
        fleet_lock_path.rmdir()
        deadline = time.time() + 30
        while (JOB_LOCK, "here") not in held.lost and time.time() < deadline:
            time.sleep(0.05)
        assert held.lost == {(JOB_LOCK, "here"): None}
        with pytest.raises(RuntimeFailure) as e:
            held.confirm("launch")
    assert str(e.value).startswith("the lock of job locktest on here was removed (`ddp-deploy unlock --force`, or a reboot of "
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
            wait_until(lambda: (JOB_LOCK, "here") in held[0].lost, 30, "the heartbeat to find the lock removed")
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
            assert r.stderr.startswith("error: the lock of job locktest on here was removed (`ddp-deploy unlock --force`, or a "
                                       "reboot of the node) while this launch prepared; nothing was started (")
        else:
            assert r.stderr.startswith(f"error: the lock of job locktest on here was taken by launch of job locktest by {WHO} "
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
    from deploy.images import prepare, ways

    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    shipped = []

    class UnlockedWhileItBuilds(prepare.Deployer):
        def run(self, remote, echo, *, build, ship, view=None):
            _unlock_force(hosts, tmp_path)
            ship("sha256:" + "0" * 64, {})

    monkeypatch.setattr(prepare, "deployer", UnlockedWhileItBuilds)
    class Recorded:  # a delivery that records what reaches it
        def ship(self, remote, image_id, held, report):
            shipped.append(image_id)
            return {}

    monkeypatch.setattr(ways, "for_inventory", lambda inv: Recorded())
    r = ddp(hosts, "deploy")
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("error: the lock of job locktest on here was removed (`ddp-deploy unlock --force`, or a "
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
    seen = lock.survey(inv, remote, "job-locktest").locks["here"]
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


# Jobs side by side.

def test_two_jobs_take_their_locks_at_the_same_moment_and_both_proceed(tmp_path, per_node_locks, holders):
    """Another job of the same fleet (another user's, on a shared server) is never refused, nor
    made to wait, by this job's launch; nor is the deploy of another job's other image."""
    first = _inventory(tmp_path / "first.yaml", FLEET)
    other = _inventory(tmp_path / "other.yaml", FLEET, job="otherjob")
    for command in ("launch", "deploy"):
        racers = [holders(first, command), holders(other, command)]
        for r in racers:
            r.ready()
        for r in racers:
            r.go()
        said = [r.answer() for r in racers]
        assert [s.split()[0] for s in said] == ["acquired", "acquired"], said
        assert _locks(per_node_locks) == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        assert all((per_node_locks / a / "job-otherjob").is_dir() for a in _locks(per_node_locks))
        assert [r.let_go() for r in racers] == [0, 0]


def test_two_deploys_of_one_image_are_one_at_a_time_whatever_their_jobs(tmp_path, holders):
    """The image's lock: two deploys of one image would ship it to the same nodes twice at once.
    (Only locks are taken here: no image is built or shipped.)"""
    first = _inventory(tmp_path / "first.yaml", ONE, runtime="docker")
    other = _inventory(tmp_path / "other.yaml", ONE, job="otherjob", runtime="docker")
    deploying = holders(first, "deploy")
    pid = deploying.take()
    second = holders(other, "deploy")
    second.ready()
    second.go()
    said = second.answer()
    assert said.startswith(f"refused deploy refused, nothing started: here is locked by deploy of job locktest by "
                           f"{WHO} (pid {pid}), started "), said
    assert second.proc.wait(timeout=60) == 1
    launching = holders(other, "launch")  # the other job's launch needs no image lock
    launching.take()
    assert launching.let_go() == 0 and deploying.let_go() == 0


def test_wait_lock_waits_for_a_live_holder_and_then_takes_the_lock(tmp_path, holders, fleet_lock_path):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    holder = holders(hosts)
    pid = holder.take()
    told: list[str] = []
    inv = load(hosts)
    letting_go = threading.Timer(1.5, holder.let_go)
    letting_go.start()
    try:
        with Remote(inv) as remote:
            waited = lock.acquire(inv, remote, "launch", str(hosts), wait_s=60, waiting=told.append)
            try:
                assert json.loads((fleet_lock_path / "owner").read_text())["token"] == waited.owner.token
            finally:
                assert waited.release() == []
    finally:
        letting_go.join()
    assert len(told) == 1 and told[0].startswith("waiting up to ")
    assert f" s for the lock: here is locked by launch of job locktest by {WHO} (pid {pid}), started " in told[0]


def test_wait_lock_gives_up_after_its_seconds_naming_the_holder(ddp, tmp_path, holders):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    pid = holders(hosts).take()
    started = time.monotonic()
    r = ddp(hosts, "launch", "--wait-lock", "1")
    assert r.exit_code == 1, r.output
    assert time.monotonic() - started >= 1
    waiting, refused = r.stderr.splitlines()
    assert waiting.startswith("warning: waiting up to 1 s for the lock: here is locked by launch of job locktest")
    assert refused.startswith(f"error: launch refused, nothing started: here is locked by launch of job locktest by "
                              f"{WHO} (pid {pid}), started ")
    assert "; waited 1 s for it (" in refused
    assert not (tmp_path / "nas").exists()


def test_wait_lock_does_not_wait_for_a_stale_lock(ddp, tmp_path, holders):
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    crashed = holders(hosts)
    pid = crashed.take()
    crashed.kill()
    started = time.monotonic()
    r = ddp(hosts, "deploy", "--wait-lock", "120")
    assert r.exit_code == 1, r.output
    assert time.monotonic() - started < 60
    assert f"the lock is stale: process {pid} on this machine has ended" in r.stderr


@pytest.mark.parametrize("planted", ["writable by all", "another user's", "a link"])
def test_a_root_of_the_locks_that_another_user_can_write_is_refused(ddp, tmp_path, planted, monkeypatch):
    """Where another user could plant, rename or remove the locks, they are not locks: the command
    is refused, naming the directory, with nothing taken or started."""
    root = tmp_path / "locks"
    if planted == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
    else:
        root.mkdir(mode=0o777 if planted == "writable by all" else 0o700)
        root.chmod(0o777 if planted == "writable by all" else 0o700)
        if planted == "another user's":
            os.chown(root, 1000, 1000)
    monkeypatch.setenv(lock.ROOT_ENV, str(root))
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    r = ddp(hosts, "launch")
    assert r.exit_code == 1, r.output
    assert len(r.stderr.splitlines()) == 1
    assert f"the lock directory {root} is not this user's own (" in r.stderr, r.stderr
    assert "another user can write there; move it aside" in r.stderr
    assert not (tmp_path / "nas").exists() and not (tmp_path / "elsewhere" / JOB_LOCK).exists()


def test_a_lock_from_before_the_node_s_last_boot_is_cleared_when_seen(ddp, tmp_path, fleet_lock_path, this_machine):
    """A reboot of the node ends whatever held it; the lock, kept on disk, says so by its boot id."""
    hosts = _inventory(tmp_path / "hosts.yaml", ONE)
    _lock_by(fleet_lock_path, pid=os.getpid())  # a live holder, by everything but the node's boot
    (fleet_lock_path / "boot").write_text("00000000-0000-0000-0000-000000000000\n")
    assert _seen(hosts) is None
    assert not fleet_lock_path.exists()
    r = ddp(hosts, "deploy")
    assert r.exit_code == 0, r.output
