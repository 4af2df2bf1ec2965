"""What the shipped inventories say about train.args is what the tool gives each kind of program."""

import re
from pathlib import Path

import pytest

from deploy.inventory import load, loads
from deploy.job.plan import contract_env, program_args

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ["hosts.yaml", "hosts.example.yaml"]


def train_comments(text: str) -> str:
    """The comments of the ``train:`` section, joined into one text."""
    section = text.split("\ntrain:\n", 1)[1]
    section = re.split(r"^\S", section, maxsplit=1, flags=re.M)[0]
    return " ".join(line.split("#", 1)[1].strip() for line in section.splitlines() if "#" in line)


def with_own_module(text: str):
    own = text.replace("# module: pkg.train", "module: pkg.train", 1)
    assert own != text, "the shipped file no longer shows train.module commented out"
    return loads(own, base_dir=REPO)


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_inventory_names_every_flag_added_for_the_built_in_trainer(name):
    """The shipped inventory names every flag the tool adds for the built-in trainer."""
    inv = load(REPO / name)
    added = program_args(inv)[:-len(inv.train.args)]
    said = train_comments((REPO / name).read_text())
    assert [flag for flag in added if flag.startswith("--") and flag not in said] == []


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_inventory_says_a_module_or_script_gets_train_args_alone(name):
    """The shipped inventory says a module or script gets train.args alone, and the rest from the
    environment."""
    text = (REPO / name).read_text()
    own = with_own_module(text)
    assert program_args(own) == own.train.args  # what the tool does: nothing added
    said = train_comments(text)
    assert re.search(r"module/script gets these args alone", said), said
    named = set(re.findall(r"\bDDP_[A-Z_]+", said))
    assert {"DDP_DATA_DIR", "DDP_CKPT_DIR", "DDP_DEVICE", "DDP_BACKEND"} <= named
    assert named <= set(contract_env(own, "data", "ckpt")) | {"DDP_NODE_NAME"}  # names it really sets
