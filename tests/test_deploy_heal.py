"""The watcher that heals a job (hosts.yaml's ``heal:``): what it decides about a lost node, its
records read as data, and its life beside a real job on this machine (started detached by
``launch``, shown by ``status``, ended by the job's end or by ``stop``, alive after its machine
slept). Its healing of lost nodes runs on the test cluster (tests/cluster/test_faults.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from deploy.errors import InventoryError
from deploy.job import healing
from local_job import local_hosts, local_nodes, on_paper
from waiting import wait_until


def _job(n: int = 3, spares: int = 1, **fields):
    nodes = [{"name": f"n{i}", "address": f"198.18.0.{10 + i}", "procs": 2} for i in range(1, n + 1)]
    extra = [{"name": f"s{i}", "address": f"198.18.1.{10 + i}", "procs": 2} for i in range(1, spares + 1)]
    return on_paper(nodes, job="demo", spares=extra, **fields)


def test_a_lost_node_is_replaced_by_a_spare_and_the_rendezvous_moves_off_a_lost_one():
    inv = _job()
    d = healing.decide(inv, ("n2",), ["s1"], {"n2": 61})
    assert isinstance(d, healing.Relaunch) and d.spares == ("s1",) and d.lost == ("n2",)
    assert d.said.startswith("n2 (unreachable for 61 s) lost for good: relaunched with s1 in its place")
    moved = healing.decide(inv, ("n1",), ["s1"], {})
    assert isinstance(moved, healing.Relaunch) and "the rendezvous moved from n1 to n2" in moved.said
    assert inv.without(["n1"]).with_spares(["s1"]).rdzv_node.name == "n2"


def test_a_spare_of_the_lost_node_s_size_is_taken_first():
    nodes = [{"name": "a", "address": "198.18.0.1", "procs": 2}, {"name": "b", "address": "198.18.0.2", "procs": 4}]
    spares = [{"name": "small", "address": "198.18.1.1", "procs": 2}, {"name": "big", "address": "198.18.1.2", "procs": 4}]
    inv = on_paper(nodes, job="demo", spares=spares)
    assert healing.decide(inv, ("b",), ["small", "big"], {}).spares == ("big",)


def test_without_a_spare_a_fixed_job_ends_with_the_reason_and_an_elastic_one_shrinks():
    fixed = healing.decide(_job(spares=0), ("n3",), [], {"n3": 70})
    assert isinstance(fixed, healing.End)
    assert "no spare left" in fixed.said and "a job of fixed size (job.min_nodes not set) needs its 3 nodes" in fixed.said
    elastic = _job(spares=0, job_fields={"min_nodes": 2})
    goes_on = healing.decide(elastic, ("n3",), [], {})
    assert isinstance(goes_on, healing.GoOn) and "goes on on 2 nodes (job.min_nodes 2)" in goes_on.said
    # its rendezvous lost, an elastic job is launched again on the others, the store on one of them
    moved = healing.decide(elastic, ("n1",), [], {})
    assert isinstance(moved, healing.Relaunch) and moved.spares == () and "from n1 to n2" in moved.said
    below = healing.decide(elastic, ("n1", "n2"), [], {})
    assert isinstance(below, healing.End) and "job.min_nodes is 2" in below.said


def test_a_node_is_lost_only_after_enough_time_and_polls_in_a_row():
    s = healing.Silences(lost_after=10)
    s.poll({"a": False, "b": True}, 0.0)
    s.poll({"a": False, "b": True}, 30.0)  # a long time, but two polls (a machine that slept between them)
    assert s.lost(["a", "b"], 30.0) == ()
    s.poll({"a": False, "b": True}, 31.0)
    assert s.lost(["a", "b"], 31.0) == ("a",)
    s.poll({"a": True, "b": True}, 32.0)  # it answered: silent no more
    assert s.lost(["a"], 32.0) == () and s.for_s("a", 32.0) == 0


@pytest.mark.parametrize("text", [
    "", "[]", '{"state": "watching"}', '{"state": "x", "run": "r", "by": "u@h", "pid": 1, "since": 1, "beat": 1, "said": ""}',
    '{"state": "watching", "run": "r", "by": "u@h", "pid": true, "since": 1, "beat": 1, "said": ""}',
    '{"state": "watching", "run": "r", "by": "u@h", "pid": 1, "since": 1e999, "beat": 1, "said": ""}',
    "[" * 100000,
])
def test_a_watch_record_that_is_not_one_is_none(text):
    assert healing.Watcher.parse(text) is None


def test_the_records_read_back_as_written_and_a_foreign_outcome_is_dropped():
    w = healing.Watcher("r1", "u@h", 42, "m", 100.0, 110.0, healing.WATCHING, "watching run r1", ("a", "b"), ("s",))
    assert healing.Watcher.parse(w.line().decode()) == w
    odd = json.loads(w.line())
    odd["outcome"] = "\x1b[2Jwon"
    assert healing.Watcher.parse(json.dumps(odd)).outcome == ""
    e = healing.Event(100.0, "healed", "n1 lost for good: relaunched", "r2")
    assert healing.Event.parse(e.line().decode()) == e and healing.Event.parse("not json") is None
    assert healing.parse_read(f"@@watch {w.line().decode()}") == w and healing.parse_read("") is None
    assert "gone, it seems" in w.describe(110.0 + healing.STALE_S + 1) and "gone" not in w.describe(111.0)


def test_heal_watch_is_refused_on_slurm():
    with pytest.raises(InventoryError, match="heal.watch.*not on Slurm"):
        on_paper([], job="demo", slurm={"login": {"address": "198.18.0.1"}, "nodes": 2}, heal={"watch": True})


# --- its life beside a real job --------------------------------------------------------------

def _hosts(tmp_path: Path, epochs: int, name: str = "hosts.yaml") -> Path:
    return local_hosts(tmp_path, job="healed", name=name, nodes=local_nodes("a", "b"),
                       spares=[{"name": "s", "address": "127.0.0.3", "connection": "local", "procs": 1}],
                       heal={"watch": True, "lost_after": 5},
                       train={"args": ["--dataset", "synthetic", "--synthetic-size", "256", "--batch-size", "8",
                                       "--epochs", str(epochs)]})


def _pid(said: str) -> int:
    line = next(line for line in said.splitlines() if line.startswith("watcher started (pid "))
    return int(line.split("(pid ")[1].split(")")[0])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def _record(tmp_path: Path) -> healing.Watcher | None:
    path = tmp_path / "nas/ckpt/.ddp-deploy/healed/watch"
    return healing.Watcher.parse(path.read_text()) if path.exists() else None


@pytest.fixture
def state_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


@contextlib.contextmanager
def _launched(ddp, hosts: Path):
    """The job launched, and its watcher's pid; the watcher killed after, if it is still there."""
    r = ddp(hosts, "launch")
    assert r.exit_code == 0, r.output
    pid = _pid(r.stdout)
    try:
        yield pid
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.e2e
def test_launch_starts_a_watcher_apart_from_the_terminal_that_ends_with_the_job(ddp, tmp_path, state_home):
    hosts = _hosts(tmp_path, epochs=2)
    with _launched(ddp, hosts) as pid:
        assert os.getsid(pid) == pid  # a session of its own: the terminal's hang-up is not its
        assert Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[4] == "0"  # no controlling terminal
        wait_until(lambda: _record(tmp_path) is not None, 60, "the watch record")
        shown = ddp(hosts, "status").stdout
        assert f"(pid {pid}): watching run " in shown and "on a, b (spares: s)" in shown
        wait_until(lambda: not _alive(pid), 240, "the watcher to end with the job")
    ended = _record(tmp_path)
    assert ended.state == healing.ENDED and ended.outcome == healing.FINISHED, ended
    runs = ddp(hosts, "runs")
    assert "ended: all nodes finished with exit code 0" in runs.stdout, runs.stdout
    log = (state_home / "ddp-deploy/healed.watch.log").read_text()
    assert "the watch ended (finished)" in log


