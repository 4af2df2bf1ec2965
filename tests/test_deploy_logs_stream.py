"""`logs` streams: each line is printed as it comes, none of the log is held, for a node reached
locally and over SSH (a throwaway sshd on 127.0.0.1), for the running job's log and a kept run's.
Real files, the real CLI in a process of its own, the real tail."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deploy.inventory import loads
from deploy.nodes.remote import Remote
from deploy.nodes.transport import MAX_LINE
from fakes import free_port
from sshd import SSHD, start_sshd
from local_job import inventory

ROOT = Path(__file__).resolve().parents[1]
JOB, NODE = "streamtest", "n1"
KEPT_SMALL, KEPT_LARGE = "20261125-100000-aaaa", "20261125-110000-bbbb"
LARGE_LINES, LINE = 48_000, "x" * 1000  # 48 MB
HAS_SSHD = os.path.exists(SSHD) and shutil.which("ssh-keygen") and os.geteuid() == 0


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if not HAS_SSHD:
        pytest.skip("needs root, sshd and ssh-keygen")
    proc, info = start_sshd(tmp_path_factory.mktemp("sshd"), free_port())
    yield info
    proc.terminate()
    proc.wait()


@pytest.fixture(params=["local", "ssh"])
def hosts(request, tmp_path) -> Path:
    """hosts.yaml of one host-runtime node, reached locally or over SSH."""
    node = {"name": NODE, "address": "127.0.0.1"}
    ssh = {}
    if request.param == "local":
        node["connection"] = "local"
    else:
        d = request.getfixturevalue("sshd")
        known = tmp_path / "known_hosts"
        known.write_text(f"[127.0.0.1]:{d['port']} {d['host_key']}\n")
        ssh = {"ssh": {"user": "root", "port": d["port"], "key": str(d["dir"] / "client_key"),
                       "known_hosts": str(known), "connect_timeout": 3}}
    path = tmp_path / "hosts.yaml"
    path.write_text(json.dumps(inventory([node], job=JOB, nas=tmp_path, job_fields={"runtime": "host"}, **ssh)))
    return path


def _job_dir(hosts: Path) -> Path:
    return hosts.parent / "ckpt" / ".ddp-deploy" / JOB


def _cli(hosts: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deploy", "--hosts", str(hosts), *args], cwd=ROOT,
                            env={**os.environ, "DDP_DEPLOY_LOG": str(hosts.parent / "debug.log")}, **kw)


def test_logs_prints_the_first_lines_while_the_program_still_writes_its_log(hosts):
    """The log is a pipe the test holds open: every line printed before it is closed was printed
    while the log was still being written, which reading the whole log first never does."""
    log = _job_dir(hosts) / NODE / "log"
    log.parent.mkdir(parents=True)
    os.mkfifo(log)
    lines = [f"[rank0]: line {i} " + "y" * 100 for i in range(20_000)]  # 2 MB: more than tail's buffer
    cli = _cli(hosts, "logs", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    holding = threading.Event()
    threading.Thread(target=_write, args=(log, lines, holding.wait), daemon=True).start()
    try:
        sel = selectors.DefaultSelector()
        sel.register(cli.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=30), "nothing printed while the log was open"
        first = cli.stdout.readline()
        assert first == f"{NODE} rank0 | line 0 {'y' * 100}\n"
    finally:
        holding.set()
        rest, err = cli.stdout.read(), cli.stderr.read()  # the stdout buffered after the first line too
        cli.wait(timeout=60)
    assert cli.returncode == 0, err
    assert [first, *rest.splitlines(keepends=True)] == [f"{NODE} rank0 | {line[9:]}\n" for line in lines]


def _write(path: Path, lines: list[str], then) -> None:
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
        fh.flush()
        then()


def _kept(hosts: Path, run: str, lines: int) -> None:
    d = _job_dir(hosts) / "runs" / run / NODE
    d.mkdir(parents=True)
    (d.parent / "run.json").write_text("{}")
    with open(d / "log", "w") as fh:
        for i in range(lines):
            fh.write(f"[rank1]: {i} {LINE}\n")


def _max_rss_kib(hosts: Path, run: str, out: Path) -> int:
    code = ("import resource, sys\nfrom deploy.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
            "    print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
    with open(out, "w") as fh:
        proc = subprocess.run([sys.executable, "-c", code, "--hosts", str(hosts), "logs", "--run", run], cwd=ROOT,
                              env={**os.environ, "DDP_DEPLOY_LOG": str(hosts.parent / "debug.log")},
                              stdout=fh, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stderr.rsplit("MAXRSS", 1)[1])


def test_logs_of_a_large_kept_run_holds_none_of_it_in_memory(hosts, tmp_path):
    _kept(hosts, KEPT_SMALL, 1)
    _kept(hosts, KEPT_LARGE, LARGE_LINES)
    size_kib = (_job_dir(hosts) / "runs" / KEPT_LARGE / NODE / "log").stat().st_size // 1024
    small = _max_rss_kib(hosts, KEPT_SMALL, tmp_path / "small.out")
    large = _max_rss_kib(hosts, KEPT_LARGE, tmp_path / "large.out")
    with open(tmp_path / "large.out") as fh:
        count = sum(1 for _ in fh)
    assert count == LARGE_LINES
    assert (tmp_path / "large.out").read_text()[-30:].endswith(f"{NODE} rank1 | {LARGE_LINES - 1} {LINE}\n"[-30:])
    assert large - small < size_kib / 8, f"the CLI grew by {large - small} KiB for a {size_kib} KiB log"


def test_a_line_without_an_end_reaches_the_reader_in_bounded_pieces(hosts):
    inv = loads(hosts.read_text())
    pieces: list[int] = []
    size = 3 * MAX_LINE + 5
    with Remote(inv) as remote:
        got = remote.stream({NODE: ["sh", "-c", f"head -c {size} /dev/zero | tr '\\0' x"]},
                            lambda node, line: pieces.append(len(line)))[NODE]
    assert got.ok, got.summary()
    assert sum(pieces) == size and max(pieces) <= MAX_LINE


# What rank 0 can print to pass a line off as another rank's: that rank's prefix, at the start of a
# line or after a character that str.splitlines (not a log) takes for a line's end.
BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


def test_a_line_s_rank_is_the_stream_s_prefix_never_one_the_program_printed(hosts):
    log = _job_dir(hosts) / NODE / "log"
    log.parent.mkdir(parents=True)
    forged = [f"[rank0]: x{c}[rank1]: y" for c in BREAKS]
    log.write_bytes("\n".join(["[rank0]: [rank1]: hi", *forged, "[rank1]: mine", "[rank0]: [rank0]: Traceback",
                               "torchrun's own", ""]).encode())
    every = _cli(hosts, "logs", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = every.communicate(timeout=60)
    assert every.returncode == 0, err
    escaped = [repr(c)[1:-1] for c in BREAKS]  # each shown as its escape (deploy/text.py), inside its line
    assert out.decode().split("\n") == [
        f"{NODE} rank0 | [rank1]: hi", *(f"{NODE} rank0 | x{e}[rank1]: y" for e in escaped),
        f"{NODE} rank1 | mine", f"{NODE} rank0 | Traceback", f"{NODE}       | torchrun's own", ""]
    rank1 = _cli(hosts, "logs", "--rank", "1", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = rank1.communicate(timeout=60)
    assert rank1.returncode == 0, err
    assert out.decode() == f"{NODE} rank1 | mine\n"
