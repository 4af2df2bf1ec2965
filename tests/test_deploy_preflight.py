"""Preflight on `connection: local` nodes with a fake `docker` on PATH: every check's row from
ONE command per node, the shared-storage token written, read and cleaned up, the rendezvous
listener and connectors meeting, and the verdicts for nodes that do not share storage."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.checks import meetings, node_checks, preflight
from deploy.inventory import loads
from deploy.nodes.remote import Remote, Result
from fakes import free_port, install_command
from local_job import local_nodes, on_paper

# `docker run ... --entrypoint python IMAGE ARGS` runs ARGS with this machine's python: the real
# probe, with the torch the tests run on, as if it were the image's.
FAKE_DOCKER = """#!/bin/sh
case "$1" in
  version) case "$3" in *Arch*) echo linux/amd64 ;; *) echo 20.10.24 ;; esac ;;
  inspect) echo "Error response from daemon: No such container: $6" >&2; exit 1 ;;
  run) while [ "$1" != --entrypoint ]; do shift; done; shift 3; exec PYTHON "$@" ;;
  *) echo "fake docker: unexpected $*" >&2; exit 99 ;;
esac
""".replace("PYTHON", sys.executable)


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    install_command(tmp_path, monkeypatch, "docker", FAKE_DOCKER)
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # where `python -m agent.probe` finds trainer


def _inv(tmp_path: Path, nodes=3, rdzv="n2", port=None, extra_nodes=()):
    listed = [*extra_nodes, *local_nodes(*(f"n{i}" for i in range(1, nodes + 1)))]
    return on_paper(listed, job="pf", nas=tmp_path / "nas", rendezvous={"node": rdzv, "port": port or free_port()},
                    storage={"min_free_gb": 0.001})


class CountingRemote(Remote):
    """Records every command a node is asked to run."""

    def __init__(self, inv):
        super().__init__(inv)
        self.commands: list[str] = []

    def run(self, commands, **kw):
        self.commands += list(commands)
        return super().run(commands, **kw)

    def start(self, node, *a, **kw):
        self.commands.append(node)
        return super().start(node, *a, **kw)

    def send(self, node, *a, **kw):
        self.commands.append(node)
        return super().send(node, *a, **kw)


def test_every_check_passes_on_three_nodes_from_one_command_per_node(fake_docker, tmp_path):
    (tmp_path / "nas/ckpt").mkdir(parents=True)
    inv = _inv(tmp_path)
    with CountingRemote(inv) as remote:
        checks = preflight.run_checks(inv, remote).checks
    assert sorted(remote.commands) == ["n1", "n2", "n3"]
    rows = [(c.node, c.name, c.ok, c.detail) for c in checks]
    port = inv.rendezvous.port
    import torch
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    assert rows == [
        *((n, "local", True, "reachable") for n in ("n1", "n2", "n3")),
        *((n, "docker", True, "engine 20.10.24") for n in ("n1", "n2", "n3")),
        *((n, "platform", True, "linux/amd64") for n in ("n1", "n2", "n3")),
        *((n, "torch", True, f"torch {torch.__version__}, {build} in image ddp-trainer:latest") for n in ("n1", "n2", "n3")),
        *((n, "program", True, "the built-in trainer imports in image ddp-trainer:latest") for n in ("n1", "n2", "n3")),
        *((n, "storage", True, f"{tmp_path}/nas/data missing (deploy creates it)") for n in ("n1", "n2", "n3")),
        ("n1", "shared storage", True, f"wrote token to {tmp_path}/nas/ckpt"),
        ("n2", "shared storage", True, "sees n1's token"),
        ("n3", "shared storage", True, "sees n1's token"),
        ("n1", "rendezvous", True, f"reaches 127.0.0.2:{port}"),
        ("n2", "rendezvous", True, f"port {port} free"),
        ("n3", "rendezvous", True, f"reaches 127.0.0.2:{port}"),
        *((n, "previous run", True, "none") for n in ("n1", "n2", "n3")),
    ]
    assert list((tmp_path / "nas").rglob(".ddp-deploy-check-*")) == []  # every node removed its token


def test_one_node_has_no_token_and_its_listener_expects_nobody(fake_docker, tmp_path):
    inv = _inv(tmp_path, nodes=1, rdzv="n1")
    argv = preflight.check_argv(inv, inv.node("n1"), "")
    assert "token" not in argv
    with Remote(inv) as remote:
        checks = {c.name: c for c in preflight.run_checks(inv, remote).checks}
    assert checks["shared storage"].ok and checks["shared storage"].detail == "single node"
    assert checks["rendezvous"].ok and checks["rendezvous"].detail.endswith("free")


def test_a_port_in_use_on_the_endpoint_fails_its_rendezvous_row(fake_docker, tmp_path):
    with socket.create_server(("", 0)) as busy:
        busy.listen(8)
        inv = _inv(tmp_path, port=busy.getsockname()[1])
        with Remote(inv) as remote:
            rows = {c.node: c for c in preflight.run_checks(inv, remote).checks if c.name == "rendezvous"}
    assert not rows["n2"].ok and rows["n2"].detail.startswith(f"port {inv.rendezvous.port} is in use")


def test_an_unreachable_first_node_leaves_the_next_one_as_the_token_writer(fake_docker, tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "LISTEN_SECONDS", 2)
    closed = free_port()  # nothing listens there: connection refused at once
    down = {"name": "n0", "address": "127.0.0.9", "connection": "ssh",
            "ssh": {"port": closed, "key": str(tmp_path / "no-key"), "connect_timeout": 2}}
    inv = _inv(tmp_path, nodes=2, rdzv="n1", extra_nodes=[down])
    with Remote(inv) as remote:
        checks = preflight.run_checks(inv, remote).checks
    ssh = [c for c in checks if c.node == "n0"]
    assert len(ssh) == 1 and ssh[0].name == "ssh" and not ssh[0].ok and "unreachable" in ssh[0].detail
    shared = {c.node: (c.ok, c.detail) for c in checks if c.name == "shared storage"}
    assert shared == {"n1": (True, f"wrote token to {tmp_path}"), "n2": (True, "sees n1's token")}
    rdzv = {c.node: c.ok for c in checks if c.name == "rendezvous"}
    assert rdzv == {"n1": True, "n2": True}  # the listener is judged on the nodes that could connect


def test_the_script_is_constant_and_every_value_is_its_own_argument(tmp_path):
    inv = _inv(tmp_path)
    a = preflight.check_argv(inv, inv.node("n1"), "tok1")
    b = preflight.check_argv(inv, inv.node("n3"), "tok3")
    assert a[:3] == b[:3] == ("bash", "-c", preflight.PHASES)
    assert "tok1" in a and str(tmp_path / "nas/ckpt") in a
    assert all("tok1" not in word for word in a[:3] + b)


def _tagged(**checks: tuple[int, str]) -> str:
    return "".join(f"{tag} o {line}\n" for tag, (_, out) in checks.items() for line in out.splitlines()) + \
        "".join(f"{tag} rc {rc}\n" for tag, (rc, _) in checks.items())


def test_a_node_that_reads_another_token_is_not_on_the_same_storage(tmp_path):
    inv = _inv(tmp_path)
    tokens = {"n1": "aaa", "n2": "bbb", "n3": "ccc"}
    path = f"{tmp_path}/nas/ckpt/.ddp-deploy-check-aaa"
    common = {"engine": (0, "20.10.24"), "storage": (0, "OK /x 99999999\nOK /y 99999999"), "status": (0, "absent"),
              "rdzv": (0, "connected")}
    final = {
        "n1": Result("n1", 0, _tagged(**common, token=(0, path))),
        "n2": Result("n2", 0, _tagged(**{**common, "rdzv": (0, "accepted 2 of 2")}, token=(0, "p2"), seen=(0, "aaa"))),
        "n3": Result("n3", 0, _tagged(**common, token=(0, "p3"), seen=(1, ""))),
    }
    first = {n: Result(n, None, r.stdout) for n, r in final.items()}
    meeting = preflight.FleetMeeting(inv)
    meeting.tokens = tokens
    shared = [c for c in preflight.checks_from(inv, first, final, meeting) if c.name == "shared storage"]
    assert [(c.node, c.ok) for c in shared] == [("n1", True), ("n2", True), ("n3", False)]
    assert shared[2].detail == f"does not see {path} written by n1: not the same storage"


def test_phase_two_readers_go_first_and_the_writer_ends_last(tmp_path):
    inv = _inv(tmp_path)
    first = {"n1": Result("n1", None, "token o /nas/.ddp-deploy-check-aaa\ntoken rc 0\n"),
             "n2": Result("n2", None, ""), "n3": Result("n3", None, "")}
    assert meetings.token_waves(inv, first) == [
        {"n2": "READ /nas/.ddp-deploy-check-aaa\n", "n3": "READ /nas/.ddp-deploy-check-aaa\n"}, {"n1": ""}]
    failed = {**first, "n1": Result("n1", None, "token e /nas is not a writable directory\ntoken rc 3\n")}
    assert meetings.token_waves(inv, failed) == []


def test_the_session_finds_each_node_s_nic_and_infiniband_devices_for_its_launch(tmp_path):
    inv = _inv(tmp_path)
    nics = {n: f"1: lo    inet 127.0.0.1/8 scope host lo\n2: eth{i}    inet 127.0.0.{i}/24 scope global"
            for i, n in enumerate(("n1", "n2", "n3"), start=1)}
    final = {
        "n1": Result("n1", 0, _tagged(nics=(0, nics["n1"]), fabric=(0, "rdma_cm\nuverbs0"))),
        "n2": Result("n2", 0, _tagged(nics=(0, nics["n2"]), fabric=(0, ""))),
        "n3": Result("n3", 0, _tagged(nics=(1, ""), fabric=(0, ""))),
    }
    first = {n: Result(n, None, r.stdout) for n, r in final.items()}
    facts = preflight.facts_from(inv, first, final)
    assert facts["n1"] == preflight.NodeFacts(interface="lo", infiniband=True)  # 127.0.0.1 is on lo here
    assert facts["n2"] == preflight.NodeFacts(interface="eth2", infiniband=False)
    assert facts["n3"] == preflight.NodeFacts(interface=None, infiniband=False)  # `ip` failed: left to gloo/NCCL


@pytest.mark.parametrize("seen, store", [("same", True), ("other", True), ("same", False)])
def test_a_joining_node_alone_must_see_the_running_job_s_record_and_reach_its_store(fake_docker, tmp_path, monkeypatch, seen,
                                                                                   store):
    """join: the checks run on the joining node only; the store of the running job listens (its
    port in use is the point), and the record on the shared storage must match a running node's."""
    monkeypatch.setattr(preflight, "LISTEN_SECONDS", 2)
    record = tmp_path / "nas/ckpt/.ddp-deploy/pf/launch.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"job": "pf"}\n')
    with socket.create_server(("127.0.0.2", 0)) as running_store:
        running_store.listen(8)
        port = running_store.getsockname()[1] if store else free_port()
        inv = _inv(tmp_path, port=port)
        text = '{"job": "pf"}\n' if seen == "same" else '{"job": "other"}\n'
        with CountingRemote(inv) as remote:
            checks = preflight.join_checks(inv, remote, "n3", (str(record), text)).checks
    assert remote.commands == ["n3"] and {c.node for c in checks} == {"n3"}
    rows = {c.name: (c.ok, c.detail) for c in checks}
    assert rows["shared storage"] == ((True, f"sees the running job's launch record {record}") if seen == "same" else
                                      (False, f"does not see the running job's launch record {record} (another "
                                              "content): not the same storage"))
    assert rows["rendezvous"] == (store, f"{'reaches' if store else 'cannot reach'} the running job's store at "
                                         f"127.0.0.2:{port}")
    assert rows["previous run"] == (True, "none") and rows["torch"][0]