@pytest.mark.e2e
def test_a_watcher_that_slept_watches_on_and_stop_ends_it_before_the_job(ddp, tmp_path, state_home):
    hosts = _hosts(tmp_path, epochs=1000)
    with _launched(ddp, hosts) as pid:
        wait_until(lambda: _record(tmp_path) is not None, 60, "the watch record")
        os.kill(pid, signal.SIGSTOP)  # its machine asleep
        time.sleep(4)
        os.kill(pid, signal.SIGCONT)
        woke = time.time()
        wait_until(lambda: _record(tmp_path).beat > woke, 60, "a poll after it woke")
        assert _record(tmp_path).state == healing.WATCHING
        stopped = ddp(hosts, "stop")
        assert stopped.exit_code == 0, stopped.output
        assert "the watcher of healed (" in stopped.stdout and f"pid {pid}) ends: it starts nothing again" in stopped.stdout
        wait_until(lambda: not _alive(pid), 60, "the watcher to end")
    ended = _record(tmp_path)
    assert ended.outcome == healing.STOPPED and "stopped by" in ended.said, ended
    assert len(json.loads(ddp(hosts, "runs", "--json").stdout)) == 1  # it started nothing again
    assert f"(pid {pid}): ended: the job was stopped by " in ddp(hosts, "status").stdout


