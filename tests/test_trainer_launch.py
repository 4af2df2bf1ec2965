import socket
import subprocess
import sys

import pytest

from agent.launch import bind_rendezvous_store, option, relays_output, torchrun_args
from fakes import free_port


def test_arguments_after_the_separator_go_to_the_trainer_and_before_it_to_torchrun():
    args = torchrun_args(["--nnodes", "3", "--rdzv-backend", "c10d", "--", "--epochs", "1"], {})
    cut = args.index("-m")
    assert args[:cut] == ["--nnodes", "3", "--rdzv-backend", "c10d"]  # no --tee: the launcher relays the output
    assert args[cut:] == ["-m", "trainer", "--epochs", "1"]
    assert relays_output(["--nnodes", "3", "--", "--epochs", "1"])
    assert not relays_output(["--epochs", "1"])  # standalone: the workers print as they do under torchrun


def test_the_options_own_tee_or_redirects_are_kept_and_torchrun_writes_the_output():
    """The options' own --tee or --redirects are kept as given, and torchrun writes the output."""
    for own in (["--tee", "1"], ["--redirects=3"], ["-r", "2"], ["-t", "3"]):
        args = torchrun_args([*own, "--nnodes", "1", "--", "--epochs", "1"], {})
        assert args[:len(own)] == own and args.count("--tee") == (own[0] == "--tee")
        assert not relays_output([*own, "--nnodes", "1", "--", "--epochs", "1"])


def test_without_separator_it_runs_standalone_with_every_argument_for_the_trainer():
    args = torchrun_args(["--dataset", "mnist", "--data-dir", "/elsewhere"], {"NPROC_PER_NODE": "4"})
    assert args[:3] == ["--standalone", "--nproc-per-node", "4"]
    assert args[args.index("trainer") + 1:] == ["--dataset", "mnist", "--data-dir", "/elsewhere"]


def test_standalone_starts_one_process_per_gpu_or_one_without_gpus(monkeypatch):
    import agent.launch as launch

    monkeypatch.setattr(launch, "default_nproc", lambda: "1")  # what a machine without GPUs reports
    assert torchrun_args([], {})[:3] == ["--standalone", "--nproc-per-node", "1"]


def test_default_nproc_counts_visible_gpus(monkeypatch):
    import torch
    import agent.launch as launch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert launch.default_nproc() == "1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # GPUs cannot exist here
    assert launch.default_nproc() == "8"


@pytest.mark.parametrize("args", [["--local-addr", "10.1.2.3"], ["--local_addr", "10.1.2.3"],
                                  ["--nnodes", "2", "--local-addr=10.1.2.3"]])
def test_local_addr_is_read_in_every_spelling_torchrun_accepts(args):
    assert option([*args, "-m", "trainer", "--local-addr", "trainer's own"], "--local-addr") == "10.1.2.3"


def test_a_trainer_flag_of_the_same_name_is_not_taken_for_torchrun_s():
    assert option(["--nnodes", "1", "-m", "trainer", "--local-addr", "x"], "--local-addr") is None


def _listeners(port: int) -> list[str]:
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines()]


