"""hosts.yaml validation: every broken file in tests/hosts_corpus is refused through the real
CLI with exit code 2, one line naming the file, field path and line, before any connection."""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path

import pytest

from deploy.inventory import load, loads

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).resolve().parent / "hosts_corpus"
BROKEN = sorted(p for p in CORPUS.glob("*.yaml") if p.name != "valid.yaml")


class AcceptRecorder:
    """A loopback TCP listener that counts connection attempts (where SSH would go)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock2 = socket.create_server(("127.0.0.2", self.port))
        self.accepted = 0
        for s in (self.sock, self.sock2):
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def _serve(self, s: socket.socket) -> None:
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self.sock2.close()


@pytest.fixture
def recorder():
    r = AcceptRecorder()
    yield r
    r.close()


def _materialize(src: Path, port: int, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    dst.write_bytes(src.read_bytes().replace(b"{{PORT}}", str(port).encode()))  # some are not UTF-8 on purpose
    return dst


def _expectation(path: Path) -> tuple[str, str]:
    m = re.match(r"# expect: field=(\S*) line=(\S+)", path.read_bytes().decode("ascii", "replace"))
    assert m, f"{path.name} lacks its '# expect:' header"
    return m.group(1), m.group(2)


@pytest.mark.parametrize("case", BROKEN, ids=lambda p: p.stem)
def test_broken_inventory_exits_2_naming_field_and_line_without_connecting(ddp, case, recorder, tmp_path):
    hosts = _materialize(case, recorder.port, tmp_path)
    field, line = _expectation(case)
    result = ddp(hosts, "check")
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert errors, result.output
    assert all("Traceback" not in ln for ln in result.output.splitlines())
    where = f"{hosts}:{line}: " if line != "-" else f"{hosts}"
    expected_field = f"{field}: " if field else "(document): "
    assert any(where in ln and expected_field in ln for ln in errors), errors
    assert recorder.accepted == 0


def test_valid_corpus_file_does_reach_the_listener(ddp, recorder, tmp_path):
    """Positive control: the recorder notices when the tool does connect."""
    hosts = _materialize(CORPUS / "valid.yaml", recorder.port, tmp_path)
    result = ddp(hosts, "check")
    assert result.exit_code == 1, result.output
    assert recorder.accepted >= 2
    assert "n1" in result.output and "n2" in result.output


def test_validate_exits_2_on_missing_file(ddp, tmp_path):
    result = ddp(tmp_path / "nope.yaml", "validate")
    assert result.exit_code == 2
    assert "cannot read the file" in result.stderr


@pytest.mark.parametrize("name", ["hosts.yaml", "hosts.example.yaml"])
def test_shipped_inventories_validate(ddp, name):
    result = ddp(REPO / name, "validate")
    assert result.exit_code == 0, result.output


def test_shipped_hosts_yaml_is_this_machine_alone():
    inv = load(REPO / "hosts.yaml")
    (node,) = inv.nodes
    assert node.connection == "local" and inv.job.runtime == "host"
    assert inv.python_path() == str(REPO / ".venv/bin/python")


def test_inventory_objects_are_frozen():
    inv = load(REPO / "hosts.example.yaml")
    with pytest.raises(Exception):
        inv.nodes[0].gpus = 1  # type: ignore[misc]


def test_per_node_ssh_overrides_merge_with_defaults():
    inv = load(REPO / "hosts.example.yaml")
    gpu3 = inv.node("gpu3")
    s = inv.ssh_for(gpu3)
    assert (s.user, s.port, s.host_key_policy) == ("ops", 2222, "strict")
    assert inv.ssh_for(inv.node("gpu1")).port == 22


def test_procs_default_to_gpus_or_one():
    inv = load(REPO / "hosts.example.yaml")
    assert inv.node("gpu1").nprocs == 8


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "DDP_DEPLOY_RUN"])
def test_environment_the_tool_sets_itself_cannot_be_overridden(name):
    text = (REPO / "hosts.example.yaml").read_text().replace("NCCL_DEBUG: WARN", f"{name}: '0'")
    with pytest.raises(Exception, match=f"{name} is set by the tool"):
        from deploy.inventory import loads
        loads(text)


def test_image_transfer_auto_picks_registry_or_star_by_the_settings_else_chain():
    """image.transfer auto picks registry for a registry name, star for compress, else chain."""
    from deploy.inventory import Image
    assert Image().delivery == "chain"
    assert Image(name="registry.example.com:5000/team/ddp:1").delivery == "registry"
    assert Image(name="localhost/ddp:1").delivery == "registry"
    assert Image(name="team/ddp:1").delivery == "chain"  # a Docker Hub namespace, not a registry
    assert Image(compress=True).delivery == "star"
    assert Image(transfer="star", name="reg.io/ddp:1").delivery == "star"


@pytest.mark.parametrize("fields, words", [
    ({"transfer": "registry"}, "needs image.name to name the registry"),
    ({"transfer": "chain", "compress": True}, "applies to transfer: star only"),
    ({"stall_seconds": 0}, "greater than 0"),
])
def test_image_transfer_settings_that_cannot_work_are_refused_with_the_field(fields, words):
    from pydantic import ValidationError

    from deploy.inventory import Image
    with pytest.raises(ValidationError, match=words):
        Image(**fields)


# Every count and duration of hosts.yaml has an upper bound: past it, exit 2 naming the field and the limit.

BOUNDED = """job:
  name: j
  runtime: host{job}