# The fake docker above, which also knows its image's id ($FAKE_IMAGE_ID) and counts the probe's runs.
KEEPING_DOCKER = """#!/bin/sh
case "$1" in
  version) case "$3" in *Arch*) echo linux/amd64 ;; *) echo 20.10.24 ;; esac ;;
  image) echo "sha256:$FAKE_IMAGE_ID" ;;
  inspect) echo "Error response from daemon: No such container: $6" >&2; exit 1 ;;
  run) echo run >> "$FAKE_RUNS"; while [ "$1" != --entrypoint ]; do shift; done; shift 3; exec PYTHON "$@" ;;
  *) echo "fake docker: unexpected $*" >&2; exit 99 ;;
esac
""".replace("PYTHON", sys.executable)


def _torch_row(inv, remote, for_launch):
    (row,) = [c for c in preflight.run_checks(inv, remote, for_launch=for_launch).checks if c.name == "torch"]
    assert row.ok, row
    return row.detail


def test_a_launch_reuses_check_s_probe_answer_for_its_image_and_probes_a_rebuilt_one(tmp_path, monkeypatch):
    """A launch takes the probe answer check kept for the same image, and a rebuilt image is probed again."""
    install_command(tmp_path, monkeypatch, "docker", KEEPING_DOCKER)
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    runs = tmp_path / "runs"
    monkeypatch.setenv("FAKE_RUNS", str(runs))
    monkeypatch.setenv("FAKE_IMAGE_ID", "a" * 64)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME")  # tests/conftest.py gives each test its own: here, the default
    inv = _inv(tmp_path, nodes=1, rdzv="n1")
    kept_dir = tmp_path / "home/.cache/ddp-deploy/probe"
    with Remote(inv) as remote:
        assert "kept" not in _torch_row(inv, remote, False)  # check probes
        assert "kept" not in _torch_row(inv, remote, False)  # every time
        assert len(runs.read_text().split()) == 2
        (kept,) = kept_dir.iterdir()
        assert kept.name.endswith("-" + "a" * 64) and (kept_dir.stat().st_mode & 0o777) == 0o700
        said = _torch_row(inv, remote, True)  # launch takes the kept answer: no container
        assert "the answer the node kept for this image and probe command, probed 20" in said, said
        assert len(runs.read_text().split()) == 2
        monkeypatch.setenv("FAKE_IMAGE_ID", "b" * 64)  # the image rebuilt under the same name
        assert "kept" not in _torch_row(inv, remote, True)
        assert len(runs.read_text().split()) == 3


