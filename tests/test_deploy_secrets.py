"""Secrets: read on the operator's machine at launch, one-line values, sent on stdin, shown as ***."""

from __future__ import annotations

import subprocess

import pytest

from deploy import secretenv
from deploy.errors import InputError
from deploy.inventory import loads
from deploy.runtime import SECRETS_FROM_STDIN

INVENTORY = """
job: {{name: s}}
rendezvous: {{node: a}}
nodes: [{{name: a, address: 127.0.0.1}}]
storage:
  data: {{host: /nas/data, container: /data}}
  checkpoints: {{host: /nas/ckpt, container: /ckpt}}
train:
  module: pkg.train
  secrets: {{TOKEN: {{env: MY_TOKEN}}, KEY: {{file: {key}}}}}
"""


def _inv(tmp_path, key_text: str | None):
    key = tmp_path / "key.txt"
    if key_text is not None:
        key.write_text(key_text)
    return loads(INVENTORY.format(key=key.name), base_dir=tmp_path)


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


def test_stdin_lines_reach_the_command_s_environment_verbatim_without_a_shell_reading_them():
    values = {"TOKEN": "it's $(id) `x` \\n \"q\" ; rm", "OTHER": "a=b=c  spaced"}
    r = subprocess.run(["sh", "-c", SECRETS_FROM_STDIN, "sh", "env"], input=secretenv.stdin_lines(values),
                       capture_output=True, check=True)
    env = dict(line.split("=", 1) for line in r.stdout.decode().splitlines() if "=" in line)
    assert env["TOKEN"] == values["TOKEN"] and env["OTHER"] == values["OTHER"]
