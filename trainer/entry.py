"""How the bundle's own modules are started where the user's code is the working directory.

``python -m trainer.launch`` puts the working directory first on ``sys.path``: a project (the
code snapshot, an image's WORKDIR) holding a top-level ``trainer/`` package of its own would be
run instead of this bundle's launcher. ``python -c RUN_MODULE trainer.launch ARGS`` runs the same
module as ``-m`` does, without the working directory on the path (Python 3.11's ``-P``, for
3.10 too). The program the launcher starts gets it back: torchrun runs it with ``-m`` or as a
script, its own directory first, as usual.
"""

from __future__ import annotations

RUN_MODULE = ("import runpy, sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
              "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")
"""With ``-c``, sys.path[0] is '' (the working directory); the module to run is argv[1]."""


def module_argv(module: str) -> list[str]:
    """The interpreter's arguments that run ``module`` as ``-m`` would, the working directory left
    off the import path; the module's own arguments follow."""
    return ["-c", RUN_MODULE, module]


def train_main() -> int:
    """``ddp-train``: the trainer, or one line saying what to install where the operator's install
    (``pip install ddp-bundle``, no torch) is all there is."""
    import importlib.util
    import sys

    if importlib.util.find_spec("torch") is None:
        sys.exit("ddp-train: torch is not installed here (the operator's install leaves the trainer out): "
                 "pip install 'ddp-bundle[trainer]'")
    from .__main__ import main

    return main()
