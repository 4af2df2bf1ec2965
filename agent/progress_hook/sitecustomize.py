"""Run by Python's ``site`` at every start of an interpreter whose ``PYTHONPATH`` holds this
directory (agent/launch.py puts it there for the job's workers): installs the progress hook
(ddp_deploy_progress), then runs the ``sitecustomize`` this one hides, if any, as Python would have."""

import sys


def _chain() -> None:
    """The next ``sitecustomize`` on ``sys.path`` past this directory (an image's, a site's own), run
    in its place."""
    import importlib.machinery
    import importlib.util
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    import ddp_deploy_progress

    ddp_deploy_progress.install()
except Exception as exc:  # the program runs whatever happens here, without beats
    sys.stderr.write(f"ddp_deploy_progress: warning: no progress beats ({exc!r})\n")
_chain()
