"""Bounding text in bytes, where it is made.

Every bounded text field of the protocol (reasons, event texts, result texts; docs/wire-protocol.md
§3) is limited in UTF-8 *bytes*. Cutting a Python string by characters does not bound its bytes
(one character is up to four), and cutting the bytes anywhere can split a character. `clip_utf8`
is the one helper every producer of such a field uses.

The same text is shown to people: `display_text` makes the characters a terminal does not draw
visible (or that change how the rest is drawn), and `is_blank` is the one rule for a text with
nothing to read (a blank prompt).
"""

from __future__ import annotations

import unicodedata

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


# ---- what a terminal shows, and what counts as blank -------------------------------------------
#
# Text that came from the payload or from a user (prompts, result texts, event texts, reasons) is
# shown on the ground's terminal. Some characters draw nothing there, or change what the others
# look like: C0/C1 controls (an ESC starts a terminal escape sequence, a CR rewrites the line),
# the Unicode bidirectional controls (U+202E RIGHT-TO-LEFT OVERRIDE shows "txt.exe" as "exe.txt"),
# zero-width and other format characters, line and paragraph separators, lone surrogates. Their
# Unicode general categories name them (Cc, Cf, Cs, Zl, Zp); the Hangul fillers are letters (Lo)
# that draw nothing and are added by hand.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_HIDDEN_LETTERS = frozenset("\u115f\u1160\u3164\uffa0")
# Characters that are shown as they are but draw nothing on their own, so a text made only of
# them (with whitespace and hidden characters) is blank: the combining grapheme joiner, the
# variation selectors (which only pick a glyph for the character before them), the Mongolian free
# variation selectors, and the blank braille pattern.
_GLYPHLESS = frozenset(
    "\u034f\u180b\u180c\u180d\u180f\u2800"
    + "".join(map(chr, range(0xFE00, 0xFE10)))
    + "".join(map(chr, range(0xE0100, 0xE01F0)))
)
# Escapes with a name of their own (Python's string escapes).
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def is_hidden(ch: str) -> bool:
    """Whether one character is a control, format (bidirectional, zero-width, ...), separator or
    surrogate character, or an invisible filler letter: what `display_text` escapes."""
    return ch in _HIDDEN_LETTERS or unicodedata.category(ch) in _HIDDEN_CATEGORIES


def is_blank(text: str) -> bool:
    """Whether `text` has no visible character: empty, whitespace, or only hidden (`is_hidden`)
    and glyphless characters (NULs, zero-width spaces, a right-to-left override, a variation
    selector, ...). The one rule for a blank prompt (EMPTY_PROMPT) on the ground, on the wire and
    in the payload's input building."""
    return all(ch.isspace() or ch in _GLYPHLESS or is_hidden(ch) for ch in text)


def _escape(ch: str) -> str:
    named = _NAMED_ESCAPES.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def display_text(text: str, *, keep_newlines: bool = False) -> str:
    """`text` as it may be printed on a terminal: every hidden character (`is_hidden`) replaced
    by a visible escape, `\\x1b`, `\\u202e`, `\\n`, as Python writes them. With `keep_newlines`
    (a block of text such as a result) line feeds and tabs stay as they are; everything else that
    is hidden is escaped. Visible characters, backslashes included, are not changed: the escape
    makes a hidden character visible, the exact text is in `--json`."""
    keep = "\n\t" if keep_newlines else ""
    if all(not is_hidden(ch) or ch in keep for ch in text):
        return text
    return "".join(ch if ch in keep or not is_hidden(ch) else _escape(ch) for ch in text)
