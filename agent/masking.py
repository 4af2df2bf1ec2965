"""A byte stream masked as it passes: what the launcher writes of its workers' output, the secrets
(agent.contract.Mask) already ``***`` wherever a chunk's end cut one. Stdlib only."""

from __future__ import annotations

from .contract import Mask


class StreamMask:
    """Masks a byte stream read in arbitrary chunks: a form cut by a chunk's end is masked once
    its rest arrives. Holds back at most the longest form less one byte of an unfinished line."""

    def __init__(self, mask: Mask) -> None:
        self._mask = mask
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        text = self._mask.data(self._held + chunk)
        # No value spans lines (secretenv refuses them), nor any of its forms: what ends a line is final.
        cut = max(text.rfind(b"\n"), text.rfind(b"\r")) + 1
        cut = max(cut, len(text) - (self._mask.longest - 1))
        self._held = text[cut:]
        return text[:cut]

    def end(self) -> bytes:
        rest, self._held = self._mask.data(self._held), b""
        return rest
