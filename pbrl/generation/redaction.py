"""Redaction of the API key (docs/design/algorithms.md#api-comparators): every text that leaves the API client
(:mod:`pbrl.generation.api_transport`) — exception messages, log lines, quoted server bodies, ``Location`` headers and
the answers themselves — goes through :class:`Redactor`, which replaces any piece of at least
:data:`REDACT_MIN_CHARS` characters of the key (the whole key when shorter), as sent or percent-, JSON- or
base64-encoded, whatever its position or cut.
"""

from __future__ import annotations

import base64
import json
from urllib.parse import quote, quote_plus

REDACT_MIN_CHARS = 8  # any piece of the key this long (the whole key when shorter) is redacted
HIDDEN = "<hidden>"
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")  # keeps every length


def _encodings(secret: str) -> set[str]:
    """The forms in which a server may echo ``secret``: as sent, percent-encoded (path, query or form style),
    JSON-escaped (with or without ``\\/``), Python-repr-escaped, base64 on its own."""
    as_json = json.dumps(secret)[1:-1]
    raw = secret.encode("utf-8", errors="replace")
    forms = {
        secret,
        quote(secret, safe=""),
        quote(secret),
        quote_plus(secret, safe=""),
        as_json,
        as_json.replace("/", "\\/"),
        json.dumps(secret, ensure_ascii=False)[1:-1],
        repr(secret)[1:-1],
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
    }
    return {form for form in forms if form}


class Redactor:
    """Hides a secret in any text: every stretch that shares at least ``min_chars`` consecutive characters with
    the secret (the whole secret when it is shorter) — in any form of :func:`_encodings`, ASCII case ignored —
    becomes ``<hidden>``, whatever its position or where a truncation cut it. Text without it comes back as is.

    Written here rather than taken from a library: log-scrubbing libraries replace whole known values (or
    patterns of known key formats), not every long-enough piece of one value, which is what a server echoing a
    truncated key leaves behind. Cost: a few ``str.find`` calls (C) per text, however long.
    """

    def __init__(self, secret: str | None, min_chars: int = REDACT_MIN_CHARS):
        self._windows: dict[int, set[str]] = {}  # length n -> every n-character piece of every form
        self._anchors: set[tuple[str, int]] = set()  # (aligned block of a form, n)
        if not secret:
            return
        for form in _encodings(secret):
            low = form.translate(_ASCII_LOWER)
            n = min(min_chars, len(low))
            self._windows.setdefault(n, set()).update(low[i : i + n] for i in range(len(low) - n + 1))
            # Every n-character piece of the form contains one of its blocks of h = ceil(n/2) characters that start
            # at a multiple of h, so finding those few blocks finds every piece.
            h = (n + 1) // 2
            self._anchors.update((low[k : k + h], n) for k in range(0, len(low) - h + 1, h))

    def __call__(self, text: str) -> str:
        """``text`` with every piece of the secret replaced by ``<hidden>``."""
        if not self._anchors or not text:
            return text
        low = text.translate(_ASCII_LOWER)
        spans: list[tuple[int, int]] = []
        for block, n in self._anchors:
            windows = self._windows[n]
            at = low.find(block)
            while at != -1:
                spans += [(s, s + n) for s in range(max(0, at - n + len(block)), at + 1) if low[s : s + n] in windows]
                at = low.find(block, at + 1)
        if not spans:
            return text
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:  # overlapping or touching pieces: one <hidden>
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        out, pos = [], 0
        for start, end in merged:
            out += [text[pos:start], HIDDEN]
            pos = end
        return "".join(out) + text[pos:]
