"""A host CPU node keeps its good probe answer for the next launch (agent/probe.py --kept,
deploy/programs/probe_kept_host.sh): the same command and the same installation of its interpreter
reuse it; a package installed or removed where the interpreter imports from, a failed answer, a GPU
node or a trainer too old to keep one: probed afresh."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from deploy.checks import node_checks
from deploy.inventory import load
from deploy.job import plan
from agent.contract import PROBE_KEPT_PREFIX
from deploy.job.scripts import HOST_PROBE_KEPT
from local_job import local_hosts


def _probe(tmp_path: Path, argv, extra: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONPATH": str(extra)}
    env.pop("XDG_CACHE_HOME", None)
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=120)


def _inventory(tmp_path: Path, **train):
    return load(local_hosts(tmp_path, job="kept", train=train))


def test_launch_reuses_a_good_answer_until_a_package_lands_where_python_imports_from(tmp_path):
    """A good answer is reused by launch until a package is installed where the interpreter imports from."""
    inv = _inventory(tmp_path)
    extra = tmp_path / "site"  # on the interpreter's path, as a site-packages directory is
    extra.mkdir()
    node = inv.nodes[0]
    first = _probe(tmp_path, plan.probe_argv(inv, node, reuse=True), extra)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("PROBE {") and PROBE_KEPT_PREFIX not in first.stdout
    again = _probe(tmp_path, plan.probe_argv(inv, node, reuse=True), extra)
    assert again.stdout.splitlines()[0].startswith(PROBE_KEPT_PREFIX + " ")
    assert again.stdout.splitlines()[1] == first.stdout.strip()
    assert "kept for this interpreter's installation and probe command, probed " in node_checks._kept(again.stdout, "host")

    checked = _probe(tmp_path, plan.probe_argv(inv, node, reuse=False), extra)  # `check`: always probed
    assert PROBE_KEPT_PREFIX not in checked.stdout and checked.stdout.startswith("PROBE {")

    (extra / "newpkg").mkdir()  # a package installed: another installation
    after = _probe(tmp_path, plan.probe_argv(inv, node, reuse=True), extra)
    assert PROBE_KEPT_PREFIX not in after.stdout and after.stdout.startswith("PROBE {")
    assert _probe(tmp_path, plan.probe_argv(inv, node, reuse=True), extra).stdout.startswith(PROBE_KEPT_PREFIX)


def test_a_failed_answer_is_never_kept(tmp_path):
    inv = _inventory(tmp_path, script="missing.py", code=str(tmp_path))
    extra = tmp_path / "site"
    extra.mkdir()
    for _ in range(2):
        r = _probe(tmp_path, plan.probe_argv(inv, inv.nodes[0], reuse=True), extra)
        assert PROBE_KEPT_PREFIX not in r.stdout and '"program_error": "' in r.stdout, r
    kept = tmp_path / "home/.cache/ddp-deploy/probe"
    assert not kept.exists() or not any(kept.iterdir())


def test_a_gpu_node_is_probed_every_time(tmp_path):
    data = local_hosts(tmp_path, job="kept", train={})
    text = data.read_text().replace('"procs": 1', '"procs": 1, "gpus": 1')
    data.write_text(text)
    inv = load(data)
    assert plan.probe_argv(inv, inv.nodes[0], reuse=True) == plan.probe_argv(inv, inv.nodes[0])


def test_a_trainer_on_the_node_older_than_kept_answers_is_probed_as_before(tmp_path):
    old = [sys.executable, "-c", "import argparse; argparse.ArgumentParser().parse_args(); print('PROBE {}')"]
    r = subprocess.run(["sh", "-c", HOST_PROBE_KEPT, "sh", "reuse", "a" * 32, *old], capture_output=True, text=True,
                       env={**os.environ, "HOME": str(tmp_path)}, timeout=60)
    assert r.returncode == 0 and r.stdout == "PROBE {}\n", r


def test_a_key_that_is_no_hex_is_refused_before_any_path_is_made_of_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "agent.probe", "--kept", "reuse", "../../etc"], capture_output=True,
                       text=True, env={**os.environ, "HOME": str(tmp_path)}, cwd=Path(__file__).resolve().parents[1],
                       timeout=60)
    assert r.returncode == 2 and "not a key" in r.stderr and not (tmp_path / ".cache").exists()
