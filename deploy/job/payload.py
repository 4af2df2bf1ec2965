"""What the job runs: the built-in trainer, or the user's own module or script. One class per kind.

A payload says how the launcher names the program (``--entry MODULE`` / ``--script PATH``, see
agent.launch), which arguments it gets, and what the probe imports to prove it is there before
anything starts. Everything else (torchrun, the environment of the contract, directories, GPUs)
is the same for every payload (plan.py, runtime.py).
"""

from __future__ import annotations

from agent.contract import TRAINER_MODULE

from ..inventory import Inventory


class Payload:
    def __init__(self, inv: Inventory) -> None:
        self.inv = inv

    def describe(self) -> str:
        raise NotImplementedError

    def launcher_options(self) -> tuple[str, ...]:
        """agent.launch options naming the program (before ``--``)."""
        raise NotImplementedError

    def program_args(self, data_dir: str, ckpt_dir: str, tool: tuple[str, ...]) -> tuple[str, ...]:
        """The program's arguments (after ``--``)."""
        return self.inv.train.args

    def probe_options(self) -> tuple[str, ...]:
        """agent.probe options: import the program where it will run, and report the error."""
        raise NotImplementedError


class BuiltinTrainer(Payload):
    """``python -m trainer``: its flags were checked by its own parser when hosts.yaml loaded; the
    tool adds the directories, the device and backend it chose and job.stages (plan.tool_flags)."""

    def describe(self) -> str:
        return "the built-in trainer"

    def launcher_options(self):
        return ()

    def program_args(self, data_dir, ckpt_dir, tool):
        return ("--data-dir", data_dir, "--ckpt-dir", ckpt_dir, *tool, *self.inv.train.args)

    def probe_options(self):
        return ("--import", f"{TRAINER_MODULE}.__main__")


class UserModule(Payload):
    def describe(self) -> str:
        return f"module {self.inv.train.module}"

    def launcher_options(self):
        return ("--entry", self.inv.train.module)

    def probe_options(self):
        return ("--import", self.inv.train.module)


class UserScript(Payload):
    def describe(self) -> str:
        return f"script {self.inv.train.script}"

    def launcher_options(self):
        return ("--script", self.inv.train.script)

    def probe_options(self):
        return ("--script", self.inv.train.script)


def payload(inv: Inventory) -> Payload:
    if inv.train.module is not None:
        return UserModule(inv)
    if inv.train.script is not None:
        return UserScript(inv)
    return BuiltinTrainer(inv)
