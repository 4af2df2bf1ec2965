"""The `local` connection path for real: check, deploy, launch --wait, status, logs, stop on
a one-node host-runtime inventory running the real trainer (python -m trainer) under torchrun."""

from __future__ import annotations

import json
import os
import re
import signal
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from local_job import beats_dir, local_hosts
from procs import alive, children_of, parent_of, with_environ
from agent import heartbeat
from agent.contract import module_argv
from waiting import wait_until

pytestmark = pytest.mark.e2e

TRAIN_ARGS = ["--dataset", "synthetic", "--epochs", "1", "--synthetic-size", "256",
              "--batch-size", "32", "--log-every", "1"]


def _inventory(tmp_path: Path, args: list[str], procs: int = 2) -> Path:
    return local_hosts(tmp_path, job="localtest", train={"args": args}, procs=procs)


def _state(ddp, hosts):
    r = ddp(hosts, "status", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)[0]


def test_check_deploy_launch_wait_status_logs_stop_with_the_real_trainer(ddp, tmp_path):
    hosts = _inventory(tmp_path, TRAIN_ARGS)
    r = ddp(hosts, "check")
    assert r.exit_code == 0, r.output
    r = ddp(hosts, "deploy")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "nas/ckpt").is_dir() and (tmp_path / "nas/data").is_dir()

    r = ddp(hosts, "launch", "--wait", "--timeout", "240")
    assert r.exit_code == 0, r.output + str(r.exception)
    assert "all nodes finished with exit code 0" in r.stdout
    # not a terminal: plain lines as the state changes (the live table is for terminals)
    assert any(line.startswith("here  exited(0)") for line in r.stdout.splitlines()), r.stdout
    assert not Path(beats_dir(hosts)).exists()  # the run's heartbeats went with it
    # where the launch's time went: every part timed, in order, and those before the start kept
    took = next(line for line in r.stdout.splitlines() if line.startswith("launch took "))
    assert [part.rsplit(" ", 2)[0] for part in took.split(": ", 1)[1].split(", ")] == [
        "lock", "node states", "code sync", "checks", "image check", "record", "start"], took
    kept = json.loads(ddp(hosts, "runs", "--json").stdout)[-1]
    assert list(kept["record"]["launch_phases"]) == ["lock", "states", "code", "checks", "image"]
    # the first step: when it came after the start, said, and kept beside the launch's phases
    said = re.search(r"^first step after (\d+\.\d) s \(here: ", r.stdout, re.M)
    assert said, r.stdout
    assert kept["record"]["first_step"]["after_s"] == float(said[1]) and kept["record"]["first_step"]["node"] == "here"
    shown = ddp(hosts, "status", "--run", kept["id"]).stdout
    assert "launch before the start took " in shown and f"first step after {said[1]} s (here: " in shown

    st = _state(ddp, hosts)
    assert st["state"] == "exited(0)" and st["ranks"] == 2
    assert st["metrics"].startswith("METRICS {")
    assert (tmp_path / "nas/ckpt/metrics.jsonl").exists()

    r = ddp(hosts, "logs", "--tail", "3")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("here ") and " | " in line for line in lines)
    everything = ddp(hosts, "logs").stdout.splitlines()
    labels = {line.split(" | ", 1)[0].rstrip() for line in everything}
    assert {"here rank0", "here rank1"} <= labels  # each worker's lines carry its rank
    assert "here rank0 | METRICS {" in "\n".join(everything)  # rank 0 alone prints metrics
    one = ddp(hosts, "logs", "--rank", "1").stdout.splitlines()
    assert one and all(line.startswith("here rank1 | ") for line in one)
    assert ddp(hosts, "logs", "--node", "elsewhere").exit_code == 2

    r = ddp(hosts, "check")  # a finished run does not block: check notes it
    assert r.exit_code == 0 and "finished (exited(0))" in r.stdout

    trained = len((tmp_path / "nas/ckpt/metrics.jsonl").read_text().splitlines())
    r = ddp(hosts, "launch", "--wait", "--timeout", "240")  # launching again resumes: nothing left to train
    assert r.exit_code == 0, r.output + str(r.exception)
    records = [json.loads(line) for line in (tmp_path / "nas/ckpt/metrics.jsonl").read_text().splitlines()]
    assert [rec["kind"] for rec in records[trained:]] == ["resumed", "final"]

    r = ddp(hosts, "stop")
    assert r.exit_code == 0, r.output
    assert _state(ddp, hosts)["state"] == "absent"
    assert ddp(hosts, "stop").exit_code == 0  # idempotent


