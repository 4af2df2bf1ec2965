"""A hostile job on the real cluster, in Docker as uid 1000: it plants a link at every name a node
program reads or writes, in every directory it can write (the checkpoint directory, its node's
directory of the run, its heartbeat directory, its data directory), tries to rename the tool's
directory away and to put one of its own in its place; then the operator runs every verb on it, `join` included.
Root on the node must change nothing outside the job's own directories (content, owner, mode of a
root-only canary that every link points at) and show nothing of it.

The names come from the node programs themselves (every ``$DIR/NAME`` they hold), so a program that
comes to touch a new name is covered by this test without a change to it."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

import pytest

from deploy.engines import slurm
from deploy.job import runs, runtime
from deploy.programs import HERE as NODE_PROGRAMS

from .operator_cli import ddp, ok, wait_until

pytestmark = pytest.mark.cluster

NAME_IN_A_DIRECTORY = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?/([A-Za-z0-9_.-]+)")


def touched_names() -> set[str]:
    """Every NAME that a node program reaches as ``$DIR/NAME``: its files on disk and the programs
    the modules build from strings."""
    texts = [p.read_text() for p in NODE_PROGRAMS.glob("*.sh")]
    texts += [v for m in (runtime, runs, slurm) for v in vars(m).values() if isinstance(v, str) and "$" in v]
    return {name for text in texts for name in NAME_IN_A_DIRECTORY.findall(text)}


# The job: plants a link to the canary at every name, in every directory it can write, and a
# heartbeat file named like a rank whose link a status would read; tries to rename the tool's
# directory; says what it did on the shared volume; then waits for its stop.
HOSTILE = r'''
import json, os, signal, sys, time
names, canary, victim = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
node, run = os.environ["DDP_NODE_NAME"], os.environ["DDP_LAUNCH_ID"]
mine = os.path.join("/ckpt/.ddp-deploy", os.environ["DDP_JOB"], "runs", run, node)
dirs = ["/ckpt", "/data", mine, os.environ.get("DDP_HEARTBEAT_DIR", "")]
done = {"planted": 0, "refused": [], "renamed": None}
for d in filter(os.path.isdir, dirs):
    for name in [*names, "7"]:
        path = os.path.join(d, name)
        if name in ("log", "exits") and d == mine:
            continue  # the launcher holds them open: replaced further down, once it has written
        try:
            if os.path.lexists(path) and not os.path.isdir(path):
                os.unlink(path)
            os.symlink(canary, path)
            done["planted"] += 1
        except OSError as e:
            done["refused"].append(f"{path}: {e.strerror}")
try:
    os.symlink(victim, "/ckpt/tensorboard")
except OSError as e:
    done["refused"].append(f"/ckpt/tensorboard: {e.strerror}")
try:
    os.rename("/ckpt/.ddp-deploy", f"/ckpt/.ddp-deploy.{node}")
    os.makedirs(os.path.join("/ckpt/.ddp-deploy", os.environ["DDP_JOB"], "runs"))
    done["renamed"] = True
except OSError as e:
    done["renamed"] = e.strerror
with open(f"/ckpt/hostile-{node}-{run}.json", "w") as f:
    json.dump(done, f)
print("METRICS " + json.dumps({"kind": "train", "epoch": 0, "step": 1, "loss": 1.0}), flush=True)
time.sleep(2)
for name in ("log", "exits", "stalls"):  # now the run's own files too
    try:
        path = os.path.join(mine, name)
        if os.path.lexists(path):
            os.rename(path, path + ".was")
        os.symlink(canary, path)
    except OSError:
        pass
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
while True:
    time.sleep(1)
'''


def _state(path: Path) -> dict[str, tuple]:
    """Every file under ``path`` (and itself): content, owner, group and mode."""
    found = {}
    for p in [path, *sorted(path.rglob("*"))]:
        st = p.lstat()
        found[str(p)] = (p.read_bytes() if stat.S_ISREG(st.st_mode) else None, st.st_uid, st.st_gid, st.st_mode)
    return found


@pytest.fixture
def canary(tmp_path_factory):
    """A root-only file whose content is a secret of digits (what a heartbeat reader would show) and
    a root-owned directory with a file in it: what every planted link points at."""
    root = Path(f"/var/tmp/ddp-canary-{secrets.token_hex(4)}")
    root.mkdir(mode=0o755)
    secret = root / "secret"
    secret.write_text(f"{secrets.randbelow(10**15):015d} {secrets.randbelow(10**15):015d}\n")
    secret.chmod(0o600)
    victim = root / "victim"
    victim.mkdir(mode=0o755)
    (victim / "precious").write_text("kept\n")
    yield root, secret, victim
    shutil.rmtree(root, ignore_errors=True)


def test_the_node_programs_names_are_found_for_the_planting():
    names = touched_names()
    # the ones root wrote or read inside the job's directories before they moved or were read as the job
    assert {"log", "exits", "stalls", "launch.json.tmp", "run.json.tmp", "pid"} <= names, names


def test_a_hostile_job_changes_and_sees_nothing_of_the_node_through_any_verb(cluster, fresh_nas, tmp_path, canary):
    root, secret, victim = canary
    said = secret.read_text().split()
    code = tmp_path / "code"
    code.mkdir()
    (code / "hostile.py").write_text(HOSTILE)
    names = sorted(touched_names())
    hosts = cluster.write_hosts_yaml(
        tmp_path / "hosts.yaml", runtime="docker", procs=1, interface="eth0",
        job={"keep_runs": 1, "stall_timeout": 600, "min_nodes": 2, "max_restarts": 2},  # elastic: join
        train={"script": "hostile.py", "code": str(code), "args": [json.dumps(names), str(secret), str(victim)],
               "env": {"DDP_JOB": "ddp-test"}})
    outputs = [ok(ddp(cluster, hosts, "deploy"))]
    ckpt = Path(cluster.nas_dir) / "ckpt"
    tool = ckpt / ".ddp-deploy"

    def planted(count: int):
        found = sorted(ckpt.glob("hostile-*.json"))
        return found if len(found) == count else None

    def verbs(run_id: str) -> None:
        for args in (["status"], ["status", "--json"], ["logs"], ["runs"], ["runs", "--json"],
                     ["logs", "--run", run_id], ["status", "--run", run_id], ["doctor"], ["unlock"],
                     ["plot", "-o", str(tmp_path / "plot.png")]):
            outputs.append(ddp(cluster, hosts, *args))

    last = cluster.hosts[-1].name
    outputs.append(ok(ddp(cluster, hosts, "--without", last, "launch")))
    first = wait_until(lambda: planted(2), 180, "the job's links planted on two nodes")
    run1 = first[0].name.split("-", 2)[2].removesuffix(".json")
    outputs.append(ok(ddp(cluster, hosts, "join", last)))  # into the run's directories the job planted in
    wait_until(lambda: planted(3), 180, "the joined node's links planted")
    (victim / run1).mkdir()  # what the next launch's pruning of this run's TensorBoard files must leave
    (victim / run1 / "precious").write_text("kept\n")
    before = _state(root)
    verbs(run1)
    outputs.append(ddp(cluster, hosts, "stop"))

    outputs.append(ok(ddp(cluster, hosts, "launch")))  # keep_runs 1: prunes the first run through the links
    wait_until(lambda: planted(6), 180, "the second run's links planted")
    run2 = max(p.name.split("-", 2)[2].removesuffix(".json") for p in ckpt.glob("hostile-*.json"))
    verbs(run2)
    outputs.append(ddp(cluster, hosts, "stop", "--now"))

    for p in ckpt.glob("hostile-*.json"):
        done = json.loads(p.read_text())
        assert done["planted"] > len(names) and done["renamed"] != True, (p.name, done)  # noqa: E712
    assert _state(root) == before  # nothing the links lead to was written, chowned, chmodded or removed
    for part in (tool, tool / "ddp-test", tool / "ddp-test" / "runs", tool / "ddp-test" / "runs" / run2):
        st = part.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022, part
    st = ckpt.lstat()
    assert st.st_uid == 0 and st.st_mode & stat.S_ISVTX, oct(st.st_mode)
    stops = sorted((tool / "ddp-test" / "runs" / run2).glob("*.stopped"))
    assert len(stops) == 3 and all(p.lstat().st_uid == 0 for p in stops), stops
    shown = "\n".join(o.stdout + o.stderr for o in outputs)
    assert not any(word in shown for word in said), "a verb showed the root-only canary"
    assert os.path.exists(secret)
