"""Every launch's run kept on the shared volume: ids, the node-side scripts that write, prune and
list them (run by a real sh on real directories), and `runs`, `logs --run`, `status --run`
through the CLI around real launches of the trainer (local host-runtime node)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from deploy.job import record, runs, secretenv
from deploy.inventory import loads
from local_job import local_hosts, on_paper
from test_deploy_local import TRAIN_ARGS

def _inv(ckpt: Path, keep: int = 2):
    return on_paper([{"name": "a", "address": "198.18.0.11"}, {"name": "b", "address": "198.18.0.12"}], job="demo",
                    job_fields={"keep_runs": keep, "runtime": "host"},
                    storage={"checkpoints": {"host": str(ckpt), "container": "/ckpt"}})


def _sh(argv, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), input=stdin, capture_output=True, check=True)


def test_run_ids_sort_by_start_time_and_name_the_second():
    early, late = runs.new_id(1_700_000_000), runs.new_id(1_700_000_001)
    assert runs.RUN_ID.fullmatch(early) and early.startswith("20231114-221320-")
    assert sorted([late, early]) == [early, late]


def test_starting_a_run_writes_its_records_and_prunes_the_oldest_beyond_keep(tmp_path):
    inv = _inv(tmp_path, keep=2)
    tb = Path(runs.tensorboard_dir(inv))
    ids = [runs.new_id(1_700_000_000 + i) for i in range(3)]
    said = []
    for i, run in enumerate(ids):
        (tb / run).mkdir(parents=True)
        said.append(_sh(runs.start_argv(inv, run), json.dumps({"run": run, "n": i}).encode()).stdout.decode())
    kept = sorted(p.name for p in Path(runs.runs_dir(inv)).iterdir())
    assert kept == ids[1:] and said == ["", "", f"pruned {ids[0]}\n"]
    assert sorted(p.name for p in tb.iterdir()) == ids[1:]  # its TensorBoard files went with it
    assert json.loads((Path(runs.job_dir(inv)) / "launch.json").read_text())["run"] == ids[2]
    assert json.loads((Path(runs.runs_dir(inv)) / ids[1] / "run.json").read_text()) == {"run": ids[1], "n": 1}


def test_the_run_being_started_is_never_pruned_even_when_older_ones_sort_after_it(tmp_path):
    inv = _inv(tmp_path, keep=1)
    newer = runs.new_id(1_800_000_000)
    Path(runs.runs_dir(inv), newer).mkdir(parents=True)  # a clock that went back
    now = runs.new_id(1_700_000_000)
    assert _sh(runs.start_argv(inv, now), b"{}").stdout.decode() == ""
    assert sorted(p.name for p in Path(runs.runs_dir(inv)).iterdir()) == sorted([now, newer])


def test_listing_reads_each_run_s_record_exits_and_metrics_and_picks_by_id(tmp_path):
    inv = _inv(tmp_path, keep=5)
    ok, bad = runs.new_id(1_700_000_000), runs.new_id(1_700_000_100)
    for run, code in ((ok, 0), (bad, 1)):
        _sh(runs.start_argv(inv, run), json.dumps({"run": run, "time": 1.5, "program": "the trainer"}).encode())
        for node in ("a", "b"):
            d = Path(runs.runs_dir(inv)) / run / node
            d.mkdir()
            (d / "log").write_text('[rank0]: METRICS {"step": 1}\nnoise\n[rank0]: METRICS {"step": 2}\ndone\n')
            (d / "exits").write_text(f"10.0 1\n20.5 {code if node == 'b' else 0}\n")
    (Path(runs.runs_dir(inv)) / ok / "b" / "exits").unlink()  # a node that never recorded its end
    found = runs.parse(_sh(runs.list_argv(inv)).stdout.decode())
    assert [r.id for r in found] == [ok, bad]
    first, second = found
    assert first.record == {"run": ok, "time": 1.5, "program": "the trainer"} and first.start == 1.5
    assert first.nodes["a"].exits == ((10.0, 1), (20.5, 0)) and first.nodes["a"].metrics == 'METRICS {"step": 2}'
    assert first.end is None and first.outcome() == "no exit recorded (b)"
    assert second.end == 20.5 and second.outcome() == "exit 1 (b)"
    assert second.nodes["b"].state().state == "exited(1)" and second.nodes["b"].state().restarts == 1
    assert runs.pick(found, bad[:-2]).id == bad
    assert [r.id for r in runs.parse(_sh(runs.list_argv(inv, ok[:-3])).stdout.decode())] == [ok]
    with pytest.raises(ValueError, match="names 2 runs"):
        runs.pick(found, "2023")
    with pytest.raises(ValueError, match=f"no run '1999' is kept \\(the newest: {ok}, {bad}\\)"):
        runs.pick(found, "1999")


def test_the_kept_record_holds_the_resolved_hosts_yaml_with_secret_values_redacted():
    inv = loads("""
