"""Secret values shown as ``***`` in printed text: on the node, before a job's output is written
anywhere (trainer.launch), and on the operator's machine (deploy.job.secretenv.Redactor). Stdlib only.

A program rarely prints a secret only as it is: a dict printed whole, a log record, a METRICS
line or a URL spell it escaped. Each value is masked in every spelling :func:`forms` lists.
"""

from __future__ import annotations

import base64
import json
import os
import re
from urllib.parse import quote, quote_plus

MASK = "***"
SECRET_NAMES_ENV = "DDP_SECRET_NAMES"
"""Set by ``ddp-deploy launch`` when the job has secrets: their names, comma-separated (never a
value). The launcher reads the values from its own environment and masks its output with them."""


def _escapes(text: str) -> set[str]:
    """``text`` as a string literal's body: JSON (ASCII-only or not), Python's repr and ascii(),
    and the repr of its UTF-8 bytes."""
    return {json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1], ascii(text)[1:-1],
            repr(text)[1:-1], repr(text.encode())[2:-1]}


def forms(value: str) -> set[str]:
    """Every spelling of ``value`` masked: as is; as a JSON, Python (repr, ascii, bytes) string
    body, and each of those escaped once more (a JSON string in a JSON line, a repr in a dict);
    percent-encoded (a URL's query or path, ``+`` or ``%20`` for a space); base64 of its UTF-8
    bytes (standard and URL-safe, with and without padding)."""
    once = _escapes(value)
    out = {value, *once}
    for text in once:
        out |= _escapes(text)
    out |= {quote(value, safe=""), quote_plus(value, safe="")}
    raw = value.encode()
    for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        out |= {encoded.decode(), encoded.decode().rstrip("=")}
    return {f for f in out if f}


class Mask:
    """Replaces every form of the given values with ``***``, in text or bytes, in one pass."""

    def __init__(self, values=()) -> None:
        spelled = sorted({f for v in values if v for f in forms(v)}, key=len, reverse=True)
        # Longest first: where two forms start at the same place, the whole of the longer goes.
        self._text = re.compile("|".join(map(re.escape, spelled))) if spelled else None
        self._data = re.compile(b"|".join(re.escape(f.encode()) for f in spelled)) if spelled else None
        self.longest = len(spelled[0].encode()) if spelled else 0
        """The longest form, in bytes: how much of an unfinished line :class:`StreamMask` holds back."""

    def __bool__(self) -> bool:
        return self._text is not None

    def __call__(self, text: str) -> str:
        return self._text.sub(MASK, text) if self._text is not None else text

    def data(self, chunk: bytes) -> bytes:
        return self._data.sub(MASK.encode(), chunk) if self._data is not None else chunk

    @classmethod
    def from_environ(cls, names: str, environ=os.environ) -> Mask:
        """The values of the variables ``names`` lists (SECRET_NAMES_ENV's format) in ``environ``."""
        return cls(environ.get(n, "") for n in names.split(",") if n)


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
