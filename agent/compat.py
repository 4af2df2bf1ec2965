"""The torch versions this project supports, and every use of torch internals that differs by version.

Importing this module does not import torch. The supported range itself, ``TORCH_SUPPORTED``, is the
contract's (agent/contract.py): the deploy tool judges the versions its nodes report by it. What is
here runs in the image, so it needs nothing beyond torch and the standard library.

The range is tested at its two ends and at the torch of the Dockerfile's default base image
(pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime) between them (docs/testing.md); the newest is the
release the Makefile installs. pyproject.toml declares the same range (a test compares them).

Torch internals used, and how they behave across the range:

- ``TCPStore(master_listen_fd=...)``: TCPStore binds every address of the machine; handed a
  socket already bound to the node's address, it listens there alone. That works from 2.8 on
  (:data:`BOUND_STORE_SINCE`). Before 2.8 the libuv backend (the default since 2.4) refuses a
  listen fd (NotImplementedError; ``USE_LIBUV=0`` does not reach a TCPStore
  built directly), and the classic backend takes it but aborts the process ("failed to format
  addr, unknown family=0") when a reverse DNS lookup of the address fails for a while, as it
  does on a node whose resolver is unreachable (seen on the test cluster). So before 2.8 both
  stores (the c10d rendezvous store, the workers' store) are left to torch and listen on every
  address: docs/security.md. Tried here: 2.5.1 as described, 2.8.0 and 2.14.1 bound.
- The c10d rendezvous backend creates its store through the module attribute
  ``c10d_rendezvous_backend.TCPStore`` on every supported version (agent.launch replaces it).
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` and ``RendezvousStoreInfo.build(..., local_addr)``
  (MASTER_ADDR is the node's --local-addr, not its hostname) exist from 2.4 on.
- ``TORCHELASTIC_USE_AGENT_STORE`` is set by the agent on every supported version.
"""

from __future__ import annotations

import socket

BOUND_STORE_SINCE = (2, 8)
"""The first torch whose TCPStore can be hosted on a socket bound to one address (see above)."""


def binds_stores(version: str | None = None) -> bool:
    """Whether this torch (or ``version``) hosts the c10d stores on a socket bound to one address.

    Runs on the nodes, in the image, where ``packaging`` is not installed: torch's own
    ``TorchVersion`` compares. A pre-release of 2.8 (``2.8.0a0+...``, NGC builds) counts as older
    than 2.8 and keeps torch's own bind, which works on every version.
    """
    from torch.torch_version import TorchVersion

    return TorchVersion(version if version is not None else _torch_version()) >= BOUND_STORE_SINCE


def _torch_version() -> str:
    import torch

    return torch.__version__


def listening_fd(address: str, port: int) -> int:
    """A socket listening on ``address`` alone, as a file descriptor for TCPStore's
    ``master_listen_fd`` (TCPStore itself would listen on every address of the machine)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return socket.create_server((address, port), family=family, backlog=1024).detach()
