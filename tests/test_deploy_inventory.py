"""hosts.yaml validation: every broken file in tests/hosts_corpus is refused through the real
CLI with exit code 2, one line naming the file, field path and line, before any connection."""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from deploy.cli import cli
from deploy.inventory import load

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
def test_broken_inventory_exits_2_naming_field_and_line_without_connecting(case, recorder, tmp_path):
    hosts = _materialize(case, recorder.port, tmp_path)
    field, line = _expectation(case)
    result = CliRunner().invoke(cli, ["--hosts", str(hosts), "check"], env={"DDP_DEPLOY_LOG": str(tmp_path / "log")})
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert errors, result.output
    assert all("Traceback" not in ln for ln in result.output.splitlines())
    where = f"{hosts}:{line}: " if line != "-" else f"{hosts}"
    expected_field = f"{field}: " if field else "(document): "
    assert any(where in ln and expected_field in ln for ln in errors), errors
    assert recorder.accepted == 0


def test_valid_corpus_file_does_reach_the_listener(recorder, tmp_path):
    """Positive control: the recorder notices when the tool does connect."""
    hosts = _materialize(CORPUS / "valid.yaml", recorder.port, tmp_path)
    result = CliRunner().invoke(cli, ["--hosts", str(hosts), "check"], env={"DDP_DEPLOY_LOG": str(tmp_path / "log")})
    assert result.exit_code == 1, result.output
    assert recorder.accepted >= 2
    assert "n1" in result.output and "n2" in result.output


def test_validate_exits_2_on_missing_file(tmp_path):
    result = CliRunner().invoke(cli, ["--hosts", str(tmp_path / "nope.yaml"), "validate"])
    assert result.exit_code == 2
    assert "cannot read the file" in result.stderr


@pytest.mark.parametrize("name", ["hosts.yaml", "hosts.example.yaml"])
def test_shipped_inventories_validate(name):
    result = CliRunner().invoke(cli, ["--hosts", str(REPO / name), "validate"])
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


def test_image_transfer_auto_picks_registry_for_a_registry_name_star_for_compress_else_chain():
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
