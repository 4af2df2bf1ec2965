"""agent/holds.py: a node's GPUs held by one job at a time, named from kernel facts.

No GPU is needed: a hold is a listening socket named by the GPU's index, so the holders here are
real processes holding indices of GPUs this machine does not have (the GPU inventory is what is
faked; the holds, their discovery and the refusals are real).
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.checks import node_checks
from deploy.checks.preflight import check_argv
from deploy.engines.fleet import alljobs as fleet_jobs
from deploy.inventory import loads
from deploy.job import plan
from deploy.nodes.remote import Result
from agent import holds

SCRIPT = Path(holds.__file__)
ME = pwd.getpwuid(os.getuid()).pw_name


def _holder(job: str, *gpus: int, user: str | None = None) -> subprocess.Popen:
    """A process holding ``gpus`` for ``job`` as a launcher does (``user``: as that uid)."""
    argv = [sys.executable, str(SCRIPT), "hold", job, *map(str, gpus)]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdout.readline().strip() == "holding"
    return proc


def _hold(job: str, *gpus: int) -> subprocess.CompletedProcess:
    """A second launcher's try: ``holding`` (then ended here) or ``held: WHO``."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "hold", job, *map(str, gpus)], stdout=subprocess.PIPE,
                            text=True, cwd="/")
    first = proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    return first


def _list(*gpus: int) -> list[dict]:
    out = subprocess.run([sys.executable, str(SCRIPT), "list", *map(str, gpus)], capture_output=True, text=True,
                         timeout=30, check=True, cwd="/")
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture
def holders():
    made: list[subprocess.Popen] = []
    yield lambda *a, **k: made.append(_holder(*a, **k)) or made[-1]
    for p in made:
        p.kill()
        p.wait()


def test_a_held_gpu_refuses_another_job_naming_it_until_its_holder_dies(holders):
    a = holders("job-a", 0, 1)
    said = _hold("job-b", 1)
    assert said.startswith(f"held: GPU 1 is held by job 'job-a' of user '{ME}' (uid {os.getuid()}, pid {a.pid}) "
                           f"since {time.strftime('%Y-%m-%d')} "), said
    assert _hold("job-c", 2) == "holding"  # another GPU of the same node: side by side
    seen = _list(0, 1, 2)
    assert [(h["gpu"], h["pid"], h["said"]["job"]) for h in seen] == [(0, a.pid, "job-a"), (1, a.pid, "job-a")]
    a.send_signal(signal.SIGKILL)  # however it ends, the kernel lets go of its GPUs
    a.wait()
    assert _list(0, 1, 2) == [] and _hold("job-b", 1) == "holding"


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's holder is started with setpriv, as root")
def test_another_user_s_holder_is_named_by_the_uid_the_kernel_gives(holders):
    other = holders("theirs", 3, user="4321")
    (seen,) = _list(3)
    assert seen["uid"] == 4321 and seen["pid"] == other.pid and seen["said"]["user"] == "4321"


def test_claims_that_do_not_answer_hold_nothing_and_cost_one_bounded_read():
    planted = []
    for i in range(40):  # listening claims that never answer, and a bound one that does not listen
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(f"\0{holds.PREFIX}gpu5/{i:016x}")
        if i:
            s.listen(1)
        planted.append(s)
    try:
        started = time.monotonic()
        assert _list(5) == []
        assert time.monotonic() - started < 10 * holds.ASK_S
        assert _hold("mine", 5) == "holding"
    finally:
        for s in planted:
            s.close()


GPU_NODE = {"job": {"name": "pf", "runtime": "host"}, "train": {"python": sys.executable},
            "rendezvous": {"node": "g", "port": 29400},
            "nodes": [{"name": "g", "address": "127.0.0.1", "connection": "local", "gpus": 4, "gpu_ids": [2, 3]}],
            "storage": {"data": {"host": "/nas/data", "container": "/data"},
                        "checkpoints": {"host": "/nas/ckpt", "container": "/ckpt"}}}


def test_a_launch_holds_its_node_s_gpus_and_its_check_asks_who_holds_them():
    inv = loads(json.dumps(GPU_NODE))
    env = dict(plan.node_env(inv, inv.node("g"), run="20261206-120000-abcd"))
    assert json.loads(env[holds.ENV]) == {"job": "pf", "run": "20261206-120000-abcd", "gpus": [2, 3]}
    argv = check_argv(inv, inv.node("g"), "")
    at = argv.index("holds")
    assert argv[at + 1:at + 8] == ("6", sys.executable, "-c", SCRIPT.read_text(), "list", "2", "3")


