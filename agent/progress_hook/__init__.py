"""The directory the launcher puts first on its workers' ``PYTHONPATH`` (agent/launch.py): a
``sitecustomize`` that installs :mod:`ddp_deploy_progress` in every worker torchrun starts, before
the program runs. Its modules are imported by their own top-level names, never as ``agent.*``:
a program's own ``agent`` package is still the one found first."""

import os

DIRECTORY = os.path.dirname(os.path.abspath(__file__))
