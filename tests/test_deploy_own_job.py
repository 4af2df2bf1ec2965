"""A job touches only its own processes, and a stopped run says how it ended.

Two jobs on one node, sharing one checkpoint root, whose names differ where a pattern would
treat a character specially (``exp.1``, ``exp-1``): stopping one, or one ending by itself,
leaves the other's processes alive (the real CLI on a local host-runtime node, a small program
under real torchrun). `stop` keeps who stopped a run, when, how and at which step its program
said it checkpointed, with the run: `runs` and `status --run` show it (the node-side scripts run
by a real sh on real directories)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from deploy.job import runs, runtime
from deploy.job.scripts import KILL_RUN, RECORD_STOP
from deploy.engines import slurm
from deploy.observe import view
from deploy.inventory import loads
from local_job import local_hosts
from procs import alive
from test_deploy_local import _tagged, _wait_for
from test_deploy_runs import _inv

# A program that runs until told to end (a file named after its job appears) and, on SIGTERM,
# says at which step it stopped, as the built-in trainer does (trainer/stopping.py).
SLEEPER = """\
import json, os, signal, sys, time
from pathlib import Path
ckpt, job = Path(os.environ["DDP_CKPT_DIR"]), os.environ["DDP_RUN_ID"]
step = 0
def stopped(signum, frame):
    print(f"sleeper: stopped by SIGTERM at step {step} (epoch 0); checkpoint none written", file=sys.stderr, flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, stopped)
(ckpt / f"pid-{job}").write_text(str(os.getpid()))
while not (ckpt / f"finish-{job}").exists():
    step += 1
    print("METRICS " + json.dumps({"kind": "train", "epoch": 0, "step": step}), flush=True)
    time.sleep(0.05)
