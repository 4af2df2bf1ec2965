"""The torch versions this project supports, and every use of torch internals that differs by version.

Importing this module does not import torch: the deploy tool reads ``TORCH_SUPPORTED`` on the
operator's machine to judge the versions its nodes report.

The range is tested at both ends (README, Tests): the oldest is the Dockerfile's default base
image (pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime), the newest the release the Makefile
installs. pyproject.toml declares the same range (a test compares them).

Torch internals used, and how they behave across the range:

- ``TCPStore(master_listen_fd=...)``: TCPStore binds every address of the machine; handed a
  socket already bound to the node's address, it listens there alone. That works from 2.8 on
  (:data:`BOUND_STORE_SINCE`). Before 2.8 the libuv backend (the default since 2.4) refuses a
  listen fd (NotImplementedError, pytorch#150215; ``USE_LIBUV=0`` does not reach a TCPStore
  built directly), and the classic backend takes it but aborts the process ("failed to format
  addr, unknown family=0") when a reverse DNS lookup of the address fails for a while, as it
  does on a node whose resolver is unreachable (seen on the test cluster). So before 2.8 both
  stores (the c10d rendezvous store, the workers' store) are left to torch and listen on every
  address: README, Security. Tried here: 2.5.1 as described, 2.8.0 and 2.14.1 bound.
- The c10d rendezvous backend creates its store through the module attribute
  ``c10d_rendezvous_backend.TCPStore`` on every supported version (trainer.launch replaces it).
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` and ``RendezvousStoreInfo.build(..., local_addr)``
  (MASTER_ADDR is the node's --local-addr, not its hostname) exist from 2.4 on.
- ``TORCHELASTIC_USE_AGENT_STORE`` is set by the agent on every supported version.
"""

from __future__ import annotations

TORCH_SUPPORTED = ">=2.5.1,<2.15"
"""The torch versions the trainer runs on (pip specifier; the same string as in pyproject.toml)."""

BOUND_STORE_SINCE = (2, 8)
"""The first torch whose TCPStore can be hosted on a socket bound to one address (see above)."""


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.5.1+cu124"`` -> ``(2, 5, 1)``: the release numbers, without local or pre-release tags
    (raises ValueError for a string that is not a version)."""
    from packaging.version import Version

    return Version(version).release


def torch_supported(version: str) -> bool:
    """Whether a torch version string (``torch.__version__``) is inside :data:`TORCH_SUPPORTED`."""
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


def binds_stores(version: str | None = None) -> bool:
    """Whether this torch (or ``version``) hosts the c10d stores on a socket bound to one address."""
    if version is None:
        import torch

        version = torch.__version__
    return version_tuple(version) >= BOUND_STORE_SINCE
