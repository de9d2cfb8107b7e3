"""Bounding text in bytes, where it is made.

Every bounded text field of the protocol (reasons, event texts, result texts; docs/wire-protocol.md
§3) is limited in UTF-8 *bytes*. Cutting a Python string by characters does not bound its bytes
(one character is up to four), and cutting the bytes anywhere can split a character. `clip_utf8`
is the one helper every producer of such a field uses.
"""

from __future__ import annotations

MARKER = "..."


def clip_utf8(text: str, max_bytes: int, marker: str = MARKER) -> str:
    """`text` cut to at most `max_bytes` bytes of UTF-8, never inside a character, ending with
    `marker` when something was cut. Lone surrogates (which no UTF-8 text holds) become '?'."""
    if max_bytes < 0:
        raise ValueError("max_bytes must be >= 0")
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return data.decode("utf-8")
    tail = marker.encode("utf-8")
    if len(tail) > max_bytes:
        tail = b""
    # The bytes are valid UTF-8, so the only invalid sequence after the cut is the partial
    # character at its end, which "ignore" drops.
    return data[: max_bytes - len(tail)].decode("utf-8", "ignore") + tail.decode("utf-8")


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "replace"))
