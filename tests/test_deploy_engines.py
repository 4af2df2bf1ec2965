"""One engine interface (deploy/cli/engine.py): the SSH fleet and Slurm implement the same verbs, each
states what it cannot do in its own ``limits``, and the CLI only picks the engine and calls."""

from __future__ import annotations

import inspect

import pytest
import yaml

from deploy.cli import choose, cli
from deploy.cli.engine import Engine
from deploy.cli.engine_fleet import FleetCommands
from deploy.cli.engine_slurm import SlurmCommands
from deploy.errors import InputError
from deploy.inventory import loads

STORAGE = {"data": {"host": "/nas/data", "container": "/data"}, "checkpoints": {"host": "/nas/ckpt", "container": "/ckpt"}}
FLEET = {"job": {"name": "mnist", "runtime": "host"}, "rendezvous": {"node": "a"}, "storage": STORAGE,
         "nodes": [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2"}]}
SLURM = {"job": {"name": "mnist", "runtime": "host"}, "storage": STORAGE, "train": {"python": "/nas/venv/bin/python"},
         "slurm": {"login": {"address": "10.0.0.5"}, "nodes": 2, "procs_per_node": 2}}


class Invocation:
    """What a program gives an engine: the inventory, its file, and the masking of secrets."""

    def __init__(self, data: dict, hosts: str = "hosts.yaml") -> None:
        self.hosts = hosts
        self.inv = loads(yaml.safe_dump(data))

    def redact(self, text: str) -> str:
        return text


def _implements(engine: type[Engine], verb: str) -> bool:
    return not getattr(getattr(engine, verb), "refuses", False)  # the base's refusing version: not implemented


@pytest.mark.parametrize("engine", choose.ENGINES, ids=lambda e: e.__name__)
def test_every_engine_implements_each_verb_or_states_why_not(engine):
    assert not inspect.isabstract(engine), f"{engine.__name__} lacks {sorted(engine.__abstractmethods__)}"
    assert set(engine.limits) <= set(Engine.VERBS)
    assert not _implements(Engine, "join") and _implements(Engine, "runs")  # the rule can tell the two apart
    for verb in Engine.VERBS:
        if verb in engine.limits:
            assert engine.limits[verb].strip(), f"{engine.__name__}.limits[{verb!r}] gives no reason"
            assert not _implements(engine, verb), f"{engine.__name__} implements {verb} yet names it a limit"
        else:
            assert _implements(engine, verb), f"{engine.__name__} neither implements {verb} nor names it a limit"


def test_the_cli_offers_exactly_the_engines_verbs():
    assert set(cli.commands) - {"sync"} == set(Engine.VERBS)  # sync: deploy's other name


def test_the_inventory_picks_its_engine():
    assert type(choose.for_invocation(Invocation(FLEET))) is FleetCommands
    assert type(choose.for_invocation(Invocation(SLURM))) is SlurmCommands


def test_a_verb_an_engine_cannot_run_is_refused_with_the_engines_own_reason():
    with pytest.raises(InputError, match=r"^join: not on Slurm: Slurm allocates the nodes"):
        SlurmCommands(Invocation(SLURM)).join("node1", dry_run=True)
    with pytest.raises(InputError, match=r"^unlock: not on Slurm: there is no job lock"):
        SlurmCommands(Invocation(SLURM)).unlock(force=False)
    with pytest.raises(InputError, match="no slurm: section"):
        FleetCommands(Invocation(FLEET)).batch_script()


def test_a_program_calls_an_engines_verb_without_the_cli(tmp_path, capsys):
    FleetCommands(Invocation(FLEET, hosts="fleet.yaml")).validate()
    assert capsys.readouterr().out == ("fleet.yaml: ok: job mnist, runtime host, 2 nodes, 2 processes, rendezvous "
                                       "10.0.0.1:29400\n")
    SlurmCommands(Invocation(SLURM, hosts="slurm.yaml")).export("slurm", "job", None, None, None, str(tmp_path / "job.sbatch"))
    script = (tmp_path / "job.sbatch").read_text()
    assert script.startswith("#!") and "#SBATCH --nodes=2" in script


def test_the_cli_and_the_engine_print_the_same(ddp, tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump(SLURM))
    got = ddp(hosts, "launch", "--dry-run")
    assert got.exit_code == 0, got.output
    assert SlurmCommands(Invocation(SLURM)).batch_script() in got.output