def test_a_failing_trainer_fails_launch_wait_and_status_naming_the_cause(ddp, tmp_path):
    # valid flags (hosts.yaml's validation passes them), but the data is not there
    hosts = _inventory(tmp_path, ["--dataset", "cifar10", "--no-download", "--epochs", "1"])
    r = ddp(hosts, "launch", "--wait", "--timeout", "120")
    assert r.exit_code == 1, r.output
    said = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith("error: the job failed on here: here rank "), r.stderr
    assert re.search(r"here rank \d failed first \(exit 1\): trainer: error: dataset cifar10 is not under ", said[0])
    assert said[0].endswith("and --no-download is set; copy it there or allow the download (`ddp-deploy logs --tail 400` shows the rest)")
    r = ddp(hosts, "status")
    assert r.exit_code == 0 and "first failure: here rank " in r.stdout and "dataset cifar10 is not" in r.stdout
    shown = _state(ddp, hosts)
    assert shown["state"] == "exited(1)" and shown["first_failure"]["exit_code"] == "1"
    assert ddp(hosts, "stop").exit_code == 0


def test_on_a_terminal_status_follow_redraws_a_table_and_ends_with_the_verdict(ddp, tmp_path, monkeypatch):
    import io

    from rich.console import Console

    import deploy.cli.render

    screen = io.StringIO()
    monkeypatch.setattr(deploy.cli.render, "out", Console(file=screen, force_terminal=True, width=160))
    hosts = _inventory(tmp_path, [*TRAIN_ARGS, "--epochs", "2"], procs=1)
    assert ddp(hosts, "launch").exit_code == 0
    r = ddp(hosts, "status", "--follow")
    assert r.exit_code == 0 and "all nodes finished with exit code 0" in r.stdout
    drawn = screen.getvalue()
    assert "\x1b[" in drawn and "job localtest" in drawn  # redrawn in place (ANSI), then the final table
    assert "exited(0)" in drawn and "here" in drawn
    assert ddp(hosts, "stop").exit_code == 0


INTERRUPT_ATTEMPTS = 3  # launches interrupted, of which the last is the one asserted on


