"""README, the docs (docs/*.md), Makefile and the CLI say the same thing."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def docs() -> str:
    """The README and every page of docs/: what a user reads."""
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([a-z][\w -]*):", text, re.M) for t in line.split()}


def test_every_make_target_the_readme_names_exists():
    named = set(re.findall(r"`make ([a-z-]+)", docs()))
    named |= set(re.findall(r"^make ([a-z-]+)", docs(), re.M))
    assert named and named <= make_targets()


def test_the_issue_s_make_targets_exist():
    assert {"deploy", "launch", "status", "logs", "stop", "check", "run-local", "test"} <= make_targets()


def test_every_ddp_deploy_verb_in_the_readme_and_makefile_is_a_cli_command():
    used = set(re.findall(r"ddp-deploy (?:--hosts \S+ )?([a-z]+)", docs()))
    used |= set(re.findall(r"\$\(DEPLOY\) ([a-z]+)", (ROOT / "Makefile").read_text()))
    assert used and used <= set(cli.commands)


def test_the_readme_s_test_command_is_what_ci_runs():
    assert "make test" in (ROOT / "README.md").read_text()
    assert re.search(r"^make test$", (ROOT / ".ci/run").read_text(), re.M)


def test_every_flag_the_readme_shows_for_the_trainer_exists():
    help_text = subprocess.run([sys.executable, "-m", "trainer", "--help"], capture_output=True, text=True, cwd=ROOT).stdout
    shown = set(re.findall(r"(--[a-z][a-z-]+)", _readme_section("The trainer")))
    torchrun_only = {"--standalone", "--nproc-per-node"}
    assert shown - torchrun_only and all(flag in help_text for flag in shown - torchrun_only)


def test_deploy_help_lists_every_verb(ddp):
    result = ddp(ROOT / "hosts.yaml", "--help")
    for verb in ("validate", "check", "deploy", "sync", "launch", "status", "logs", "stop"):
        assert verb in result.output


def test_one_torch_range_in_pyproject_code_readme_makefile_and_the_default_base():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    from deploy.checks.versions import torch_supported
    from agent.contract import TORCH_SUPPORTED
    from torch_ends import range_ends

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"torch{TORCH_SUPPORTED}" in project["optional-dependencies"]["trainer"]
    assert not any(dep.startswith("torch") for dep in project["dependencies"])  # the operator's install has none
    base = re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:(\d+\.\d+\.\d+)-cuda", (ROOT / "Dockerfile").read_text(), re.M)
    assert base and torch_supported(base.group(1))  # a CUDA PyTorch image inside the range
    assert f"`torch{TORCH_SUPPORTED}`" in (ROOT / "README.md").read_text()
    oldest, newest = range_ends()
    make = (ROOT / "Makefile").read_text()
    pin = lambda name: re.search(rf"^{name} \?= torch==(\S+)", make, re.M).group(1)  # noqa: E731
    assert pin("OLDEST_TORCH_PINS") == ".".join(map(str, oldest))
    assert pin("BASE_TORCH_PINS") == base.group(1)  # the default base's torch is tested too
    assert pin("TORCH_PINS").startswith(".".join(map(str, newest)) + ".")


def _readme_section(title: str) -> str:
    """A section of the README or of a page of docs/, by its title."""
    text = docs()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def test_the_readme_s_own_code_example_is_a_valid_train_section(tmp_path):
    import yaml

    from deploy.inventory import loads

    block = re.search(r"```yaml\n(train:.*?)```", _readme_section("Your own training code"), re.S).group(1)
    (tmp_path / "my-project").mkdir()
    base = {"job": {"name": "readme"}, "rendezvous": {"node": "a"}, "nodes": [{"name": "a", "address": "10.0.0.1"}],
            "storage": {"data": {"host": "/nas/data", "container": "/data"},
                        "checkpoints": {"host": "/nas/ckpt", "container": "/ckpt"}}}
    inv = loads(yaml.safe_dump(base) + block, base_dir=tmp_path / "sub")
    assert inv.train.module == "pkg.train" and set(inv.train.secrets) == {"WANDB_API_KEY", "HF_TOKEN"}
    assert inv.train.code.path == "../my-project"


def test_the_readme_s_metrics_helper_prints_the_line_status_reads(capsys):
    from deploy.job.plan import parse_status

    blocks = re.findall(r"```python\n(.*?)```", _readme_section("Your own training code"), re.S)
    (code,) = [block for block in blocks if "def report(" in block]
    scope: dict = {}
    exec(code, scope)
    scope["report"](kind="train", epoch=0, step=1, loss=0.5)
    line = capsys.readouterr().out.strip()
    metrics = parse_status("running\n" + line).metrics
    assert metrics == line and json.loads(metrics[len("METRICS "):])["loss"] == 0.5


def test_every_variable_the_readme_promises_a_program_is_set_by_the_plan():
    from deploy.job import plan
    from deploy.inventory import RESERVED_ENV, loads

    promised = set(re.findall(r"^\| `(DDP_[A-Z_]+)`(?:, `(DDP_[A-Z_]+)`)?", _readme_section("Your own training code"), re.M))
    promised = {v for pair in promised for v in pair if v}
    inv = loads("job: {name: j}\nrendezvous: {node: a}\nnodes: [{name: a, address: 10.0.0.1}]\nstorage:\n"
                "  data: {host: /d, container: /data}\n  checkpoints: {host: /c, container: /ckpt}\n"
                "train: {script: train.py, spawn: true}\n")  # spawn: DDP_PROCS too
    from deploy.job.runtime import CodeDir

    env = dict(plan.launch_spec(inv, 0, code=CodeDir("abc", "/c/x"), run="20261123-101341-6d79").env)
    assert promised and promised <= set(env) and promised <= set(RESERVED_ENV)


def test_the_documented_program_calls_what_both_apis_and_the_run_have():
    import ast
    import inspect

    from deploy.engines.fleet import Fleet
    from deploy.engines.handle import Run
    from deploy.engines.slurmjob import SlurmJob

    text = docs().split("**From a program**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    tree = ast.parse(text)

    def called(on: str) -> set[str]:
        return {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", None) == on}

    assert called("job") == {"deploy", "plan", "launch", "runs"}
    assert called("run") == {"wait", "logs", "stop"}
    for api in (Fleet, SlurmJob):  # the same program serves both
        assert all(callable(getattr(api, name, None)) for name in called("job")), api
        assert {"__enter__", "__exit__"} <= set(dir(api))
    assert all(callable(getattr(Run, name, None)) for name in called("run"))
    assert {"tail", "ranks", "follow"} <= set(inspect.signature(Run.logs).parameters)
    assert set(inspect.signature(Fleet.logs).parameters) == set(inspect.signature(SlurmJob.logs).parameters)
    assert {"say", "without"} <= set(inspect.signature(Fleet).parameters)
    assert "timeout" in inspect.signature(Run.wait).parameters


def test_the_readme_stays_short_tells_no_history_and_links_every_page_of_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 160
    assert not re.findall(r"`[0-9a-f]{7,40}`", readme)  # a commit belongs to git, not to what the tool is
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages and {m for m in re.findall(r"\]\(docs/([\w-]+\.md)\)", readme)} == pages


RECORDS = ("bench/results/",)
"""Data a benchmark wrote (each run's JSON, which names the tree it measured): not prose."""
NUMBERED_WORK = re.compile(r"\b(?:[Ii]ssue|[Ss]ession)s? #?\d+|\bCI at stop \d+")


def _tracked_text() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    texts = {}
    for name in filter(None, names.split("\0")):
        if name.startswith(RECORDS):
            continue
        try:
            texts[name] = (ROOT / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
    return texts


def test_no_file_of_the_repository_narrates_its_history():
    """A record says what is true now; how it came to be is git's: no commit of this repository named
    (as short or long hash), no numbered past work item."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no history to compare with")
    history = subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    prefixes = {c[:n] for c in history for n in range(7, 41)}
    named = {}
    for name, text in _tracked_text().items():
        found = [t for t in re.findall(r"(?<![0-9A-Za-z])[0-9a-f]{7,40}(?![0-9A-Za-z])", text) if t in prefixes]
        found += NUMBERED_WORK.findall(text)
        if found:
            named[name] = found[:5]
    assert not named, named