def test_a_gpu_node_is_probed_every_time_and_the_key_follows_the_command(tmp_path):
    inv = _inv(tmp_path, nodes=2, rdzv="n1")
    from deploy.job import plan

    bare = plan.probe_argv(inv, inv.node("n1"))
    kept = plan.probe_argv(inv, inv.node("n1"), reuse=True)
    assert kept[:2] == ("sh", "-c") and kept[3:5] == ("sh", "reuse") and kept[-len(bare):] == bare
    assert plan.probe_argv(inv, inv.node("n1"), reuse=False)[4] == "keep"
    other = plan.probe_argv(inv, inv.node("n2"), reuse=True)  # its own DDP_NODE_NAME: its own key
    assert other[5] != kept[5] and kept[6] == "ddp-trainer:latest"
    gpu = loads(json.dumps({**_raw(tmp_path),
                            "nodes": [{"name": "g", "address": "127.0.0.1", "connection": "local", "gpus": 2}],
                            "rendezvous": {"node": "g", "port": 29400}}))
    assert plan.probe_argv(gpu, gpu.node("g"), reuse=True) == plan.probe_argv(gpu, gpu.node("g"))
    host = loads(json.dumps({**_raw(tmp_path), "job": {"name": "pf", "runtime": "host"},
                             "train": {"python": sys.executable}}))
    plain = plan.probe_argv(host, host.node("n1"))
    hosted = plan.probe_argv(host, host.node("n1"), reuse=True)  # the probe keeps it (test_deploy_probe_kept.py)
    assert hosted[:2] == ("sh", "-c") and hosted[3:5] == ("sh", "reuse") and hosted[6:] == plain