def test_one_ctrl_c_while_launch_starts_the_nodes_stops_what_it_started(ddp, tmp_path):
    import signal
    import subprocess

    hosts = _inventory(tmp_path, ["--dataset", "synthetic", "--epochs", "1000", "--synthetic-size", "256",
                                  "--batch-size", "32"], procs=1)
    run_dir = tmp_path / "nas/ckpt/.ddp-deploy/localtest/here"
    env = {**os.environ, "DDP_DEPLOY_LOG": str(tmp_path / "debug.log")}
    for attempt in range(1, INTERRUPT_ATTEMPTS + 1):
        launch = subprocess.Popen([sys.executable, "-m", "deploy", "--hosts", str(hosts), "launch"], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            # the node's supervisor is up (its pid file), its start command still waits a second
            _wait_for(lambda: (run_dir / "pid").exists() or launch.poll() is not None, "the node to start", 120)
            launch.send_signal(signal.SIGINT)
            out, err = launch.communicate(timeout=120)
        finally:
            launch.kill()
        if launch.returncode != 0 or attempt == INTERRUPT_ATTEMPTS:
            break
        # a loaded machine let the start's second pass before the signal landed: the job started
        # whole, which is not the case asked about; stop it and interrupt another launch
        stopped = ddp(hosts, "stop")
        assert stopped.exit_code == 0, stopped.output
    assert launch.returncode == 130, out + err
    assert "interrupted: stopped every node it had started" in err and "started localtest" not in out
    assert not (run_dir / "pid").exists()
    _wait_for(lambda: not _tagged(run_dir), "the run's processes to end", 10)


def test_stop_kills_the_whole_process_group_of_a_running_job(ddp, tmp_path):
    hosts = _inventory(tmp_path, ["--dataset", "synthetic", "--epochs", "1000", "--synthetic-size", "256",
                                  "--batch-size", "32"], procs=1)
    r = ddp(hosts, "launch")
    assert r.exit_code == 0, r.output
    run_dir = tmp_path / "nas/ckpt/.ddp-deploy/localtest/here"
    pgid = int((run_dir / "pid").read_text())
    assert _state(ddp, hosts)["state"] == "running"
    # status shows how far it is, from the trainer's METRICS lines
    # asked each half second: a `status` costs a share of a core, taken from the trainer it waits on
    # a train record's line (an epoch here is 8 steps: the last line is often the epoch's eval record,
    # which holds no `epochs`)
    shown = _wait_for(lambda: (lambda s: s if s.get("step") and s.get("kind") == "train" else None)(_state(ddp, hosts)),
                      "a training step in status", interval=0.5)
    assert shown["epochs"] == 1000 and shown["eta_s"] > 0 and shown["restarts"] == 0 and shown["kind"] == "train"
    # and that it moves, from its rank's heartbeat (agent/heartbeat/): one per rank, never stalled
    assert [(b["local_rank"], b["rank"]) for b in shown["heartbeats"]] == [(0, 0)] and shown["stalled"] is None
    assert shown["heartbeats"][0]["step"] >= 1 and shown["heartbeats"][0]["gap_s"] is not None

    r = ddp(hosts, "check")
    assert r.exit_code == 1 and "still running" in r.stdout
    r = ddp(hosts, "launch")  # a second run never joins the first one's rendezvous
    assert r.exit_code == 1 and "still running on here" in r.stderr and "ddp-deploy stop" in r.stderr
    assert int((run_dir / "pid").read_text()) == pgid

    deadline = time.time() + 60
    while time.time() < deadline and len(_tagged(run_dir)) < 2:  # torchrun and its worker
        time.sleep(0.2)
    assert len(_tagged(run_dir)) >= 2

    r = ddp(hosts, "stop")
    assert r.exit_code == 0 and "here: stopped" in r.stdout
    assert _state(ddp, hosts)["state"].startswith("stopped (graceful, ")  # as `runs` shows it, not absent
    deadline = time.time() + 10
    while time.time() < deadline and (_group_alive(pgid) or _tagged(run_dir)):
        time.sleep(0.2)
    assert not _group_alive(pgid)
    assert _tagged(run_dir) == []  # the workers, in sessions of their own, are gone too


def _records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "nas/ckpt/metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(predicate, what: str, timeout: float = 240, interval: float = 0.05):
    return wait_until(predicate, timeout, what, interval=interval)


LONG_ARGS = ["--dataset", "synthetic", "--epochs", "2", "--synthetic-size", "2048", "--batch-size", "16",
             "--log-every", "1", "--ckpt-every", "8"]


def test_stop_lets_the_job_checkpoint_at_its_step_and_a_relaunch_redoes_nothing(ddp, tmp_path):
    hosts = _inventory(tmp_path, LONG_ARGS)
    assert ddp(hosts, "launch").exit_code == 0
    _wait_for(lambda: any(r["kind"] == "train" and r["step"] >= 11 for r in _records(tmp_path)), "step 11")
    r = ddp(hosts, "stop")
    assert r.exit_code == 0, r.output
    stop = _records(tmp_path)[-1]
    assert stop["kind"] == "stopped", stop
    assert f"here: stopped: trainer: stopped by SIGTERM at step {stop['step']}" in r.stdout
    assert stop["step"] == max(rec["step"] for rec in _records(tmp_path) if rec["kind"] == "train")

    trained = len(_records(tmp_path))
    r = ddp(hosts, "launch", "--wait", "--timeout", "240")
    assert r.exit_code == 0, r.output
    after = _records(tmp_path)[trained:]
    assert after[0]["kind"] == "resumed" and after[0]["step"] == stop["step"]
    assert min(rec["step"] for rec in after if rec["kind"] == "train") == stop["step"] + 1  # nothing redone
    assert after[-1]["kind"] == "final"


def test_ranks_stopped_before_the_stop_began_are_stopped_by_it_with_their_step(ddp, tmp_path):
    # A stop reaches the nodes one after another: a node's ranks may have stopped already, told by
    # the ranks of a node whose stop began first (trainer/stopping.py). Here one worker gets the
    # SIGTERM, as another node's would, and the node's part ends (max_restarts 0) before `stop`.
    hosts = _inventory(tmp_path, LONG_ARGS)
    assert ddp(hosts, "launch").exit_code == 0
    run_dir = tmp_path / "nas/ckpt/.ddp-deploy/localtest/here"
    _wait_for(lambda: any(r["kind"] == "train" and r["step"] >= 3 for r in _records(tmp_path)), "step 3")
    os.kill(heartbeat.ranked(beats_dir(hosts))[1], signal.SIGTERM)  # the second process
    _wait_for(lambda: (run_dir / "exit").exists(), "the node's part to end")
    stop = _records(tmp_path)[-1]
    assert stop["kind"] == "stopped", stop

    r = ddp(hosts, "stop")
    assert r.exit_code == 0, r.output
    assert f"here: stopped: trainer: stopped by SIGTERM to another rank at step {stop['step']}" in r.stdout
    r = ddp(hosts, "runs")
    assert r.exit_code == 0 and f"graceful, checkpoint at step {stop['step']}" in r.stdout, r.output


def test_stop_now_kills_at_once_without_a_checkpoint(ddp, tmp_path):
    hosts = _inventory(tmp_path, LONG_ARGS)
    assert ddp(hosts, "launch").exit_code == 0
    _wait_for(lambda: any(r["kind"] == "train" and r["step"] >= 3 for r in _records(tmp_path)), "step 3")
    r = ddp(hosts, "stop", "--now")
    assert r.exit_code == 0 and "here: stopped" in r.stdout and "SIGTERM" not in r.stdout
    assert "stopped" not in [rec["kind"] for rec in _records(tmp_path)]
    run_dir = tmp_path / "nas/ckpt/.ddp-deploy/localtest/here"
    assert _tagged(run_dir) == []


def test_a_killed_torchrun_is_restarted_by_the_host_supervisor_and_finishes(ddp, tmp_path):
    hosts = _inventory(tmp_path, LONG_ARGS)
    hosts.write_text(hosts.read_text().replace('"max_restarts": 0', '"max_restarts": 1'))
    assert ddp(hosts, "launch").exit_code == 0
    run_dir = tmp_path / "nas/ckpt/.ddp-deploy/localtest/here"
    _wait_for(lambda: (tmp_path / "nas/ckpt/ckpt-000000008.pt.ok").exists(), "the first checkpoint")
    supervisor = int((run_dir / "pid").read_text())
    torchrun = [p for p in _tagged(run_dir) if parent_of(p) == supervisor]
    assert len(torchrun) == 1
    workers = list(heartbeat.ranked(beats_dir(hosts)).values())
    assert len(workers) == 2
    everything = [p for p in _tagged(run_dir) if p != supervisor]  # torchrun, its workers, their zygote
    os.kill(torchrun[0], 9)  # as the OOM killer would end it

    final = _wait_for(lambda: (run_dir / "exit").exists() and _state(ddp, hosts), "the job to end", timeout=300)
    assert final["state"] == "exited(0)", (run_dir / "log").read_text()[-3000:]
    assert (run_dir / "restarts").read_text().strip() == "1"
    assert not any(alive(p) for p in everything)  # the killed torchrun's workers went with it
    kinds = [rec["kind"] for rec in _records(tmp_path)]
    assert "resumed" in kinds and kinds[-1] == "final"
    assert "starting it again (1 of 1 restarts)" in (run_dir / "log").read_text()


def _tagged(run_dir: Path) -> list[int]:
    """Processes whose environment carries this run's marker (torchrun and every worker)."""
    marker = f"DDP_DEPLOY_RUN={run_dir}".encode()
    return with_environ(lambda env: marker in env)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _failing_at_once(tmp_path: Path) -> Path:
    """An inventory whose interpreter passes the preflight checks (python -m agent.probe, python -c
    LISTENER) but cannot start the job."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\n[ "$3" = agent.launch ] && exit 127\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    hosts = _inventory(tmp_path, TRAIN_ARGS)
    hosts.write_text(hosts.read_text().replace(sys.executable, str(fake)))
    return hosts


def _assert_failed_at_once(ddp, hosts: Path) -> None:
    r = ddp(hosts, "launch")
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("error: here: launch: exit 1: exited with 127 at once")
    assert _state(ddp, hosts)["state"] == "absent"


def test_a_node_that_fails_at_once_fails_the_launch_and_is_cleaned_up(ddp, tmp_path):
    _assert_failed_at_once(ddp, _failing_at_once(tmp_path))


BUSY_NODE_PROCESSES = 1500


def test_a_busy_node_still_fails_the_launch_of_a_job_that_fails_at_once(ddp, tmp_path):
    # The supervisor kills what the ended command left before it records the exit (deploy/programs/
    # kill_run.sh), and launch looks for that record 1 s after the start: a grep for each process
    # on the node takes longer than that with this many on busy cores (and the launch was taken for
    # a success).
    hosts = _failing_at_once(tmp_path)
    crowd = subprocess.Popen(["sh", "-c", f"for i in $(seq {BUSY_NODE_PROCESSES}); do sleep 600 & done; wait"],
                             start_new_session=True)
    try:
        wait_until(lambda: len(children_of(crowd.pid)) >= BUSY_NODE_PROCESSES, 120, "the crowd of processes")
        _assert_failed_at_once(ddp, hosts)
    finally:
        os.killpg(crowd.pid, signal.SIGKILL)
        crowd.wait()



def test_a_node_slow_to_clear_a_failed_command_still_fails_the_launch_at_once(ddp, tmp_path, monkeypatch):
    """The same race made certain: the supervisor's one grep over the node's processes (deploy/programs/
    kill_run.sh) takes 3 s here, past launch's second, and the failure is still reported at once
    (the supervisor says the command ended before it clears what it left)."""
    hosts = _failing_at_once(tmp_path)
    slow = tmp_path / "slow-bin"
    slow.mkdir()
    (slow / "grep").write_text(f'#!/bin/sh\ncase " $* " in *" -lzxF "*) sleep 3 ;; esac\nexec {shutil.which("grep")} "$@"\n')
    (slow / "grep").chmod(0o755)
    monkeypatch.setenv("PATH", f"{slow}:{os.environ['PATH']}")
    _assert_failed_at_once(ddp, hosts)

def test_launch_refuses_before_starting_anything_when_a_check_fails(ddp, tmp_path):
    hosts = _inventory(tmp_path, TRAIN_ARGS)
    hosts.write_text(hosts.read_text().replace(sys.executable, "/nonexistent/bin/python"))
    r = ddp(hosts, "launch")
    assert r.exit_code == 1
    assert r.stderr.startswith("error: launch refused, nothing started: ")
    assert "here torch: cannot run /nonexistent/bin/python: " in r.stderr
    assert _state(ddp, hosts)["state"] == "absent"


def test_launch_wait_exits_1_when_the_trainer_fails(ddp, tmp_path):
    hosts = _inventory(tmp_path, ["--config", str(tmp_path / "missing.yaml")], procs=1)  # read where it runs
    r = ddp(hosts, "launch", "--wait", "--timeout", "120")
    assert r.exit_code == 1
    assert "the job failed on here" in r.stderr
    assert _state(ddp, hosts)["state"].startswith("exited(")
    assert ddp(hosts, "stop").exit_code == 0


def test_dry_run_prints_the_command_and_starts_nothing(ddp, tmp_path):
    hosts = _inventory(tmp_path, TRAIN_ARGS)
    r = ddp(hosts, "launch", "--dry-run")
    assert r.exit_code == 0
    assert "\n[here] sh -c " in r.stdout
    assert shlex.join(module_argv("agent.launch")) in r.stdout and "is_host=1" in r.stdout
    assert not (tmp_path / "nas").exists()


def test_logs_follow_streams_new_lines_prefixed_with_node_and_rank_until_interrupted(ddp, tmp_path):
    import subprocess

    hosts = _inventory(tmp_path, ["--dataset", "synthetic", "--epochs", "1000", "--synthetic-size", "256",
                                  "--batch-size", "32", "--log-every", "1"], procs=1)
    assert ddp(hosts, "launch").exit_code == 0
    follower = subprocess.Popen([sys.executable, "-m", "deploy", "--hosts", str(hosts), "logs", "--follow"],
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "DDP_DEPLOY_LOG": str(tmp_path / "debug.log")})
    try:
        seen, deadline = [], time.time() + 120
        while len([s for s in seen if "METRICS" in s]) < 3 and time.time() < deadline:
            seen.append(follower.stdout.readline())
        metrics_lines = [s for s in seen if "METRICS" in s]
        assert len(metrics_lines) >= 3 and all(s.startswith("here rank0 | ") for s in metrics_lines)
        steps = [json.loads(s.split("METRICS ", 1)[1])["step"] for s in metrics_lines]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)  # new lines as they come
        assert follower.poll() is None  # still following
    finally:
        follower.terminate()
        follower.wait(timeout=30)
        assert ddp(hosts, "stop").exit_code == 0
