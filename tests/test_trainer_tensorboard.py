"""Rank 0's TensorBoard event files beside metrics.jsonl, and the run id on every record.

The end-to-end tests run the real launcher (2 processes, gloo on CPU) once on each tested point
of the supported torch range, and read the event files back with TensorBoard's own reader.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.dist import DistEnv
from trainer.metrics import SCALARS, TENSORBOARD_DIR, MetricsWriter, TensorBoardScalars
from agent.contract import RUN_ID_ENV, printed
from trainer_helpers import ROOT, SMALL, metrics, torchrun_cmd, trainer_env

RUN = "20261123-101500-beef"


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in a run's event files: [(step, value)], as TensorBoard shows them."""
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def as_stored(value: float) -> float:
    """TensorBoard keeps a scalar as a float32."""
    return numpy.float32(value).item()


def expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, tag in SCALARS.get(record["kind"], {}).items():
            out.setdefault(tag, []).append((record["step"], as_stored(record[key])))
    return out


def launch(python: str, tmp: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(python, tmp, *flags), env={**trainer_env(), **(env or {})},
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def main_env() -> DistEnv:
    return DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend=None)


# --- the real trainer ------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_launched_run_tags_every_record_and_writes_the_same_losses_to_tensorboard(torch_python, tmp_path):
    proc = launch(torch_python.python, tmp_path, *SMALL, env={RUN_ID_ENV: RUN})
    assert_ok(proc)
    ckpt = tmp_path / "ckpt"
    records = metrics(ckpt)
    assert {r["kind"] for r in records} == {"train", "eval", "final"}
    assert all(r["run"] == RUN for r in records)
    assert printed(proc.stdout) == records
    assert [p.name for p in (ckpt / TENSORBOARD_DIR).iterdir()] == [RUN]
    assert len(list((ckpt / TENSORBOARD_DIR / RUN).glob("events.out.tfevents.*"))) == 1  # rank 0 alone

    shown = scalars(ckpt / TENSORBOARD_DIR / RUN)
    assert shown == expected(records)
    train = [r for r in records if r["kind"] == "train"]
    assert shown["loss/train"] == [(r["step"], as_stored(r["loss"])) for r in train]
    assert [step for step, _ in shown["loss/eval"]] == [16, 32]  # the end of each epoch
    assert set(shown) == {"loss/train", "accuracy/train", "throughput/samples_per_s", "throughput/step_time_s",
                          "lr", "memory/peak_mb", "loss/eval", "accuracy/eval"}


@pytest.mark.e2e
def test_a_missing_tensorboard_package_costs_a_warning_not_the_run(tmp_path):
    blocked = tmp_path / "no-tensorboard" / "tensorboard"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('No module named tensorboard (test)')\n")
    env = {"PYTHONPATH": str(blocked.parent), RUN_ID_ENV: RUN}
    proc = launch(sys.executable, tmp_path, *SMALL, "--epochs", "1", env=env)
    assert_ok(proc)
    records = metrics(tmp_path / "ckpt")
    assert records[-1]["kind"] == "final" and printed(proc.stdout) == records
    assert proc.stderr.count("TensorBoard files in") == 1, proc.stderr[-3000:]
    assert not list((tmp_path / "ckpt").rglob("events.out.tfevents.*"))


# --- the writer, in this process -------------------------------------------------------------------

def test_without_a_run_id_records_are_unchanged_and_the_directory_names_the_start(tmp_path, monkeypatch):
    """Without a run id the records are unchanged, and the directory is named after the start."""
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    writer = MetricsWriter(main_env(), str(tmp_path))
    writer.write({"kind": "train", "step": 4, "loss": 2.5, "acc": 0.25})
    writer.close()
    (record,) = metrics(tmp_path)
    assert list(record) == ["time", "kind", "step", "loss", "acc"]
    (run_dir,) = (tmp_path / TENSORBOARD_DIR).iterdir()
    assert re.fullmatch(r"[0-9]{8}-[0-9]{6}", run_dir.name)  # the start time: never pruned as a run id
    assert scalars(run_dir) == {"loss/train": [(4, 2.5)], "accuracy/train": [(4, 0.25)]}