def _raw(tmp_path: Path) -> dict:
    return {"job": {"name": "pf", "runtime": "docker"}, "rendezvous": {"node": "n1", "port": 29400},
            "nodes": [{"name": "n1", "address": "127.0.0.1", "connection": "local"}],
            "storage": {"data": {"host": str(tmp_path / "nas/data"), "container": "/data"},
                        "checkpoints": {"host": str(tmp_path / "nas/ckpt"), "container": "/ckpt"}}}


@pytest.mark.parametrize("answer", ['{"torch": null, "error": "cannot import torch: boom", "program_error": null}',
                                    '{"torch": "2.13.0", "error": null, "program_error": "No module named \'x\'"}',
                                    "not json at all"])
def test_a_failed_probe_answer_is_never_kept_and_is_probed_again(tmp_path, answer):
    from deploy.job.scripts import PROBE_KEPT

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\necho sha256:abc\n')
    (bin_dir / "docker").chmod(0o755)
    runs = tmp_path / "runs"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    probe = ["sh", "-c", f'echo run >> {runs}; echo "PROBE $1"', "sh", answer]
    for mode in ("keep", "reuse", "reuse"):
        r = subprocess.run(["sh", "-c", PROBE_KEPT, "sh", mode, "k" * 32, "img", *probe], env=env,
                           capture_output=True, text=True)
        assert r.stdout == f"PROBE {answer}\n" and r.returncode == 0, r
    assert len(runs.read_text().split()) == 3
    assert not (tmp_path / ".cache/ddp-deploy/probe").exists() or not any((tmp_path / ".cache/ddp-deploy/probe").iterdir())


@pytest.mark.parametrize("line", ["PROBE_KEPT \x1b[31m1\x1b[0m", "PROBE_KEPT 99999999999999999999", "PROBE_KEPT"])
def test_a_kept_answer_s_date_that_is_no_number_is_not_shown(line):
    assert node_checks._kept(f"{line}\nPROBE {{}}\n") == ""