def test_what_the_watcher_keeps_on_the_volume_holds_no_secret(tmp_path, monkeypatch):
    """A refusal it keeps may quote the job's output, and that a secret: masked before it is written."""
    from deploy.engines.fleet.heal import Watch
    from deploy.inventory import load
    from deploy.job import secretenv
    from deploy.nodes.remote import Remote

    monkeypatch.setenv("TEST_HEAL_TOKEN", "s3cr3t-value-77")
    hosts = local_hosts(tmp_path, job="healed", nodes=local_nodes("a"), heal={"watch": True},
                        train={"secrets": {"TOKEN": {"env": "TEST_HEAL_TOKEN"}}})
    inv = load(hosts)
    (tmp_path / "nas/ckpt").mkdir(parents=True)  # as deploy makes it
    with Remote(inv) as remote:
        w = Watch(inv, "20261207-000000-abcd", remote, hosts=str(hosts), redact=secretenv.redactor_for(inv))
        w.put(healing.HEALING, "the relaunch was refused: a: probe said s3cr3t-value-77")
        w.keep(w.run, "refused", "the relaunch was refused: a: probe said s3cr3t-value-77")
    job = tmp_path / "nas/ckpt/.ddp-deploy/healed"
    kept = [job / "watch", job / "runs/20261207-000000-abcd/heal"]
    for path in kept:
        text = path.read_text()
        assert "s3cr3t-value-77" not in text and "probe said ***" in text, (path, text)
    assert oct((job / "watch").stat().st_mode & 0o777) == "0o644"


def _watch_of(tmp_path: Path, **sections):
    """A Watch of the local job a, b with the spare s (as `ddp-deploy watch` makes it), and its remote."""
    from deploy.engines.fleet.heal import Watch
    from deploy.inventory import load
    from deploy.nodes.remote import Remote

    hosts = local_hosts(tmp_path, job="healed", nodes=local_nodes("a", "b"),
                        spares=[{"name": "s", "address": "127.0.0.3", "connection": "local", "procs": 1}],
                        heal={"watch": True, "lost_after": 5}, **sections)
    inv = load(hosts)
    (tmp_path / "nas/ckpt").mkdir(parents=True, exist_ok=True)  # as deploy makes it
    remote = Remote(inv.and_spares())
    return inv, remote, Watch(inv, "20261207-000000-abcd", remote, hosts=str(hosts))


@pytest.mark.e2e
def test_a_refused_relaunch_tries_each_spare_once_and_the_end_says_why(tmp_path):
    """Node b lost; the relaunch with the spare is refused by its checks (here: too little free
    space for storage.min_free_gb), no spare is left: the watch ends with one line that gives both
    reasons, the refusal is kept with the run, and nothing was started."""
    from deploy.engines.fleet.watch import states_of

    inv, remote, w = _watch_of(tmp_path, storage={"min_free_gb": 100000})
    with remote:
        states = states_of(inv, [*inv.nodes, *inv.spares], remote, str)
        w.put(healing.WATCHING)
        ended = w.heal(("b",), states, time.monotonic())
    assert ended is not None and ended[0] == healing.NOT_HEALED, ended
    said = ended[1]
    assert said.startswith("b (unreachable for ") and "no spare left" in said, said
    assert "; the relaunch with s was refused: launch refused, nothing started: " in said, said
    assert w.refused == {"s"}
    kept = (tmp_path / f"nas/ckpt/.ddp-deploy/healed/runs/{w.run}/heal").read_text().splitlines()
    assert [healing.Event.parse(line).what for line in kept] == ["refused", "ended"], kept
    assert sorted(p.name for p in (tmp_path / "nas/ckpt/.ddp-deploy/healed/runs").iterdir()) == [w.run]  # none started


def test_a_watch_record_gone_with_the_volume_ends_the_watch_with_the_reason(tmp_path):
    """The checkpoint volume lost or emptied under a running watch: it says so and ends, never
    taking it for another watcher's."""
    from deploy.engines.fleet.heal import NotWanted

    _, remote, w = _watch_of(tmp_path)
    with remote:
        w.put(healing.WATCHING)
        w.still_mine(sure=True)  # its own record: nothing to say
        (tmp_path / "nas/ckpt/.ddp-deploy/healed/watch").unlink()
        with pytest.raises(NotWanted) as gone:
            w.still_mine()
    assert gone.value.outcome == healing.NOT_HEALED
    assert "the watch record is gone from the shared volume (a read none: the checkpoint volume lost" in str(gone.value)
