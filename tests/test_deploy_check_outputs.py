"""Each preflight check's judge on what its own command printed on a real node (tests/check_outputs/):
the rows `check` shows for each recorded output, as the file expects them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.checks.node_checks import AFTER_MEETING, BEFORE_MEETING, Asked
from deploy.nodes.remote import Result
from local_job import local_nodes, on_paper

CASES = sorted((Path(__file__).parent / "check_outputs").glob("*.txt"))
CHECKS = {c.tag: c for c in (*BEFORE_MEETING, *AFTER_MEETING)}


def _read(path: Path) -> tuple[dict, str]:
    head, _, stdout = path.read_text().partition("# ---\n")
    fields: dict = {"stderr": [], "expect": []}
    for line in head.splitlines():
        key, _, value = line.removeprefix("# ").partition(": ")
        fields[key].append(value) if key in ("stderr", "expect") else fields.__setitem__(key, value)
    return fields, stdout


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_a_recorded_output_is_judged_into_the_rows_its_file_expects(case):
    fields, stdout = _read(case)
    check = CHECKS[fields["check"]]
    assert case.stem.split("--")[0] == check.tag and fields["recorded"] and fields["expect"], case.name
    asked = json.loads(fields.get("inventory", "{}"))
    node, job, train = asked.pop("node", {}), asked.pop("job", None), asked.pop("train", {})
    inv = on_paper(local_nodes("n1", **node), job="rec", nas="/tmp/rec/nas", job_fields=job,
                   train={"python": "/opt/venv/bin/python", **train}, **asked)
    stderr = "".join(f"{line}\n" for line in fields["stderr"])
    got = Result("n1", int(fields["exit"]), stdout, stderr)
    rows = check.judge(inv, ["n1"], {"n1": {check.tag: got}}, Asked())
    assert [f"{r.name} | {'ok' if r.ok else 'fail'} | {r.detail}" for r in rows] == fields["expect"]


def test_every_check_that_shows_a_row_has_a_recorded_output_or_its_machine_is_named():
    """A check whose output this corpus lacks is one whose machine was not at hand: GPUs
    (``nvidia-smi -L``; the probe on GPUs is judged from tests/gpu_logs/)."""
    recorded = {p.stem.split("--")[0] for p in CASES}
    shows_rows = {tag for tag in CHECKS if tag not in ("nics", "fabric")}
    assert shows_rows - recorded == {"gpus"}, shows_rows - recorded