"""


def _hosts(tmp_path: Path, job: str) -> Path:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "sleeper.py").write_text(SLEEPER)
    return local_hosts(tmp_path, job=job, name=f"{job}.yaml", train={"script": "sleeper.py", "code": str(code)})


def _ok(r):
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r


def _launched(ddp, tmp_path: Path, job: str) -> list[int]:
    """Launches ``job``; once its program runs, the pids of its supervisor, torchrun and program."""
    hosts = _hosts(tmp_path, job)
    pid_file = tmp_path / f"nas/ckpt/pid-{job}"
    pid_file.unlink(missing_ok=True)
    _ok(ddp(hosts, "launch"))
    program = int(_wait_for(lambda: pid_file.exists() and pid_file.read_text(), f"{job}'s program", 120))
    run_dir = tmp_path / f"nas/ckpt/.ddp-deploy/{job}/here"
    pids = {int((run_dir / "pid").read_text()), *_tagged(run_dir)}
    assert program in pids and len(pids) >= 3, pids  # the supervisor, torchrun, the program
    return sorted(pids)


@pytest.mark.e2e
def test_stopping_one_job_leaves_a_job_whose_name_differs_by_a_dot_running(ddp, tmp_path):
    other = _launched(ddp, tmp_path, "exp-1")
    try:
        mine = _launched(ddp, tmp_path, "exp.1")
        said = _ok(ddp(_hosts(tmp_path, "exp.1"), "stop")).stdout
        assert "here: stopped: sleeper: stopped by SIGTERM at step " in said
        assert not any(alive(p) for p in mine)
        assert all(alive(p) for p in other), [p for p in other if not alive(p)]
        status = json.loads(_ok(ddp(_hosts(tmp_path, "exp-1"), "status", "--json")).stdout)
        assert status[0]["state"] == "running"
    finally:
        ddp(_hosts(tmp_path, "exp-1"), "stop", "--now")
        ddp(_hosts(tmp_path, "exp.1"), "stop", "--now")


@pytest.mark.e2e
def test_a_job_ending_by_itself_leaves_a_job_whose_name_differs_by_a_dot_running(ddp, tmp_path):
    other = _launched(ddp, tmp_path, "exp-1")
    try:
        _launched(ddp, tmp_path, "exp.1")
        (tmp_path / "nas/ckpt/finish-exp.1").touch()
        # its supervisor writes `exit` after it has killed what the run left
        _wait_for(lambda: (tmp_path / "nas/ckpt/.ddp-deploy/exp.1/here/exit").exists(), "exp.1 to end", 120)
        assert (tmp_path / "nas/ckpt/.ddp-deploy/exp.1/here/exit").read_text().strip() == "0"
        assert all(alive(p) for p in other), [p for p in other if not alive(p)]
    finally:
        ddp(_hosts(tmp_path, "exp-1"), "stop", "--now")
        ddp(_hosts(tmp_path, "exp.1"), "stop", "--now")


@pytest.mark.e2e
def test_a_stopped_run_shows_who_stopped_it_when_and_the_step_it_checkpointed_at(ddp, tmp_path):
    hosts = _hosts(tmp_path, "exp.1")
    _launched(ddp, tmp_path, "exp.1")
    said = _ok(ddp(hosts, "stop")).stdout
    step = int(said.split("at step ")[1].split()[0])

    kept = json.loads(_ok(ddp(hosts, "runs", "--json")).stdout)
    assert len(kept) == 1
    stop = kept[0]["stopped"]
    assert stop["by"] == runtime.operator() and stop["graceful"] is True and stop["step"] == step
    assert abs(stop["time"] - time.time()) < 120
    assert kept[0]["nodes"]["here"]["stopped"] == stop
    clock = time.strftime("%H:%M:%S", time.localtime(stop["time"]))
    expected = f"stopped by {runtime.operator()} at {clock} (graceful, checkpoint at step {step})"
    assert kept[0]["outcome"] == expected
    assert kept[0]["end"] is not None  # a stopped run has ended: `runs` says how long it took

    shown = _ok(ddp(hosts, "status", "--run", kept[0]["id"])).stdout
    assert expected in shown and "no exit recorded" not in shown
    data = json.loads(_ok(ddp(hosts, "status", "--run", kept[0]["id"], "--json")).stdout)
    assert data["outcome"] == expected and data["stopped"] == stop
    assert data["nodes"][0]["state"] == f"stopped (graceful, checkpoint at step {step})"


# --- the node-side scripts, by a real sh ---------------------------------------------------------


def test_kill_run_spares_another_run_directory_s_process_a_pattern_would_match(tmp_path):
    """kill_run spares a process whose run directory differs, where a pattern would match."""
    def tagged_sleep(run_dir: str) -> subprocess.Popen:
        return subprocess.Popen(["sleep", "60"], env={"PATH": os.environ["PATH"], "DDP_DEPLOY_RUN": run_dir})

    mine, other = tagged_sleep("/nas/.ddp-deploy/exp.1/here"), tagged_sleep("/nas/.ddp-deploy/exp-1/here")
    longer = tagged_sleep("/nas/.ddp-deploy/exp.1/here2")
    try:
        _wait_for(lambda: all("DDP_DEPLOY_RUN=" in Path(f"/proc/{p.pid}/environ").read_text()
                              for p in (mine, other, longer)), "the processes to start", 10)
        subprocess.run(["sh", "-c", KILL_RUN + 'kill_run "$1" ""', "sh", "/nas/.ddp-deploy/exp.1/here"],
                       check=True, timeout=30)
        assert mine.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None and longer.poll() is None
    finally:
        for p in (mine, other, longer):
            p.kill()
            p.wait()


def _record_stop(kept: str, said: bytes, *, scope="node", mode="graceful", by="root@op", when="1764072063",
                 only_if_said=False):
    return subprocess.run(["sh", "-c", RECORD_STOP + 'record_stop "$@"', "sh", kept, scope, mode, by, when,
                           *(["said"] if only_if_said else [])],
                          input=said, capture_output=True, check=True, timeout=30)


STOP_LINE = b"[rank2]: trainer: stopped by SIGTERM to another rank at step 16 (epoch 0); checkpoint ckpt-16 written\n"


def test_a_stop_line_printed_before_the_nodes_own_stop_began_is_still_its_stop(tmp_path):
    # the ranks of a node stopped at step 16, told by another node's, before this node's stop began;
    # torchrun then started its workers again, which wait in a rendezvous that never forms
    log = (b"[rank2]: step 15\n" + STOP_LINE + b"torchrun: restarting workers (1 of 3)\n"
           b"[W] rendezvous: waiting for 2 more nodes\n")
    r = _record_stop(str(tmp_path / "here"), log)
    assert r.stdout == b": trainer: stopped by SIGTERM to another rank at step 16 (epoch 0); checkpoint ckpt-16 written"
    assert (tmp_path / "here.stopped").read_text() == "1764072063 node graceful 16 root@op\n"


def test_the_line_of_an_earlier_stop_that_the_job_went_on_from_is_never_taken(tmp_path):
    log = (b"[rank0]: METRICS {}\n" + STOP_LINE + b'[rank0]: METRICS {"kind": "stopped"}\n'
           b'[rank0]: METRICS {"time": 1, "kind": "resumed", "step": 16}\n[rank0]: METRICS {"kind": "train"}\n')
    r = _record_stop(str(tmp_path / "here"), log)
    assert r.stdout == b""
    assert (tmp_path / "here.stopped").read_text() == "1764072063 node graceful - root@op\n"


def test_a_node_that_had_ended_is_recorded_as_stopped_only_where_its_program_said_so(tmp_path):
    r = _record_stop(str(tmp_path / "here"), b"[rank0]: METRICS {}\ntorchrun: worker failed (exit 1)\n", only_if_said=True)
    assert r.stdout == b"" and not (tmp_path / "here.stopped").exists()  # it ended on its own: no stop of it
    # the METRICS lines of its last steps and of the stop may come after the stop's line (two pipes)
    r = _record_stop(str(tmp_path / "here"), STOP_LINE + b'[rank0]: METRICS {"kind": "train"}\n[rank0]: METRICS '
                     b'{"kind": "stopped"}\n', only_if_said=True)
    assert r.stdout.startswith(b": trainer: stopped by SIGTERM to another rank at step 16")
    assert (tmp_path / "here.stopped").read_text() == "1764072063 node graceful 16 root@op\n"


def test_the_stop_record_keeps_only_the_step_number_of_what_the_program_said(tmp_path):
    said = (b"[rank0]: METRICS {}\n[rank0]: trainer: stopped by SIGTERM at step 40 (epoch 1); checkpoint "
            b"ckpt-40 written \x1b]52;c;c2VjcmV0\x07 token=hunter2\n")
    r = _record_stop(str(tmp_path / "here"), said)
    assert (tmp_path / "here.stopped").read_text() == "1764072063 node graceful 40 root@op\n"
    assert r.stdout.startswith(b": trainer: stopped by SIGTERM at step 40 (epoch 1)")  # shown by `stop`, kept nowhere
    assert runs.Stop.parse((tmp_path / "here.stopped").read_text()) == runs.Stop(1764072063, "root@op", True, 40, True)


def test_a_program_that_said_no_step_or_a_huge_one_is_recorded_without_a_step(tmp_path):
    for said in (b"", b"stopped by SIGTERM at step 1234567890123456789012 (epoch 0)\n"):
        _record_stop(str(tmp_path / "here"), said)
        assert (tmp_path / "here.stopped").read_text() == "1764072063 node graceful - root@op\n"


def test_a_stop_that_cannot_be_recorded_says_so_and_the_stop_goes_on(tmp_path):
    r = _record_stop(str(tmp_path / "missing" / "here"), b"")
    assert r.stdout.decode() == f" (the stop is not recorded in {tmp_path / 'missing' / 'here'})"


# --- reading the record: runs.parse of what LIST_RUNS prints, and its display ----------------------


START = 1_764_072_000  # the run's start, and its stop 63 s later


def _kept(tmp_path: Path, nodes: dict[str, dict[str, str]]) -> runs.Run:
    """The run LIST_RUNS finds in a runs directory holding ``nodes`` (node -> file -> text)."""
    inv = _inv(tmp_path)
    run = runs.new_id(START)
    base = Path(runs.runs_dir(inv)) / run
    base.mkdir(parents=True)
    (base / "run.json").write_text(json.dumps({"run": run, "time": START}))
    for node, files in nodes.items():
        (base / node).mkdir()
        for name, text in files.items():  # a stop's record sits beside the node's directory, the rest in it
            (base / f"{node}.stopped" if name == "stopped" else base / node / name).write_text(text)
    listed = subprocess.run(list(runs.list_argv(inv)), capture_output=True, check=True, timeout=30).stdout.decode()
    (found,) = runs.parse(listed)
    return found


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def test_a_stopped_run_reads_as_stopped_by_whom_when_and_at_which_step(tmp_path):
    """A stopped run reads as stopped by whom, when and at which step, not as no exit recorded."""
    stop = f"{START + 63} node graceful 40 root@op\n"
    run = _kept(tmp_path, {"a": {"stopped": stop, "log": "METRICS {\"step\": 40}\n"}, "b": {"stopped": stop}})
    assert run.outcome() == f"stopped by root@op at {_clock(START + 63)} (graceful, checkpoint at step 40)"
    assert run.end == START + 63
    assert run.nodes["a"].state().state == "stopped (graceful, checkpoint at step 40)"
    assert run.nodes["a"].state().metrics == 'METRICS {"step": 40}'
    assert run.stop_data() == {"time": START + 63, "by": "root@op", "graceful": True, "step": 40}


def test_a_stop_now_reads_as_such_and_its_exit_after_the_stop_is_the_stops(tmp_path):
    run = _kept(tmp_path, {"a": {"stopped": f"{START + 63} node now - root@op\n", "exits": f"{START + 64}.5 137\n"}})
    assert run.outcome() == f"stopped by root@op at {_clock(START + 63)} (--now, no checkpoint)"
    assert run.nodes["a"].state().state == "stopped (--now)"
    assert run.end == START + 64.5  # when it did end


def test_a_node_that_failed_before_a_slurm_stop_still_reads_as_failed(tmp_path):
    stop = f"{START + 63} job graceful 40 root@op\n"
    run = _kept(tmp_path, {"a": {"stopped": stop, "exits": f"{START + 10} 1\n"},
                           "b": {"stopped": stop, "exits": f"{START + 65} 75\n"}})
    assert run.nodes["a"].state().state == "exited(1)"
    assert run.nodes["b"].state().state == "stopped (graceful, checkpoint at step 40)"
    assert run.outcome() == f"exit 1 (a); stopped by root@op at {_clock(START + 63)} (graceful, checkpoint at step 40)"


def test_a_node_the_stop_did_not_reach_still_reads_as_no_exit_recorded(tmp_path):
    run = _kept(tmp_path, {"a": {"stopped": f"{START + 63} node graceful - root@op\n"}, "b": {}})
    assert run.outcome() == (f"stopped by root@op at {_clock(START + 63)} (graceful, no checkpoint reported); "
                             "no exit recorded (b)")
    assert run.end is None


@pytest.mark.parametrize("line", [
    "99999999999999999999 node graceful 40 root@op",  # a time no clock has
    "1764072063 node graceful 99999999999999999999 root@op",  # a step no counter reaches
    "1764072063 node graceful 40 \x1b[2Jroot@op",  # an escape sequence
    "1764072063 node graceful 40 [red]root@op[/]",  # rich markup
    "1764072063 node graceful 40 root@op extra",
    "1764072063 node kindly 40 root@op",
    "-1764072063 node graceful 40 root@op",
    "",
])
def test_a_stop_record_that_is_not_exactly_what_stop_writes_is_no_record(tmp_path, line):
    run = _kept(tmp_path, {"a": {"stopped": line + "\n", "exits": f"{START + 5} 1\n"}})
    assert run.nodes["a"].stopped is None
    assert run.outcome() == "exit 1 (a)"


def test_a_huge_stop_record_file_is_read_no_further_than_its_first_line(tmp_path):
    run = _kept(tmp_path, {"a": {"stopped": f"{START + 63} node graceful 40 root@op\n" + "x" * 5_000_000}})
    assert run.nodes["a"].stopped == runs.Stop(START + 63, "root@op", True, 40, True)


def test_a_stop_on_another_day_than_the_start_shows_its_date(tmp_path):
    later = START + 3 * 86400
    run = _kept(tmp_path, {"a": {"stopped": f"{later} node graceful 7 root@op\n"}})
    assert run.outcome().startswith(f"stopped by root@op at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(later))} (")


def test_every_stop_command_says_who_stops_it(tmp_path):
    inv = _inv(tmp_path)
    for kind in ("host", "docker"):
        argv = runtime.RUNTIMES[kind](inv).stop_argv(inv.nodes[0], 45, "alice@desk")
        assert "alice@desk" in argv
    assert runtime.operator() in runtime.RUNTIMES["host"](inv).stop_argv(inv.nodes[0])
    assert runtime.operator().count("@") == 1 and " " not in runtime.operator()
    slurm_inv = loads(f"""
