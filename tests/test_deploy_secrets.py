"""Secrets: read on the operator's machine at launch, one-line values, sent on stdin, shown as ***."""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.parse
from pathlib import Path

import pytest
import yaml

from deploy.engines import fleet, slurmjob
from deploy.job import plan, runs, secretenv
from deploy.errors import InputError, InventoryError
from deploy.inventory import loads
from deploy.job.scripts import SECRETS_FROM_STDIN
from deploy.nodes.transport import Result
from agent.contract import SECRET_NAMES_ENV, Mask
from agent.masking import StreamMask
from local_job import inventory



def _data(key: str, **train) -> dict:
    return inventory([{"name": "a", "address": "127.0.0.1"}], job="s",
                     train={"module": "pkg.train", "secrets": {"TOKEN": {"env": "MY_TOKEN"}, "KEY": {"file": key}}, **train})


def _inv(tmp_path, key_text: str | None):
    key = tmp_path / "key.txt"
    if key_text is not None:
        key.write_text(key_text)
    return loads(json.dumps(_data(key.name)), base_dir=tmp_path)


def test_values_come_from_the_environment_and_a_file_relative_to_hosts_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "tok-123456")
    assert secretenv.resolve(_inv(tmp_path, "file-secret\n")) == {"TOKEN": "tok-123456", "KEY": "file-secret"}


@pytest.mark.parametrize("env, key, message", [
    (None, "file-secret", r"train.secrets.TOKEN: \$MY_TOKEN is not set in this shell"),
    ("tok-123456", None, r"train.secrets.KEY: cannot read .*key.txt"),
    ("tok-123456", "two\nlines\n", r"train.secrets.KEY: .* spans lines"),
    ("short", "file-secret", r"train.secrets.TOKEN: the value from \$MY_TOKEN has 5 characters"),
])
def test_a_secret_that_cannot_be_read_or_used_is_an_input_error_naming_it(tmp_path, monkeypatch, env, key, message):
    if env is None:
        monkeypatch.delenv("MY_TOKEN", raising=False)
    else:
        monkeypatch.setenv("MY_TOKEN", env)
    with pytest.raises(InputError, match=message) as caught:
        secretenv.resolve(_inv(tmp_path, key))
    assert caught.value.exit_code == 2


def test_the_redactor_hides_every_value_longest_first():
    redact = secretenv.Redactor({"A": "abcdef", "B": "abcdefgh"})
    assert redact("x abcdefgh y abcdef z") == "x *** y *** z"
    assert not secretenv.Redactor({}) and secretenv.Redactor({})("abc") == "abc"


def test_stdin_lines_reach_the_command_s_environment_verbatim_without_a_shell():
    """Stdin lines reach the command's environment verbatim, without a shell reading them."""
    values = {"TOKEN": "it's $(id) `x` \\n \"q\" ; rm", "OTHER": "a=b=c  spaced"}
    r = subprocess.run(["sh", "-c", SECRETS_FROM_STDIN, "sh", "env"], input=secretenv.stdin_lines(values),
                       capture_output=True, check=True)
    env = dict(line.split("=", 1) for line in r.stdout.decode().splitlines() if "=" in line)
    assert env["TOKEN"] == values["TOKEN"] and env["OTHER"] == values["OTHER"]


# A value with what escaping changes: quotes, a backslash, non-ASCII (one char outside the BMP).
AWKWARD = 'p"a\'ss\\wörd-🔑/+ x'


@pytest.mark.parametrize("spelling", [
    pytest.param(lambda v: v, id="as is"),
    pytest.param(lambda v: json.dumps({"token": v}), id="json.dumps"),
    pytest.param(lambda v: json.dumps({"token": v}, ensure_ascii=False), id="json.dumps non-ASCII"),
    pytest.param(lambda v: repr({"token": v}), id="repr"),
    pytest.param(lambda v: ascii([v]), id="ascii"),
    pytest.param(lambda v: repr(v.encode()), id="repr of bytes"),
    pytest.param(lambda v: json.dumps({"line": json.dumps({"token": v})}), id="json in json"),
    pytest.param(lambda v: json.dumps({"args": repr([v])}), id="repr in json"),
    pytest.param(lambda v: repr({"args": repr(v)}), id="repr in repr"),
    pytest.param(lambda v: "https://h/api?key=" + urllib.parse.quote(v, safe=""), id="percent-encoded"),
    pytest.param(lambda v: "q=" + urllib.parse.quote_plus(v), id="form-encoded"),
    pytest.param(lambda v: "Bearer " + base64.b64encode(v.encode()).decode(), id="base64"),
    pytest.param(lambda v: base64.urlsafe_b64encode(v.encode()).decode().rstrip("="), id="base64 url-safe"),
])
def test_the_redactor_hides_a_value_in_each_spelling_a_program_prints_it(spelling):
    printed = f"before {spelling(AWKWARD)} after"
    shown = secretenv.Redactor({"TOKEN": AWKWARD})(printed)
    assert "***" in shown and shown.startswith("before ") and shown.endswith(" after")
    for part in (AWKWARD, "ss\\", "wörd", "w\\u00f6rd", "w\\xf6rd", "🔑", "\\U0001f511", "\\ud83d"):
        assert part not in shown, (part, shown)