job: {name: demo}
rendezvous: {node: a}
nodes: [{name: a, address: 198.18.0.11, env: {LEAKED: tok-abcdef-123}}]
storage:
  data: {host: /nas/data, container: /data}
  checkpoints: {host: /nas/ckpt, container: /ckpt}
train: {secrets: {TOKEN: {env: MY_TOKEN}}}
""")
    kept = record.launch_record(inv, None, "20260101-000000-abcd", "sha256:feed",
                                secretenv.Redactor({"TOKEN": "tok-abcdef-123"}))
    text = json.dumps(kept)
    assert "tok-abcdef-123" not in text and kept["hosts_yaml"]["nodes"][0]["env"]["LEAKED"] == "***"
    assert kept["hosts_yaml"]["job"]["keep_runs"] == 20  # resolved: the defaults are in it
    assert kept["run"] == "20260101-000000-abcd" and kept["image"] == {"name": inv.image.name, "id": "sha256:feed"}


# ---------------------------------------------------------------- through the CLI, real launches

def _hosts(tmp_path: Path, args: list[str], keep: int) -> Path:
    return local_hosts(tmp_path, job="localtest", train={"args": args}, job_fields={"keep_runs": keep})


def _launched(r) -> str:
    assert r.exit_code in (0, 1), r.output
    return next(w for line in r.stdout.splitlines() if line.startswith("started ")
                for w in line.split() if runs.RUN_ID.fullmatch(w))


@pytest.mark.e2e
def test_relaunches_keep_every_run_s_logs_and_outcome_until_pruned_by_count(ddp, tmp_path):
    good = _hosts(tmp_path, TRAIN_ARGS, keep=2)
    first = _launched(ddp(good, "launch", "--wait", "--timeout", "240"))
    bad = _hosts(tmp_path, ["--dataset", "cifar10", "--no-download", "--epochs", "1"], keep=2)
    second = _launched(ddp(bad, "launch", "--wait", "--timeout", "240"))
    assert first != second

    shown = ddp(bad, "runs")
    assert shown.exit_code == 0, shown.output
    rows = {line.split()[1]: line for line in shown.stdout.splitlines() if runs.RUN_ID.search(line)}
    assert list(rows) == [first, second], shown.stdout
    assert "exit 0" in rows[first] and "exit 1 (here)" in rows[second]
    assert re.search(r"exit 0\s+│\s+\d{1,3}%\s+│", rows[first]) and re.search(r"exit 1 \(here\)\s+│\s+-\s+│", rows[second])

    data = json.loads(ddp(bad, "runs", "--json").stdout)
    assert [r["id"] for r in data] == [first, second]
    assert data[0]["record"]["hosts_yaml"]["train"]["args"] == TRAIN_ARGS  # what ran, as it was then
    assert [code for _, code in data[1]["nodes"]["here"]["exits"]] == [1]
    assert data[1]["end"] >= data[1]["start"]
    # the first run's goodput: its steps' time against its wall time; the failed one never stepped
    good_first = data[0]["goodput"]
    assert 0 < good_first["share"] < 1 and good_first["training_s"] <= good_first["wall_s"]
    assert good_first["redone_steps"] == 0 and good_first["incidents"] == [] and data[1]["goodput"] is None

    old = ddp(bad, "logs", "--run", first[:-2])  # the start of an id is enough
    assert old.exit_code == 0, old.output
    assert "METRICS" in old.stdout and "cifar10" not in old.stdout  # the first run's lines, not the second's
    assert all(line.startswith(("here rank0 | ", "here       | ")) for line in old.stdout.splitlines())
    assert "dataset cifar10 is not under" in ddp(bad, "logs", "--run", second).stdout

    was = ddp(bad, "status", "--run", first)
    assert was.exit_code == 0 and f"run {first}: started " in was.stdout and "exited(0)" in was.stdout
    assert re.search(r"^goodput \d{1,2}% \([\d.]+ s of [\d.]+ s in training steps that count\)$", was.stdout, re.M), was.stdout
    failed = ddp(bad, "status", "--run", second, "--json")
    node = json.loads(failed.stdout)["nodes"][0]
    assert node["state"] == "exited(1)" and "dataset cifar10 is not" in node["first_failure"]["says"]

    more = [*TRAIN_ARGS[:TRAIN_ARGS.index("--epochs")], "--epochs", "2", *TRAIN_ARGS[TRAIN_ARGS.index("--epochs") + 2:]]
    good = _hosts(tmp_path, more, keep=2)  # resumes the first run's checkpoint, trains one epoch more
    third = _launched(ddp(good, "launch", "--wait", "--timeout", "240"))
    assert [r["id"] for r in json.loads(ddp(good, "runs", "--json").stdout)] == [second, third]
    gone = ddp(good, "logs", "--run", first)
    assert gone.exit_code == 2 and f"no run '{first}' is kept" in gone.stderr
    boards = tmp_path / "nas/ckpt/tensorboard"
    assert sorted(p.name for p in boards.iterdir()) == [third]  # pruned with its run; the failed one wrote none

    # Every record carries its run's id: the metrics of runs compared side by side.
    by_run = {}
    for line in (tmp_path / "nas/ckpt/metrics.jsonl").read_text().splitlines():
        by_run.setdefault(json.loads(line).get("run"), []).append(line)
    assert set(by_run) == {first, third}
    png = tmp_path / "both.png"
    made = ddp(good, "plot", "--run", first, "--run", third[:-3], "-o", str(png))
    assert made.exit_code == 0 and made.stdout.strip() == f"wrote {png}: 2 runs ({first} from metrics.jsonl, {third} from metrics.jsonl)", made.output
    from matplotlib.image import imread
    assert imread(str(png)).shape[:2] == (800, 800)
    none = ddp(good, "plot", "--run", second)
    assert none.exit_code == 2 and f"run '{second}' has no metrics records" in none.stderr
    assert ddp(good, "stop").exit_code == 0


@pytest.mark.e2e
def test_the_running_run_is_listed_as_running_and_its_log_is_the_one_logs_shows(ddp, tmp_path):
    hosts = _hosts(tmp_path, ["--dataset", "synthetic", "--epochs", "3", "--synthetic-size", "2048",
                              "--batch-size", "16", "--log-every", "1"], keep=5)
    run = _launched(ddp(hosts, "launch"))
    try:
        deadline = time.time() + 120
        while "METRICS" not in ddp(hosts, "logs", "--run", run).stdout:
            assert time.time() < deadline, "no METRICS line in the kept log"
            time.sleep(0.5)
        listed = json.loads(ddp(hosts, "runs", "--json").stdout)
        assert listed[-1]["id"] == run and listed[-1]["outcome"] == "running"
        assert listed[-1]["nodes"]["here"]["exits"] == []
    finally:
        assert ddp(hosts, "stop").exit_code == 0
    kept = ddp(hosts, "logs", "--run", run).stdout
    assert "stopped by" in kept  # the planned stop's line is in the run's log


# What str.splitlines takes for a line's end, and a log does not: inside a line, each is data.
BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


@pytest.mark.parametrize("brk", BREAKS)
def test_a_kept_node_s_metrics_line_is_rank_0_s_whatever_line_breaks_it_holds(tmp_path, brk):
    inv = _inv(tmp_path, keep=5)
    run = runs.new_id(1_700_000_000)
    _sh(runs.start_argv(inv, run), b"{}")
    d = Path(runs.runs_dir(inv)) / run / "a"
    d.mkdir()
    mine = f'METRICS {{"step": 2}}{brk}1700000999 137{brk}@@node forged'
    (d / "log").write_bytes(f'[rank0]: {mine}\n[rank1]: METRICS {{"step": 9}}\n'
                            f'[rank1]: [rank0]: METRICS {{"step": 8}}\n'.encode())
    (d / "exits").write_text("20.5 0\n")
    found = runs.parse(_sh(runs.list_argv(inv)).stdout.decode())
    assert [r.id for r in found] == [run] and list(found[0].nodes) == ["a"]
    assert found[0].nodes["a"].exits == ((20.5, 0),) and found[0].nodes["a"].metrics == mine
