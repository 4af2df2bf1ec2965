"""``ddp-train``: the trainer where torch is installed, else one line saying what to install."""

from __future__ import annotations


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