rendezvous:
  node: a{rendezvous}
ssh:
  user: ops{ssh}
storage:
  data: {{host: /d, container: /data}}
  checkpoints: {{host: /c, container: /ckpt}}{storage}
nodes:
  - name: a
    address: 127.0.0.1{node}
"""
SLURM = """job:
  name: j
  runtime: host
storage:
  data: {{host: /d, container: /data}}
  checkpoints: {{host: /c, container: /ckpt}}
slurm:
  login: {{address: 127.0.0.1}}
  nodes: 1{slurm}
"""
LINE = {"job": 4, "rendezvous": 6, "ssh": 8, "storage": 11, "node": 14, "slurm": 10}
"""The line an extra key of each part lands on in BOUNDED (SLURM for slurm)."""
DIGITS_4000 = "9" * 4000


@pytest.mark.parametrize("part, key, value, field, limit", [
    ("job", "max_restarts", "1001", "job.max_restarts", "less than or equal to 1000"),
    ("job", "keep_runs", "10001", "job.keep_runs", "less than or equal to 10000"),
    ("job", "stages", "1025", "job.stages", "less than or equal to 1024"),
    ("job", "min_nodes", "16385", "job.min_nodes", "less than or equal to 16384"),
    ("job", "stall_timeout", "604801", "job.stall_timeout", "at most a week"),
    ("rendezvous", "join_timeout", "604801", "rendezvous.join_timeout", "less than or equal to 604800"),
    ("rendezvous", "last_call_timeout", "604801", "rendezvous.last_call_timeout", "less than or equal to 604800"),
    ("ssh", "connect_timeout", "3601", "ssh.connect_timeout", "less than or equal to 3600"),
    ("node", "ssh: {connect_timeout: 3601}", None, "nodes[0].ssh.connect_timeout", "less than or equal to 3600"),
    ("node", "procs", "1025", "nodes[0].procs", "less than or equal to 1024"),
    ("node", "procs", DIGITS_4000, "nodes[0].procs", "less than or equal to 1024"),
    ("node", "gpus", "1025", "nodes[0].gpus", "less than or equal to 1024"),
    ("node", "gpus", DIGITS_4000, "nodes[0].gpus", "less than or equal to 1024"),
    ("node", "gpus: 8\n    gpu_ids: [1024]", None, "nodes[0].gpu_ids[0]", "less than 1024"),
    ("node", f"gpus: 8\n    gpu_ids: [{', '.join(['0'] * 1025)}]", None, "nodes[0].gpu_ids", "at most 1024 items"),
    ("storage", "min_free_gb", "1e7", "storage.min_free_gb", "less than or equal to 1000000"),
    ("storage", "min_free_gb", ".inf", "storage.min_free_gb", "less than or equal to 1000000"),
    ("slurm", "nodes", "16385", "slurm.nodes", "less than or equal to 16384"),
    ("slurm", "procs_per_node", "1025", "slurm.procs_per_node", "less than or equal to 1024"),
    ("slurm", "gpus_per_node", DIGITS_4000, "slurm.gpus_per_node", "less than or equal to 1024"),
    ("node", "procs", "9" * 5000, "nodes[0].procs", "more than the 4096 any number may have"),
])
def test_a_count_or_duration_past_its_bound_is_refused_naming_the_field_and_limit(
        ddp, tmp_path, part, key, value, field, limit):
    """A count or duration past its upper bound is refused, naming the field and the limit."""
    line = f"{key}: {value}" if value is not None else key
    if part == "slurm":
        text = SLURM.format(slurm="" if key == "nodes" else f"\n  {line}")
        if key == "nodes":
            text = text.replace("nodes: 1", line)
    else:
        extra = {p: "" for p in LINE if p != "slurm"}
        extra[part] = f"\n    {line}" if part == "node" else f"\n  {line}"
        text = BOUNDED.format(**extra)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(text)
    at = LINE[part] + line.count("\n") - (1 if part == "slurm" and key == "nodes" else 0)
    for verb in (["validate"], ["launch", "--dry-run"]):
        result = ddp(hosts, *verb)
        assert result.exit_code == 2, (verb, result.output[:2000])
        errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
        assert any(ln.startswith(f"error: {hosts}:{at}: {field}: ") and limit in ln for ln in errors), errors
        assert all(len(ln) < 400 for ln in errors), errors  # a long value is cut, not echoed


@pytest.mark.parametrize("part, line", [
    ("job", "max_restarts: 1000"), ("job", "keep_runs: 10000"), ("job", "stall_timeout: 604800"),
    ("rendezvous", "join_timeout: 604800"), ("ssh", "connect_timeout: 3600"), ("node", "procs: 1024"),
    ("storage", "min_free_gb: 1000000"),
])
def test_a_count_or_duration_at_its_upper_bound_is_taken(tmp_path, part, line):
    extra = {p: "" for p in LINE if p != "slurm"}
    extra[part] = f"\n    {line}" if part == "node" else f"\n  {line}"
    inv = loads(BOUNDED.format(**extra))
    assert inv is not None