def test_the_node_masks_an_output_stream_cut_anywhere_as_the_operator_masks_text():
    value = "tok-\"é\\-123456"
    line = f"[rank0]: METRICS {json.dumps({'token': value})} and {value!r}\n".encode()
    mask = Mask([value])
    for cut in range(1, len(line)):
        stream = StreamMask(mask)
        out = stream.feed(line[:cut]) + stream.feed(line[cut:]) + stream.end()
        assert out.decode() == secretenv.Redactor({"T": value})(line.decode()), cut
    # A finished line is given back at once; of an unfinished one (a progress bar) all but the
    # end that could still become a value.
    stream = StreamMask(mask)
    assert stream.feed(b"step 1\nstep 2") == b"step 1\n" and stream.end() == b"step 2"
    assert len(stream.feed(b"=" * 1000)) == 1000 - (mask.longest - 1)


def test_the_launcher_reads_secret_names_from_a_reserved_variable_a_job_cannot_set(tmp_path):
    """The launcher reads the secrets' names from a reserved variable that a job cannot set."""
    mask = Mask.from_environ("TOKEN,MISSING", {"TOKEN": "tok-123456", SECRET_NAMES_ENV: "TOKEN"})
    assert mask("a tok-123456 b") == "a *** b"
    hosts = json.dumps(_data("k", env={SECRET_NAMES_ENV: "X"}))
    with pytest.raises(InventoryError, match=SECRET_NAMES_ENV):
        loads(hosts, base_dir=tmp_path)


def _states_for(stdout: str, secret: str) -> plan.NodeState:
    """fleet.node_states over one node whose status command printed ``stdout``."""
    inv = loads(json.dumps(_data("k")), base_dir=Path("/nonexistent"))

    class Printed:  # what the node printed; reaching a node is not what is tested
        def run(self, cmds, **_):
            return {n: Result(n, 0, stdout, "") for n in cmds}

    return fleet.node_states(inv, Printed(), secretenv.Redactor({"TOKEN": secret}))["a"]


@pytest.mark.parametrize("secret, head, state", [("running", "running", "running"),
                                                  ("exited", "exited 1", "exited(1)"),
                                                  ("restarts", "restarting", "restarting")])
def test_a_secret_equal_to_a_state_word_changes_neither_the_state_nor_launch(secret, head, state):
    """A secret equal to a state word changes neither the state nor what launch decides."""
    metrics = f'METRICS {{"step": 3, "note": "{secret}"}}'
    got = _states_for(f"{head}\nrestarts 2\n{metrics}\n", secret)
    assert (got.state, got.restarts) == (state, 2)
    assert got.metrics == 'METRICS {"step": 3, "note": "***"}'


def test_a_kept_run_whose_exit_time_equals_a_secret_still_shows_how_it_ended():
    listed = '@@run 20261123-101341-6d79\n{"time": 1764000000}\n@@node a\n1764000123.500 3\n'
    redact = secretenv.Redactor({"TOKEN": "1764000123.500"})
    (run,) = secretenv.masked(runs.parse(listed), redact)
    assert run.nodes["a"].state().state == "exited(3)" and run.outcome() == "exit 3 (a)"


def test_a_secret_equal_to_slurms_job_state_leaves_the_job_active_on_slurm():
    inv = loads(yaml.safe_dump({
        "job": {"name": "s", "runtime": "host"}, "slurm": {"login": {"address": "10.0.0.5"}, "nodes": 1},
        "storage": {"data": {"host": "/nas/data", "container": "/data"},
                    "checkpoints": {"host": "/nas/ckpt", "container": "/ckpt"}},
        "train": {"module": "pkg.train"}}))
    printed = ("job 12 R1\nscontrol JobId=12 JobState=RUNNING Reason=None Restarts=0\n@@run R1\n@@node n1\n"
               'METRICS {"step": 5, "note": "RUNNING"}\n')

    class Login:  # what the login node printed
        def run(self, cmds, **_):
            return {n: Result(n, 0, printed, "") for n in cmds}

    s = slurmjob.job_state(inv, Login(), secretenv.Redactor({"TOKEN": "RUNNING"}))
    assert s.state == "RUNNING" and s.active
    assert s.nodes["n1"].metrics == 'METRICS {"step": 5, "note": "***"}'