job: {{name: demo, runtime: host}}
slurm: {{login: {{address: 198.18.0.10}}, nodes: 2}}
storage:
  data: {{host: /nas/data, container: /data}}
  checkpoints: {{host: {tmp_path}, container: /ckpt}}
""")
    assert slurm.stop_argv(slurm_inv, 45, "alice@desk")[-1] == "alice@desk"


# --- docker and Slurm: their engines cannot run here; a stand-in for each command, the real script ----


def _stand_ins(tmp_path: Path, scripts: dict[str, str]) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(tmp_path)}


def test_a_slurm_stop_is_kept_in_each_node_s_directory_with_only_what_came_after_it(tmp_path):
    """A Slurm stop is kept in each node's directory, with only what was said after it."""
    inv = loads(f"""
job: {{name: demo, runtime: host}}
slurm: {{login: {{address: 198.18.0.10}}, nodes: 2}}
storage:
  data: {{host: /nas/data, container: /data}}
  checkpoints: {{host: {tmp_path / 'ckpt'}, container: /ckpt}}
""")
    run = runs.new_id(START)
    job = Path(runtime.job_dir(inv))
    for node in ("n1", "n2"):
        (job / "runs" / run / node).mkdir(parents=True)
        # an earlier stop of this run (a requeue since): not what this stop's program said
        (job / "runs" / run / node / "log").write_text("[rank0]: trainer: stopped by SIGTERM at step 3 (epoch 0)\n")
    (job / "slurm-job").write_text(f"77 {run}\n")
    env = _stand_ins(tmp_path, {
        "squeue": 'cat "$STATE/slurm-state"\n',
        "scancel": 'if [ "$1" = --signal=TERM ]; then for n in "$STATE"/ckpt/.ddp-deploy/demo/runs/*/n*/; do\n'
                   '  echo "[rank0]: trainer: stopped by SIGTERM at step 12 (epoch 1); checkpoint written" >> "$n/log"; done\n'
                   'fi\necho COMPLETED > "$STATE/slurm-state"\n',
    })
    (tmp_path / "slurm-state").write_text("RUNNING\n")
    said = subprocess.run(list(slurm.stop_argv(inv, 5, "alice@desk")), env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout
    assert said.startswith("stopped Slurm job 77: trainer: stopped by SIGTERM at step 12"), said
    for node in ("n1", "n2"):
        kept = (job / "runs" / run / f"{node}.stopped").read_text().split()
        assert kept[1:] == ["job", "graceful", "12", "alice@desk"] and abs(int(kept[0]) - time.time()) < 60

    (tmp_path / "slurm-state").write_text("RUNNING\n")  # launched again, stopped at once: no checkpoint said
    subprocess.run(list(slurm.stop_argv(inv, 0, "alice@desk")), env=env, capture_output=True, check=True, timeout=60)
    assert (job / "runs" / run / "n1.stopped").read_text().split()[1:] == ["job", "now", "-", "alice@desk"]


def test_a_docker_stop_is_kept_with_the_run_named_by_the_containers_launch_id(tmp_path):
    inv = _inv(tmp_path)
    run = runs.new_id(START)
    kept = Path(runtime.kept_dir(inv, run, "a"))
    kept.mkdir(parents=True)
    env = _stand_ins(tmp_path, {"docker": f"""case "$1 $5" in
  "inspect {{{{.State.Status}}}}") echo running ;;
  "inspect {{{{range .Config.Env}}}}{{{{println .}}}}{{{{end}}}}") printf 'PATH=/bin\\nDDP_LAUNCH_ID={run}\\n' ;;
  "stop "*) echo "[rank0]: trainer: stopped by SIGTERM at step 9 (epoch 0)" > "$STATE/said" ;;
  "logs "*) cat "$STATE/said" 2>/dev/null ;;
esac
exit 0
"""})
    said = subprocess.run(list(runtime.RUNTIMES["docker"](inv).stop_argv(inv.node("a"), 5, "alice@desk")), env=env,
                          capture_output=True, text=True, check=True, timeout=60).stdout
    assert said == "stopped: trainer: stopped by SIGTERM at step 9 (epoch 0)\n"
    assert (kept.parent / "a.stopped").read_text().split()[1:] == ["node", "graceful", "9", "alice@desk"]


def test_runs_and_status_run_show_the_stop_in_place_of_no_exit_recorded(ddp, tmp_path):
    hosts = _hosts(tmp_path, "exp.1")
    run = runs.new_id(START)
    base = tmp_path / "nas/ckpt/.ddp-deploy/exp.1/runs" / run
    (base / "here").mkdir(parents=True)
    (base / "run.json").write_text(json.dumps({"run": run, "time": START, "program": "script sleeper.py"}))
    (base / "here.stopped").write_text(f"{START + 63} node graceful 40 root@op\n")
    expected = f"stopped by root@op at {_clock(START + 63)} (graceful, checkpoint at step 40)"

    table = _ok(ddp(hosts, "runs")).stdout
    assert expected in table and "no exit recorded" not in table
    assert f"│ {run} │ {view.duration(63)} │" in table  # how long it ran: start to stop
    shown = _ok(ddp(hosts, "status", "--run", run[:15])).stdout
    assert f": script sleeper.py: {expected}" in shown and "stopped (graceful, checkpoint at step 40)" in shown
    data = json.loads(_ok(ddp(hosts, "runs", "--json")).stdout)[0]
    assert data["outcome"] == expected and data["end"] == START + 63
    assert data["stopped"] == data["nodes"]["here"]["stopped"] == {"time": START + 63, "by": "root@op",
                                                                   "graceful": True, "step": 40}
