"""Every `ddp-deploy` command is a fresh interpreter, and most of what one costs before it does
anything is imports: the libraries a command does not need are not imported. SSH's (paramiko,
fabric, invoke: a tenth of a second) only where a node is reached over SSH; packaging only where
a torch version is judged (the preflight checks); pathspec only where code is synced; pydantic
and yaml only where hosts.yaml is read (not by --help). bench/bench_cli_start.py measures it.

Each case runs the CLI in a fresh interpreter, as a shell would, and reads what it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from local_job import local_hosts

REPO = Path(__file__).resolve().parents[1]
SSH_STACK = {"paramiko", "fabric", "invoke"}
NOT_AT_START = SSH_STACK | {"packaging", "pathspec"}
READING_HOSTS = {"pydantic", "yaml"}

# Runs `python -m deploy ARGS` in this interpreter (as runpy does for -m), then writes the top-level
# packages it imported to the file named first.
_PROBE = """
import json, runpy, sys
out, sys.argv = sys.argv[1], ["ddp-deploy", *sys.argv[2:]]
try:
    runpy.run_module("deploy", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
else:
    code = 0
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}, f)
"""


def _imported(tmp_path: Path, *args: str) -> set[str]:
    """The top-level packages a `ddp-deploy ARGS` run imported; it must end with exit code 0."""
    out = tmp_path / "modules.json"
    env = {**os.environ, "DDP_DEPLOY_LOG": str(tmp_path / "debug.log")}
    r = subprocess.run([sys.executable, "-c", _PROBE, str(out), *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(out.read_text())
    assert seen["code"] in (0, None), r.stdout + r.stderr
    return set(seen["modules"])


def _hosts(tmp_path: Path, connection: str) -> Path:
    """A one-node inventory (node ``here``, 127.0.0.1) reached by ``connection``, host runtime."""
    return local_hosts(tmp_path, job="imports", nodes=[{"name": "here", "address": "127.0.0.1", "connection": connection}],
                       ssh={"config": None})


@pytest.mark.parametrize("args", [["--help"], ["status", "--help"]], ids=["help", "verb-help"])
def test_the_cli_starts_without_importing_the_ssh_stack_or_other_heavy_libraries(tmp_path, args):
    """The CLI starts without importing the SSH stack, packaging, pathspec or the inventory's libraries."""
    imported = _imported(tmp_path, *args)
    assert "click" in imported  # the probe saw the CLI run
    assert imported.isdisjoint(NOT_AT_START | READING_HOSTS), sorted(imported & (NOT_AT_START | READING_HOSTS))


def test_importing_the_cli_imports_none_of_them_either():
    probe = "import json, sys\nimport deploy.cli\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    imported = set(json.loads(r.stdout))
    assert "deploy" in imported
    assert imported.isdisjoint(NOT_AT_START | READING_HOSTS), sorted(imported & (NOT_AT_START | READING_HOSTS))


def test_a_verb_that_runs_on_local_nodes_never_imports_the_ssh_stack(tmp_path):
    """status reaches the node (connection: local) and reads hosts.yaml: pydantic and yaml, no SSH."""
    imported = _imported(tmp_path, "--hosts", str(_hosts(tmp_path, "local")), "status", "--json")
    assert READING_HOSTS <= imported
    assert imported.isdisjoint(NOT_AT_START), sorted(imported & NOT_AT_START)


@pytest.mark.parametrize("args", [["validate"], ["launch", "--dry-run"], ["stop", "--dry-run"]],
                         ids=["validate", "launch-dry-run", "stop-dry-run"])
def test_a_verb_that_reaches_no_node_never_imports_the_ssh_stack_even_for_ssh_nodes(tmp_path, args):
    """A verb that connects to no node never imports the SSH stack, even for SSH nodes."""
    imported = _imported(tmp_path, "--hosts", str(_hosts(tmp_path, "ssh")), *args)
    assert READING_HOSTS <= imported
    assert imported.isdisjoint(NOT_AT_START), sorted(imported & NOT_AT_START)


def test_an_ssh_remote_still_reads_ssh_config_at_once_and_a_local_one_does_not(tmp_path):
    """The SSH stack is imported where it is used: a Remote for SSH nodes makes its SSH transport
    (which reads ssh.config with paramiko) when it is made, as before; one for local nodes has none."""
    probe = ("import sys\nfrom deploy.inventory import load\nfrom deploy.nodes.remote import Remote\n"
             "with Remote(load(sys.argv[1])):\n    print('paramiko' in sys.modules)")
    for connection, expected in (("ssh", "True"), ("local", "False")):
        r = subprocess.run([sys.executable, "-c", probe, str(_hosts(tmp_path, connection))], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == expected, connection


def test_torch_versions_are_still_judged_against_the_supported_range():
    from deploy.checks.versions import torch_supported
    from agent.contract import TORCH_SUPPORTED

    low = TORCH_SUPPORTED.split(",")[0].lstrip(">=~ ")
    assert torch_supported(low) and torch_supported(f"{low}+cu124")
    assert not torch_supported("1.0.0") and not torch_supported("not a version")
