"""Judging the torch a node reports against the range the trainer supports (agent.compat)."""

from __future__ import annotations

from agent.contract import TORCH_SUPPORTED


def torch_supported(version: str) -> bool:
    """Whether a torch version string (``torch.__version__``) is inside :data:`TORCH_SUPPORTED`."""
    # Imported here: only the preflight checks compare versions, and packaging takes a few
    # hundredths of a second to import, which every other verb would pay.
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    # "2.5.1+cu124" is 2.5.1 for a range: compare the public version. NVIDIA's NGC images carry
    # pre-release builds ("2.6.0a0+ecf3bae40a.nv25.01"): inside the range, whatever packaging's
    # default for pre-releases is.
    return SpecifierSet(TORCH_SUPPORTED).contains(Version(v.public), prereleases=True)
