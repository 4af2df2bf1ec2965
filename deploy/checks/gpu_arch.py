"""Whether a torch build has code a GPU can run: its compiled architectures (``torch.cuda.
get_arch_list()``, as agent.probe reports them) against the device's compute capability.

A CUDA build carries machine code (``sm_XY``) for some architectures and may carry PTX
(``compute_XY``), which the driver compiles for a newer device. A device of compute capability
M.m runs machine code built for the same major M and a minor up to m (``sm_80`` runs on an 8.6
device, not on a 9.0 one), an architecture-specific build (``sm_90a``) on that exact device
only, and PTX built for any capability up to M.m. A build with neither fails at its first kernel
("no kernel image is available for execution on the device"), after a deploy that went well:
``check`` and ``launch`` refuse such a node first, naming the GPU and the CUDA it needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([a-z]?)")

CUDA_FOR = {(12, 1): "12.9", (12, 0): "12.8", (11, 0): "13.0", (10, 3): "12.9", (10, 0): "12.8", (9, 0): "11.8", (8, 9): "11.8", (8, 7): "11.4", (8, 6): "11.1",
            (8, 0): "11.0", (7, 5): "10.0", (7, 0): "9.0"}
"""The oldest CUDA that builds code for a compute capability: the base of an image (or the wheel
of a host's torch) must have at least it for the GPUs of that generation. 12.x, 11.0 and 10.x:
Blackwell (RTX 50 and DGX Spark, Thor, B100/B200 and B300); 9.0: Hopper (H100, H200); 8.9: Ada (L4, L40S, RTX 40); 8.6 and 8.0:
Ampere (A10, A40, RTX 30; A100); 7.5: Turing (T4); 7.0: Volta (V100)."""

SUGGESTED_BASE = {"12.8": "pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime"}
"""A base of the supported torch range for the GPUs that need the CUDA it is keyed by (and those
of every older generation)."""


@dataclass(frozen=True)
class Arch:
    """One entry of a build's architecture list: machine code (``sm``) or PTX (``compute``)."""

    kind: str
    major: int
    minor: int
    specific: bool
    """An architecture-specific build (``sm_90a``): that capability alone (a family build,
    ``sm_100f``, runs on its major's later minors as plain machine code does)."""

    @classmethod
    def parse(cls, text: str) -> "Arch | None":
        m = _ARCH.fullmatch(text.strip())
        if m is None:
            return None
        return cls(m[1], int(m[2]), int(m[3]), m[4] == "a")

    def runs_on(self, major: int, minor: int) -> bool:
        if self.kind == "compute":
            return (self.major, self.minor) <= (major, minor)
        if self.specific:
            return (self.major, self.minor) == (major, minor)
        return self.major == major and self.minor <= minor


def capability(text: str) -> tuple[int, int] | None:
    """``"9.0"`` -> (9, 0); None where it is not one."""
    m = re.fullmatch(r"(\d{1,3})\.(\d{1,3})", str(text).strip())
    return (int(m[1]), int(m[2])) if m else None


def runs(arch_list: list[str], cap: tuple[int, int]) -> bool:
    """Whether a build with ``arch_list`` has code a device of capability ``cap`` runs."""
    return any(a is not None and a.runs_on(*cap) for a in map(Arch.parse, arch_list))


def older_than_build(arch_list: list[str], cap: tuple[int, int]) -> bool:
    """Whether ``cap`` is older than every architecture the build has machine code for: a newer
    CUDA does not help it, a build that still keeps its generation does."""
    sm = [(a.major, a.minor) for a in map(Arch.parse, arch_list) if a is not None and a.kind == "sm"]
    return bool(sm) and cap < min(sm)


def need(arch_list: list[str], caps: list[tuple[int, int]]) -> tuple[str, str | None]:
    """What a build must have to run every device of ``caps`` (those this one cannot), said as
    ``with CUDA 12.8 or newer`` or ``with code for compute capability 7.0``, and a base image that
    has it where one is known."""
    old = sorted({c for c in caps if older_than_build(arch_list, c)})
    if old:
        return f"with code for compute capability {', '.join(f'{m}.{n}' for m, n in old)}", None
    needed = [cuda_needed(c) for c in caps]
    if not needed or None in needed:
        return "with code for these GPUs", None
    cuda = max(needed, key=lambda v: tuple(int(p) for p in v.split(".")))
    return f"with CUDA {cuda} or newer", SUGGESTED_BASE.get(cuda)


def cuda_needed(cap: tuple[int, int]) -> str | None:
    """The oldest CUDA that builds for ``cap`` (its generation's, where this table knows it)."""
    known = [c for c in CUDA_FOR if c[0] == cap[0] and c[1] <= cap[1]]
    return CUDA_FOR[max(known)] if known else None


def unrunnable(arch_list: object, capabilities: object, used: list[int]) -> list[tuple[int, tuple[int, int]]]:
    """The devices among ``used`` (their indexes as the job sees them) that the build cannot run,
    with their capability; nothing where the probe did not say (a trainer older than the report)."""
    if not isinstance(arch_list, list) or not isinstance(capabilities, list):
        return []
    arch = [a for a in arch_list if isinstance(a, str)][:64]
    out = []
    for i in used:
        cap = capability(capabilities[i]) if i < len(capabilities) else None
        if cap is not None and arch and not runs(arch, cap):
            out.append((i, cap))
    return out


def describe(arch_list: list[str]) -> str:
    """``sm_50 ... sm_90`` (the machine code's range), with its PTX if any."""
    parsed = [a for a in map(Arch.parse, arch_list) if a is not None]
    sm = sorted({(a.major, a.minor, a.specific) for a in parsed if a.kind == "sm"})
    ptx = sorted({(a.major, a.minor) for a in parsed if a.kind == "compute"})
    name = lambda m, n, s="": f"{m}{n}{'a' if s else ''}"  # noqa: E731
    said = (f"sm_{name(*sm[0])}" + (f" ... sm_{name(*sm[-1])}" if len(sm) > 1 else "")) if sm else "no machine code"
    return said + (f", PTX {', '.join(f'compute_{m}{n}' for m, n in ptx)}" if ptx else ", no PTX")
