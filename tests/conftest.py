import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The suite's own machinery (its time budget, its lanes, failures named as they happen): pytest
# plugins kept apart from the tests.
SUITE_TOOLS = Path(__file__).resolve().parent.parent / "tools" / "suite"
sys.path.insert(0, str(SUITE_TOOLS))

from torch_ends import torch_python  # noqa: E402,F401  (the fixture: the tested points of the torch range)

pytest_plugins = ("budget", "lanes", "live_report")  # tools/suite/

# The Ctrl-C tests press Ctrl-C for real (SIGINT to this process or to a CLI it starts). A suite
# started in the background of a non-interactive shell (`./.ci/run &`, nohup) inherits SIGINT
# ignored, and Python then installs no KeyboardInterrupt handler here or in any child: those
# tests would wait out their timeouts. A handled signal is reset to the default on exec, so
# restoring Python's handler here restores it in every process the tests start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def fleet_lock_path(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own root of the jobs' locks (deploy/job/lock.py), never this user's ~/.ddp-deploy:
    a test that launches is not refused by an operator's lock here, nor by a lock an earlier test left."""
    path = tmp_path_factory.mktemp("fleet-lock") / "locks"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("DDP_DEPLOY_LOCK_DIR", str(path))
    return path


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(request):
    """A local job a test started under its own directory ends with the test, whatever the test
    did: one that failed before its `stop` would otherwise train on (a 1000-epoch job takes a core
    from every test after it)."""
    yield
    tmp = getattr(request.node, "funcargs", {}).get("tmp_path")
    if tmp is not None:
        from procs import kill_runs_under

        kill_runs_under(tmp)


@pytest.fixture(autouse=True)
def node_cache_home(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own XDG_CACHE_HOME, where a local node keeps its probe answers
    (deploy/programs/probe_kept.sh): an answer one test's fake docker gave never serves another test.
    The test cluster's nodes have their own (tests/cluster/netcluster.py), as machines do."""
    path = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))
    return path


@pytest.fixture(autouse=True)
def own_tmpdir(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own TMPDIR, for the processes it starts: a launcher the test kills before it can
    remove its torch log folder (agent/launch.py torch_log_dir) leaves that folder, with its
    workers' output, under pytest's temporary root, never in this machine's /tmp (a clean-clone run
    left about ten /tmp/ddp-torchelastic-* there, as torch log folders were named then). A test that sets TMPDIR itself keeps its own."""
    path = tmp_path_factory.mktemp("tmpdir")
    monkeypatch.setenv("TMPDIR", str(path))
    return path


@pytest.fixture
def ddp(tmp_path, monkeypatch):
    """The real CLI in this process, the one way the tests run it: ``ddp(hosts, "status", "--json")``,
    ``env=`` for variables of that one command; its debug log in the test's directory."""
    from click.testing import CliRunner

    from deploy.cli import cli

    runner = CliRunner()
    monkeypatch.setenv("DDP_DEPLOY_LOG", str(tmp_path / "debug.log"))

    def run(hosts: Path, *args: str, env: dict[str, str] | None = None):
        return runner.invoke(cli, ["--hosts", str(hosts), *args], env=env)

    return run
