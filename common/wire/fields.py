"""Field specifications: the type, range and encoding of every message field.

A spec checks a value (from msgpack or from Python code) and returns its normalised form
(lists become tuples, maps become read-only mappings, enum values become members) or raises
WireError with the code for that class of bad input. `to_wire` gives the msgpack form back.
"""

from __future__ import annotations

import enum
import math
import re
from types import MappingProxyType
from typing import Any

from common.wire.errors import WireError
from common.wire.ids import MAX_NAME_CHARS, ResponseCode

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
# Characters that make a name address something other than one entry of one directory.
_PATH_CHARS = ("/", "\\", "\x00", ":")


def _describe(value: Any) -> str:
    return type(value).__name__


def check_name(value: Any, field: str) -> str:
    """A name that is safe to use as one file name in a payload directory.

    Path-like names (separators, '..', NUL, drive/stream ':' or a leading '.') get their own
    code, PATH_LIKE_NAME, because they are attempts to reach outside the directory; anything
    else outside the charset or length is BAD_NAME."""
    if not isinstance(value, str):
        raise WireError(
            ResponseCode.BAD_FIELD_TYPE, f"{field}: expected a name string, got {_describe(value)}", field=field
        )
    if any(ch in value for ch in _PATH_CHARS) or ".." in value or value.startswith((".", "~")):
        raise WireError(ResponseCode.PATH_LIKE_NAME, f"{field}: path-like name {value[:80]!r}", field=field)
    if not value or len(value) > MAX_NAME_CHARS or not _NAME_RE.match(value):
        raise WireError(
            ResponseCode.BAD_NAME,
            f"{field}: name {value[:80]!r} must be 1..{MAX_NAME_CHARS} characters of [A-Za-z0-9._-], "
            "starting alphanumeric",
            field=field,
        )
    return value


class Spec:
    def check(self, value: Any, field: str) -> Any:
        raise NotImplementedError

    def to_wire(self, value: Any) -> Any:
        return value


class UInt(Spec):
    """Unsigned integer in [minimum, maximum]. Booleans are not integers here."""

    def __init__(self, maximum: int, minimum: int = 0):
        self.minimum, self.maximum = minimum, maximum

    def check(self, value, field):
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(
                ResponseCode.BAD_FIELD_TYPE, f"{field}: expected an integer, got {_describe(value)}", field=field
            )
        if not self.minimum <= value <= self.maximum:
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE,
                f"{field}: {value} outside [{self.minimum}, {self.maximum}]",
                field=field,
            )
        return int(value)


class Float(Spec):
    """Finite real number; integers are accepted and stored as float."""

    def __init__(self, minimum: float = -math.inf, maximum: float = math.inf):
        self.minimum, self.maximum = minimum, maximum

    def check(self, value, field):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(
                ResponseCode.BAD_FIELD_TYPE, f"{field}: expected a number, got {_describe(value)}", field=field
            )
        try:
            number = float(value)
        except OverflowError:
            raise WireError(ResponseCode.BAD_FIELD_VALUE, f"{field}: number too large", field=field) from None
        if not math.isfinite(number) or not self.minimum <= number <= self.maximum:
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE,
                f"{field}: {number!r} outside [{self.minimum}, {self.maximum}]",
                field=field,
            )
        return number


class Bool(Spec):
    def check(self, value, field):
        if not isinstance(value, bool):
            raise WireError(
                ResponseCode.BAD_FIELD_TYPE, f"{field}: expected a boolean, got {_describe(value)}", field=field
            )
        return value


class Text(Spec):
    """UTF-8 text of at most `max_bytes` encoded bytes."""

    def __init__(self, max_bytes: int, min_chars: int = 0):
        self.max_bytes, self.min_chars = max_bytes, min_chars

    def check(self, value, field):
        if not isinstance(value, str):
            raise WireError(
                ResponseCode.BAD_FIELD_TYPE, f"{field}: expected a string, got {_describe(value)}", field=field
            )
        try:
            encoded = value.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates: a Python str that no UTF-8 sender could have produced.
            raise WireError(ResponseCode.INVALID_UTF8, f"{field}: not encodable as UTF-8", field=field) from None
        if len(encoded) > self.max_bytes:
            raise WireError(
                ResponseCode.FIELD_TOO_LONG, f"{field}: {len(encoded)} bytes > {self.max_bytes}", field=field
            )
        if len(value) < self.min_chars:
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE, f"{field}: shorter than {self.min_chars} characters", field=field
            )
        return value


