"""The torch versions this project supports, and every use of torch internals that differs by version.

Importing this module does not import torch: the deploy tool reads ``TORCH_SUPPORTED`` on the
operator's machine to judge the versions its nodes report.

The range is tested at both ends (README, Tests): the oldest is the Dockerfile's default base
image (pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime), the newest the release the Makefile
installs. pyproject.toml declares the same range (a test compares them).

Torch internals used, and how they behave across the range:

- ``TCPStore(master_listen_fd=...)`` (both stores are handed a socket already bound to the
  node's address, since TCPStore itself binds every address): the libuv backend, TCPStore's
  default since 2.4, raises NotImplementedError for a listen fd before 2.8 (pytorch#150215;
  tried here: 2.5.1 refuses, 2.8.0 and 2.14.1 accept), and ``USE_LIBUV=0`` does not reach a
  TCPStore built directly. :func:`tcp_store` asks for the
  classic backend on those versions.
- The c10d rendezvous backend creates its store through the module attribute
  ``c10d_rendezvous_backend.TCPStore`` on every supported version (trainer.launch replaces it).
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` and ``RendezvousStoreInfo.build(..., local_addr)``
  (MASTER_ADDR is the node's --local-addr, not its hostname) exist from 2.4 on.
- ``TORCHELASTIC_USE_AGENT_STORE`` is set by the agent on every supported version.
"""

from __future__ import annotations

import re

TORCH_SUPPORTED = ">=2.5.1,<2.15"
"""The torch versions the trainer runs on (pip specifier; the same string as in pyproject.toml)."""

LIBUV_LISTEN_FD_SINCE = (2, 8)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.5.1+cu124"`` -> ``(2, 5, 1)``: the release numbers, without local or pre-release tags."""
    release = re.match(r"\d+(\.\d+)*", version.strip())
    if not release:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in release.group(0).split("."))


def torch_supported(version: str) -> bool:
    """Whether a torch version string (``torch.__version__``) is inside :data:`TORCH_SUPPORTED`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    # "2.5.1+cu124" is 2.5.1 for a range: compare the public version.
    return Version(v.public) in SpecifierSet(TORCH_SUPPORTED)


def tcp_store(host: str, port: int, *, listen_fd: int | None, **kwargs):
    """``torch.distributed.TCPStore``, hosted on an already listening socket when ``listen_fd`` is given."""
    import torch
    from torch.distributed import TCPStore

    if listen_fd is not None and version_tuple(torch.__version__) < LIBUV_LISTEN_FD_SINCE:
        kwargs["use_libuv"] = False
    return TCPStore(host, port, master_listen_fd=listen_fd, **kwargs)