def test_the_check_names_each_holder_as_text_and_passes_free_gpus():
    inv = loads(json.dumps(GPU_NODE))
    free = node_checks.gpu_holds(inv, Result("g", 0, ""))
    assert free.ok and free.detail == "no other job holds GPUs 2,3"
    since = time.mktime((2026, 12, 6, 9, 30, 0, 0, 0, -1))
    lying = {"gpu": 3, "pid": 777, "uid": 1001, "since": since, "name": "x",
             "said": {"job": "\x1b[2Jwipe", "user": "bob"}}
    said = json.dumps(dict(lying, told=holds.describe(lying)))  # a line of the node's `holds.py list`
    held = node_checks.gpu_holds(inv, Result("g", 0, said + "\nnot json\n"))
    assert not held.ok
    assert held.detail == ("GPU 3 is held by job '\\x1b[2Jwipe' of user 'bob' (uid 1001, pid 777) since "
                           "2026-12-06 09:30:00; an answer not understood: not json: stop that job first, or give "
                           "this job other GPUs (nodes[].gpu_ids)")
    raw = node_checks.gpu_holds(inv, Result("g", 0, json.dumps({"told": "GPU 3 \x1b[2J"}) + "\n" + json.dumps(lying)))
    assert raw.detail.startswith("GPU 3 \\x1b[2J; an answer not understood: {") and "\x1b" not in raw.detail, raw.detail
    failed = node_checks.gpu_holds(inv, Result("g", 127, "", "python3: not found"))
    assert not failed.ok and failed.detail.startswith("cannot tell who holds GPUs 2,3: ")
    assert failed.detail.endswith(f"(the node's {sys.executable} asks)")


@pytest.mark.e2e
def test_a_launcher_refuses_to_start_on_a_gpu_another_job_holds(holders, tmp_path):
    a = holders("running", 6)
    env = {**os.environ, holds.ENV: json.dumps({"job": "late", "run": "r", "gpus": [6]}), "DDP_PREFORK": "0"}
    proc = subprocess.run([sys.executable, "-m", "agent.launch", "--standalone", "--nproc-per-node", "1", "--",
                           "--data-dir", str(tmp_path / "d"), "--ckpt-dir", str(tmp_path / "c")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"agent.launch: error: GPU 6 is held by job 'running' of user '{ME}' (uid {os.getuid()}, pid {a.pid})")
    assert not (tmp_path / "c").exists()  # nothing started: no worker made its directory


def test_each_launcher_says_it_runs_and_the_fleet_view_groups_a_job_s_nodes(holders):
    cpu = holders("cpu-job")  # a CPU job holds no GPU, but says it runs
    listed = subprocess.run([sys.executable, str(SCRIPT), "jobs"], capture_output=True, text=True, timeout=30,
                            check=True, cwd="/").stdout
    mine = [j for j in fleet_jobs.parse("n1", listed) if j.pid == cpu.pid]
    assert [(j.job, j.gpus, j.uid) for j in mine] == [("cpu-job", (), os.getuid())]
    line = lambda job, uid, since, gpus: json.dumps({  # noqa: E731
        "pid": 7, "uid": uid, "since": since, "name": "x",
        "said": {"job": job, "run": "r1", "user": "u", "gpus": gpus}})
    answers = {"a": "\n".join([line("big", 1001, 20.0, [0, 1]), line("small", 1002, 10.0, []), "garbage",
                               json.dumps({"pid": 1, "uid": 0, "since": 1, "said": ["not", "a", "dict"]})]),
               "b": line("big", 1001, 30.0, [2])}
    rows = fleet_jobs.gather([j for node, out in answers.items() for j in fleet_jobs.parse(node, out)])
    assert [(r.job, r.uid, r.since, r.nodes) for r in rows] == [
        ("?", 0, 1.0, {"a": ()}), ("small", 1002, 10.0, {"a": ()}), ("big", 1001, 20.0, {"a": (0, 1), "b": (2,)})]


def test_a_launcher_tells_what_its_ranks_do_and_the_fleet_view_shows_it_as_text(tmp_path):
    """A hold told its job's state answers with it (read apart from the answers, so an answer never
    waits on it); what a node tells is shown only where it is one of the states, a stall first."""
    hold = holds.Hold([], "told-job", "r9")
    try:
        told = [{"state": "stalled", "step": 41}]
        hold.tell(lambda: told[-1], every=0.05)
        time.sleep(0.3)
        answers = [j["said"] for j in holds.jobs() if j["pid"] == os.getpid()]
        assert answers == [{"job": "told-job", "run": "r9", "user": ME, "gpus": [], "state": "stalled", "step": 41}], \
            answers
        told.clear()  # the reading fails (IndexError): that is told, and the answers go on
        time.sleep(0.3)
        answers = [j["said"]["state"] for j in holds.jobs() if j["pid"] == os.getpid()]
        assert answers == ["unknown (IndexError)"], answers
    finally:
        hold.release()
    line = lambda state, step: json.dumps({"pid": 7, "uid": 0, "since": 1.0,  # noqa: E731
                                           "said": {"job": "j", "run": "r", "state": state, "step": step}})
    parsed = fleet_jobs.parse("a", "\n".join([line("running", 12), line("\x1b[2Jstalled", 10 ** 30),
                                              line(["running"], -1), line("unknown (OSError)", 3)]))
    assert [(j.state, j.step) for j in parsed] == [("running", 12), ("not told", None), ("not told", None),
                                                   ("unknown", 3)]
    row = fleet_jobs.gather([fleet_jobs.NodeJob(n, "j", "r", "u", 0, 7, 1.0, (), state, step)
                             for n, state, step in (("a", "running", 12), ("b", "stalled", 10), ("c", "running", 11))])
    assert [(r.state, r.step) for r in row] == [("stalled on b; running on a, c", 12)]
    same = fleet_jobs.gather([fleet_jobs.NodeJob(n, "j", "r", "u", 0, 7, 1.0, (), "running", None) for n in "ab"])
    assert [(r.state, r.step) for r in same] == [("running", None)]