class Name(Spec):
    def check(self, value, field):
        return check_name(value, field)


class Blob(Spec):
    """Byte string (msgpack bin) with a length range."""

    def __init__(self, max_len: int, min_len: int = 0):
        self.max_len, self.min_len = max_len, min_len

    def check(self, value, field):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise WireError(
                ResponseCode.BAD_FIELD_TYPE, f"{field}: expected bytes, got {_describe(value)}", field=field
            )
        value = bytes(value)
        if len(value) > self.max_len:
            raise WireError(ResponseCode.FIELD_TOO_LONG, f"{field}: {len(value)} bytes > {self.max_len}", field=field)
        if len(value) < self.min_len:
            raise WireError(ResponseCode.BAD_FIELD_VALUE, f"{field}: {len(value)} bytes < {self.min_len}", field=field)
        return value


class Digest(Spec):
    """Exactly `size` bytes (hash values)."""

    def __init__(self, size: int):
        self.size = size

    def check(self, value, field):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise WireError(
                ResponseCode.BAD_FIELD_TYPE, f"{field}: expected bytes, got {_describe(value)}", field=field
            )
        value = bytes(value)
        if len(value) != self.size:
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE, f"{field}: {len(value)} bytes, expected {self.size}", field=field
            )
        return value


class Choice(Spec):
    """A member of an IntEnum (int on the wire) or StrEnum (string on the wire)."""

    def __init__(self, enum_type: type[enum.Enum]):
        self.enum_type = enum_type
        self.wire_type = str if issubclass(enum_type, str) else int

    def check(self, value, field):
        if isinstance(value, bool) or not isinstance(value, self.wire_type):
            raise WireError(
                ResponseCode.BAD_FIELD_TYPE,
                f"{field}: expected {self.enum_type.__name__} ({self.wire_type.__name__}), got {_describe(value)}",
                field=field,
            )
        try:
            return self.enum_type(value)
        except ValueError:
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE,
                f"{field}: {str(value)[:40]!r} is not a {self.enum_type.__name__}",
                field=field,
            ) from None

    def to_wire(self, value):
        return value.value


class ListOf(Spec):
    def __init__(self, item: Spec, max_items: int, min_items: int = 0, unique: bool = False):
        self.item, self.max_items, self.min_items, self.unique = item, max_items, min_items, unique

    def check(self, value, field):
        if not isinstance(value, (list, tuple)):
            raise WireError(
                ResponseCode.BAD_FIELD_TYPE, f"{field}: expected a list, got {_describe(value)}", field=field
            )
        if len(value) > self.max_items:
            raise WireError(ResponseCode.FIELD_TOO_LONG, f"{field}: {len(value)} items > {self.max_items}", field=field)
        if len(value) < self.min_items:
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE, f"{field}: {len(value)} items < {self.min_items}", field=field
            )
        items = tuple(self.item.check(v, f"{field}[{i}]") for i, v in enumerate(value))
        if self.unique and len(set(items)) != len(items):
            raise WireError(ResponseCode.BAD_FIELD_VALUE, f"{field}: items must be unique", field=field)
        return items

    def to_wire(self, value):
        return [self.item.to_wire(v) for v in value]


class MapOf(Spec):
    """String-keyed map; stored as a read-only mapping so messages stay immutable."""

    def __init__(self, key: Spec, value: Spec, max_items: int):
        self.key, self.value, self.max_items = key, value, max_items

    def check(self, value, field):
        if not isinstance(value, (dict, MappingProxyType)):
            raise WireError(
                ResponseCode.BAD_FIELD_TYPE, f"{field}: expected a map, got {_describe(value)}", field=field
            )
        if len(value) > self.max_items:
            raise WireError(
                ResponseCode.FIELD_TOO_LONG, f"{field}: {len(value)} entries > {self.max_items}", field=field
            )
        checked = {}
        for k, v in value.items():
            key = self.key.check(k, f"{field} key")
            checked[key] = self.value.check(v, f"{field}[{key}]")
        return MappingProxyType(checked)

    def to_wire(self, value):
        return {self.key.to_wire(k): self.value.to_wire(v) for k, v in value.items()}


class Optional(Spec):
    """`None` (msgpack nil) or a value of `inner`. An absent optional field reads as None."""

    def __init__(self, inner: Spec):
        self.inner = inner

    def check(self, value, field):
        return None if value is None else self.inner.check(value, field)

    def to_wire(self, value):
        return None if value is None else self.inner.to_wire(value)
