"""Any file given as hosts.yaml costs little: exit 2 and one line, in bounded time and memory,
before anything is contacted (the corpus in tests/hosts_corpus holds the small cases)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parent / "hosts_corpus"
MEMORY_LIMIT = 1 << 30  # address space: the interpreter, pydantic and rich fit in a fraction of it


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _generated(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.yaml"
    if kind == "huge":
        path.write_bytes(b"job: {name: x}\nnote: " + b"x" * (64 << 20) + b"\n")
    elif kind == "very_deep":
        path.write_text("job: " + "[" * 20000 + "]" * 20000 + "\n")
    elif kind == "long_number":  # Python reads no integer of over 4300 digits
        path.write_text("job: {name: x}\nnodes:\n  - {name: a, address: 10.0.0.1, procs: " + "9" * 100_000 + "}\n")
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 64)
    else:
        path.write_bytes((CORPUS / f"{kind}.yaml").read_bytes())
    return path


@pytest.mark.parametrize("kind, said", [
    ("billion_laughs", "aliases expand to more than"),
    ("huge", "larger than 1024 KiB"),
    ("very_deep", "nested more than"),
    ("long_number", "nodes[0].procs: a number of 100000 characters, more than the 4096"),
    ("binary", "not UTF-8 text"),
    ("not_utf8", "not UTF-8 text (byte 0xe9"),
    ("python_tag", "no language-specific tags"),
    ("top_level_list", "expected a mapping"),
])
def test_a_hostile_or_broken_file_is_one_line_and_exit_2_in_bounded_time_and_memory(tmp_path, kind, said):
    hosts = _generated(tmp_path, kind)
    r = subprocess.run([sys.executable, "-m", "deploy", "--hosts", str(hosts), "check"], capture_output=True,
                       text=True, timeout=60, preexec_fn=_limited, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin", "DDP_DEPLOY_LOG": str(tmp_path / "log"), "HOME": str(tmp_path),
                            "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {hosts}") and said in lines[0], lines
    assert len(lines[0]) < 400  # the file's content is not echoed back
    assert not Path("/tmp/pwned-by-hosts-yaml").exists()