def test_a_killed_rank_0_s_torn_last_line_stays_alone_and_the_next_record_is_whole(tmp_path, monkeypatch):
    """A torn last line left by a killed rank 0 stays alone, and the next record is whole."""
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    (tmp_path / "metrics.jsonl").write_text('{"time": 1.0, "kind": "train", "step": 3}\n{"time": 2.0, "kind": "tr')
    writer = MetricsWriter(main_env(), str(tmp_path))
    writer.write({"kind": "resumed", "step": 0})
    writer.write({"kind": "train", "step": 1})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == '{"time": 2.0, "kind": "tr'
    assert [json.loads(line)["kind"] for line in lines[2:]] == ["resumed", "train"]


def test_a_run_id_that_is_not_a_plain_name_stays_inside_the_tensorboard_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_ID_ENV, "../../x y")
    writer = MetricsWriter(main_env(), str(tmp_path))
    writer.write({"kind": "eval", "step": 8, "eval_loss": 1.0, "eval_acc": 0.5})
    writer.close()
    assert metrics(tmp_path)[0]["run"] == "../../x y"
    assert [p.name for p in (tmp_path / TENSORBOARD_DIR).iterdir()] == [".._.._x_y"]


def test_other_ranks_write_no_tensorboard_files(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_ID_ENV, RUN)
    env = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, device=torch.device("cpu"), backend="gloo")
    writer = MetricsWriter(env, str(tmp_path))
    writer.write({"kind": "train", "step": 4, "loss": 2.5, "acc": 0.25})
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_under_the_event_files_is_warned_once_and_metrics_jsonl_goes_on(tmp_path, monkeypatch, caplog):
    from tensorboard.summary.writer.record_writer import RecordWriter

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv(RUN_ID_ENV, RUN)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the event writer's thread dies of it
    writer = MetricsWriter(main_env(), str(tmp_path))
    monkeypatch.setattr(RecordWriter, "write", full)  # the event file's first record (the header) fails already
    with caplog.at_level(logging.WARNING, logger="trainer.metrics"):
        for step in (4, 8, 12):
            writer.write({"kind": "train", "step": step, "loss": 1.0 / step, "acc": 0.5})
        writer.close()
    assert [r["step"] for r in metrics(tmp_path)] == [4, 8, 12]
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]


def test_a_resumed_attempt_hides_what_the_crashed_one_logged_after_its_checkpoint(tmp_path):
    directory = tmp_path / RUN
    first = TensorBoardScalars(directory)
    for step in (4, 8, 12):  # then a crash; the newest checkpoint is of step 8
        first.add({"kind": "train", "step": step, "loss": 10.0 + step, "acc": 0.5})
    first.close()
    again = TensorBoardScalars(directory)
    again.add({"kind": "resumed", "step": 8, "epoch": 0, "micro": 8, "checkpoint": "ckpt-000000008.pt"})
    again.add({"kind": "train", "step": 12, "loss": 1.0, "acc": 0.75})
    again.close()
    assert scalars(directory)["loss/train"] == [(4, 14.0), (8, 18.0), (12, 1.0)]


def test_records_carry_the_run_id_in_the_printed_line_and_the_file_alike(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(RUN_ID_ENV, RUN)
    writer = MetricsWriter(main_env(), str(tmp_path))
    writer.write({"kind": "stopped", "epoch": 0, "step": 3, "micro": 3, "checkpoint": "c", "signal": "SIGTERM",
                  "world_size": 1})
    writer.close()
    (record,) = metrics(tmp_path)
    assert printed(capsys.readouterr().out) == [record]
    assert list(record)[:3] == ["time", "run", "kind"] and record["run"] == RUN
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["signal"] == "SIGTERM"
    assert not (tmp_path / TENSORBOARD_DIR).exists()  # a stop measures nothing: no empty event file


def test_a_metrics_line_reaches_stdout_in_one_write_so_no_reader_sees_half_of_it(tmp_path, monkeypatch):
    """With PYTHONUNBUFFERED (the image sets it) print() makes the text and its newline two writes;
    torch 2.5's line prefixer read between them once and printed "[rank0]: METRICS {...}[rank0]: "."""
    import io

    writes = []

    class Recording(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", Recording())
    writer = MetricsWriter(main_env(), str(tmp_path))
    writer.write({"kind": "train", "step": 1})
    writer.close()
    assert len(writes) == 1 and writes[0].startswith("METRICS {") and writes[0].endswith("}\n"), writes