def test_the_rendezvous_store_listens_on_the_local_address_alone(monkeypatch):
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend

    monkeypatch.setattr(backend, "TCPStore", backend.TCPStore)  # undone after the test
    bind_rendezvous_store("127.0.0.2")
    port = free_port()
    store = backend.TCPStore("127.0.0.2", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10))
    assert _listeners(port) == [f"127.0.0.2:{port}"]  # not *:port, as TCPStore binds by default
    client = backend.TCPStore("127.0.0.2", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_master_addr_that_is_not_this_node_is_a_clear_setup_error(monkeypatch):
    from datetime import timedelta

    from trainer import dist

    monkeypatch.setenv("MASTER_ADDR", "198.18.255.254")  # an address no interface here holds
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(dist.DistSetupError, match=r"^cannot listen on MASTER_ADDR 198\.18\.255\.254:.*--local-addr"):
        dist._bound_store(0, 2, timedelta(seconds=5))


def test_entry_runs_another_module_via_the_launcher_and_is_not_passed_to_torchrun():
    """--entry runs another module through the same launcher, and is not passed to torchrun."""
    args = torchrun_args(["--nnodes", "2", "--entry", "trainer.netcheck", "--", "--size-mb", "1"], {})
    assert args == ["--nnodes", "2", "-m", "trainer.netcheck", "--size-mb", "1"]
    assert torchrun_args(["--entry=trainer.netcheck", "--"], {}) == ["-m", "trainer.netcheck"]


def test_script_runs_a_script_path_through_the_same_launcher():
    args = torchrun_args(["--nnodes", "2", "--script", "train.py", "--", "--epochs", "1"], {})
    assert args == ["--nnodes", "2", "train.py", "--epochs", "1"]
    assert torchrun_args(["--script=sub/t.py", "--"], {}) == ["sub/t.py"]


def test_a_program_option_without_a_value_is_a_usage_error():
    with pytest.raises(SystemExit, match="--script needs a value"):
        torchrun_args(["--script", "--", "x"], {})


def _watcher(endpoint: str, conf: str) -> subprocess.Popen:
    code = ("import time\nfrom agent.launch import watch_rendezvous\n"
            f"print(watch_rendezvous(['--rdzv-endpoint', {endpoint!r}, '--rdzv-conf', {conf!r}], every=0.1, "
            "slack=0) is not None, flush=True)\ntime.sleep(5)\nprint('still here', flush=True)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_node_gives_up_naming_a_rendezvous_store_silent_past_join_timeout():
    """A node whose rendezvous store stays silent past join_timeout gives up, naming it."""
    port = free_port()  # nothing listens there: the rendezvous node is gone
    out, err = _watcher(f"127.0.0.1:{port}", "join_timeout=1,read_timeout=1").communicate(timeout=30)
    assert out.strip() == "True" and "still here" not in out
    assert f"the rendezvous store at 127.0.0.1:{port} has not answered for 1 s" in err
    assert "ddp-deploy --without NODE launch" in err


def test_a_store_that_answers_and_the_node_hosting_it_are_never_given_up_on():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        answered = _watcher(f"127.0.0.1:{port}", "join_timeout=1")
        out, _ = answered.communicate(timeout=30)
    assert answered.returncode == 0 and out.split() == ["True", "still", "here"]
    host, _ = _watcher(f"127.0.0.1:{free_port()}", "is_host=1,join_timeout=1").communicate(timeout=30)
    assert host.split() == ["False", "still", "here"]


def test_only_a_node_range_with_room_is_elastic():
    from agent.launch import elastic

    assert elastic(["--nnodes", "2:3", "--rdzv-backend", "c10d"])
    assert elastic(["--nnodes=1:4"])
    assert not elastic(["--nnodes", "3:3"]) and not elastic(["--nnodes", "3"]) and not elastic([])


# Two agents' rendezvous handlers on one real c10d store: one fails (an exception on its way
# out, as torch's launcher calls shutdown from a `finally`), then a newcomer must still be able
# to join; after one that ends cleanly, no agent can join any more.
RENDEZVOUS_AFTER_FAILURE = r"""
import sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from agent.launch import keep_rendezvous_open_on_failure

keep_rendezvous_open_on_failure()
port = int(sys.argv[1])

def handler(host):
    return get_rendezvous_handler(RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="job", min_nodes=1, max_nodes=3,
        is_host=host, join_timeout=20, last_call_timeout=1))

def joins():
    try:
        handler(False).next_rendezvous()
        return "joined"
    except RendezvousClosedError:
        return "closed"

host = handler(True)
lost = handler(False)
try:
    try:
        raise ConnectionError("the store stopped answering")
    finally:
        lost.shutdown()
except ConnectionError:
    pass
print("after a failed agent:", joins())
handler(False).shutdown()
print("after a finished agent:", joins())
"""


def test_a_failing_agent_leaves_the_rendezvous_open_and_a_finishing_one_closes_it(torch_python):
    """An elastic agent that fails leaves the rendezvous open, and one that finishes closes it."""
    proc = subprocess.run([torch_python.python, "-c", RENDEZVOUS_AFTER_FAILURE, str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["after a failed agent: joined", "after a finished agent: closed"], proc.stderr[-3000:]


def _teed_process(tmp_path, script: str) -> subprocess.Popen:
    """agent.launch's run_teed around ``python -c script``, started in a session (and group) of its own."""
    code = ("import sys; from agent.launch import run_teed; "
            f"sys.exit(run_teed({str(tmp_path)!r}, [sys.executable, '-c', {script!r}]))")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _teed(tmp_path, script: str):
    """agent.launch's run_teed around ``python -c script``, in a process of its own."""
    proc = _teed_process(tmp_path, script)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def test_the_launchers_output_is_kept_in_the_run_log_as_printed_with_its_exit_code(tmp_path):
    """The launcher's output is kept in the run log as printed, and its exit code recorded."""
    rc, out = _teed(tmp_path, "import sys; print('one', flush=True); print('two', file=sys.stderr, flush=True); "
                              "print('three'); sys.exit(3)")
    assert rc == 3 and out.splitlines() == ["one", "two", "three"]
    assert (tmp_path / "log").read_text().splitlines() == ["one", "two", "three"]
    when, code = (tmp_path / "exits").read_text().split()
    assert code == "3" and abs(float(when) - __import__("time").time()) < 60


def test_a_restarted_launcher_appends_to_the_same_log_and_exits(tmp_path):
    _teed(tmp_path, "print('first')")
    _teed(tmp_path, "print('second'); raise SystemExit(1)")
    assert (tmp_path / "log").read_text().splitlines() == ["first", "second"]
    assert [line.split()[1] for line in (tmp_path / "exits").read_text().splitlines()] == ["0", "1"]


def test_sigterm_reaches_the_job_through_the_tee_and_its_planned_stop_is_logged(tmp_path):
    script = ("import signal, sys, time\n"
              "def stop(n, f):\n    print('stopped by SIGTERM', flush=True); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop); print('ready', flush=True); time.sleep(60)")
    proc = _teed_process(tmp_path, script)
    assert proc.stdout.readline().strip() == "ready"  # its handler in place, and the tee's (set before it started)
    proc.send_signal(__import__("signal").SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "stopped by SIGTERM" in (tmp_path / "log").read_text()


def test_a_sigterm_to_the_launchers_whole_group_reaches_the_job_once(tmp_path):
    """As the host runtime's stop signals the group: the job gets it from the tee alone, not twice."""
    import os
    import signal

    script = ("import signal, sys, time\n"
              "got = []\nsignal.signal(signal.SIGTERM, lambda n, f: got.append(n))\n"
              "print('ready', flush=True)\nend = time.monotonic() + 30\n"
              "while not got and time.monotonic() < end: time.sleep(0.05)\n"
              "time.sleep(1); print('SIGTERMs:', len(got), flush=True)")
    proc = _teed_process(tmp_path, script)
    assert proc.stdout.readline().strip() == "ready"
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.splitlines() == ["SIGTERMs: 1"]


def test_a_run_log_that_cannot_be_written_costs_the_copy_not_the_job(tmp_path):
    rc, out = _teed(tmp_path / "missing", "print('still runs')")
    assert rc == 0 and "still runs" in out and "warning: cannot write" in out
