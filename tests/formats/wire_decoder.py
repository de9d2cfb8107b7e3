"""An independent decoder of the wire protocol, written from docs/wire-protocol.md alone.

It imports nothing of the project. The packet layout and the order of checks are §2 and §4; the
message types, their fields and field types, the enumerations and the code tables are parsed
from the document's own tables, so a packet that disagrees with a row of the document fails
here. The tests run it on real packets: the telecommands kept in a shipped bus log and the
telemetry a real bus and payload publish.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crcmod.predefined
import msgpack

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "wire-protocol.md"
DOC = DOC_PATH.read_text(encoding="utf-8")

crc16 = crcmod.predefined.mkCrcFun("crc-ccitt-false")  # §2.4
SECONDARY = struct.Struct(">BBHHHQ")  # §2.2: wire version, ack flags, type, source, epoch, time


class Undecodable(Exception):
    """A packet the document says is rejected; `code` is the response code's name (§4)."""

    def __init__(self, code: str, detail: str = ""):
        super().__init__(f"{code}: {detail}" if detail else code)
        self.code = code


def _section(title: str) -> str:
    start = DOC.index(title)
    level = title.split(" ")[0]
    following = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(DOC, start + len(title))
    return DOC[start : following.start() if following else len(DOC)]


# --- tables of the document ---------------------------------------------------------------------
#: §3: type number -> (name, "TC" | "TM")
MESSAGE_TYPES = {
    int(number, 16): (name, direction)
    for number, name, direction in re.findall(
        r"^\| `(0x[0-9a-f]{4})` \| (\w+) \| (TC|TM) \| `\w+` \|$", _section("## 3. Message types"), re.M
    )
}
#: §5.2: response code names
RESPONSE_CODES = {
    int(code): name for code, name in re.findall(r"^\| (\d+) \| (\w+) \|", _section("### 5.2 Response codes"), re.M)
}
#: §5.3: event id -> (name, severity name); severities by name -> number
EVENTS = {
    int(number, 16): (name, severity)
    for number, name, severity in re.findall(
        r"^\| `(0x[0-9a-f]{4})` \| (\w+) \| (\w+) \|$", _section("### 5.3 Events"), re.M
    )
}
SEVERITIES = {
    int(number): name
    for name, number in re.findall(
        r"(FATAL|WARNING_HI|WARNING_LO|COMMAND|ACTIVITY_HI|ACTIVITY_LO|DIAGNOSTIC) (\d)", _section("### 5.3 Events")
    )
}
#: §5.5: enumerated strings
STRING_ENUMS = {
    name: re.findall(r"`([a-z_]+)`", values)
    for name, values in re.findall(r"^- (\w+): (.*(?:\n  .*)*)", _section("### 5.5 Enumerated strings"), re.M)
}
INT_ENUMS = {"ResponseCode": RESPONSE_CODES, "EventId": {k: v[0] for k, v in EVENTS.items()}, "Severity": SEVERITIES}
#: §5.1
APIDS = {
    int(number, 16): name
    for number, name in re.findall(r"^\| `(0x[0-9A-F]{3})` \| (\w+) \|", _section("### 5.1 Addressing"), re.M)
}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # §2.3


@dataclass(frozen=True)
class FieldRow:
    name: str
    type: str
    notes: str

    @property
    def may_be_absent(self) -> bool:
        """§2.3: a field with a default may be left out."""
        return self.notes.startswith("default")


def _fields_of(type_number: int) -> list[FieldRow]:
    name, direction = MESSAGE_TYPES[type_number]
    heading = re.search(rf"^#### `{type_number:#06x}` {name} \({direction}, `\w+`\)$", DOC, re.M)
    assert heading, f"no section for {name}"
    end = re.compile(r"^#{1,4} ", re.M).search(DOC, heading.end())
    text = DOC[heading.end() : end.start() if end else len(DOC)]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append(FieldRow(cells[0].strip("`"), cells[1].replace("\\|", "|"), cells[2]))
    return rows


FIELDS = {number: _fields_of(number) for number in MESSAGE_TYPES}


# --- field types (§3 "Field types") -------------------------------------------------------------
def _bound(text: str) -> int:
    text = text.strip()
    if "^" in text:
        base, _, rest = text.partition("^")
        exponent, _, minus = rest.partition("-")
        return int(base) ** int(exponent) - (int(minus) if minus else 0)
    return int(text)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_value(kind: str, value: Any, where: str) -> None:
    """Raise Undecodable unless `value` is of the document's type `kind`."""
    kind = kind.strip()
    if " | nil" in kind or kind.endswith("| nil"):
        if value is None:
            return
        kind = kind.rsplit("|", 1)[0].strip()
    if m := re.fullmatch(r"u(8|16|32|64)", kind):
        if not _int(value) or not 0 <= value < 2 ** int(m.group(1)):
            raise Undecodable("BAD_FIELD_VALUE", f"{where}: {value!r} is not {kind}")
        return
    if m := re.fullmatch(r"uint (\S+)\.\.(\S+)", kind):
        if not _int(value) or not _bound(m.group(1)) <= value <= _bound(m.group(2)):
            raise Undecodable("BAD_FIELD_VALUE", f"{where}: {value!r} is not {kind}")
        return
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise Undecodable("BAD_FIELD_TYPE", f"{where}: {value!r} is not a finite float")
        for op, limit in re.findall(r"(≥|≤) (-?[\d.]+)", kind):
            if (op == "≥" and value < float(limit)) or (op == "≤" and value > float(limit)):
                raise Undecodable("BAD_FIELD_VALUE", f"{where}: {value!r} outside {kind}")
        return
    if kind == "bool":
        if not isinstance(value, bool):
            raise Undecodable("BAD_FIELD_TYPE", f"{where}: {value!r} is not a bool")
        return
    if kind == "name":
        if not isinstance(value, str) or not NAME_RE.match(value) or ".." in value:
            raise Undecodable("BAD_NAME", f"{where}: {value!r} is not a name")
        return
    if m := re.fullmatch(r"str ≤ (\d+) B(?:, ≥ (\d+) char)?", kind):
        if not isinstance(value, str) or len(value.encode("utf-8")) > int(m.group(1)):
            raise Undecodable("FIELD_TOO_LONG", f"{where}: {value!r} is not {kind}")
        if m.group(2) and len(value) < int(m.group(2)):
            raise Undecodable("BAD_FIELD_VALUE", f"{where}: {value!r} is not {kind}")
        return
    if m := re.fullmatch(r"bin(?:,? (?:exactly (\d+)|(\d+)\.\.(\d+)) B)?", kind):
        if not isinstance(value, bytes):
            raise Undecodable("BAD_FIELD_TYPE", f"{where}: {value!r} is not bin")
        exact, low, high = m.groups()
        if (exact and len(value) != int(exact)) or (low and not int(low) <= len(value) <= int(high)):
            raise Undecodable("BAD_FIELD_VALUE", f"{where}: {len(value)} bytes is not {kind}")
        return
    if m := re.fullmatch(r"array of (.+?), ≤ (\d+)(, unique)?", kind):
        if not isinstance(value, list) or len(value) > int(m.group(2)):
            raise Undecodable("BAD_FIELD_TYPE", f"{where}: {value!r} is not {kind}")
        for i, item in enumerate(value):
            check_value(m.group(1), item, f"{where}[{i}]")
        if m.group(3) and len(set(value)) != len(value):
            raise Undecodable("BAD_FIELD_VALUE", f"{where}: items not unique")
        return
    if m := re.fullmatch(r"map name → (.+?), ≤ (\d+)", kind):
        if not isinstance(value, dict) or len(value) > int(m.group(2)):
            raise Undecodable("BAD_FIELD_TYPE", f"{where}: {value!r} is not {kind}")
        for key, item in value.items():
            check_value("name", key, f"{where} key")
            check_value(m.group(1), item, f"{where}[{key}]")
        return
    if m := re.fullmatch(r"(\w+) \((int|str)\)", kind):
        enum_name, wire_type = m.groups()
        if wire_type == "int":
            if not _int(value) or value not in INT_ENUMS[enum_name]:
                raise Undecodable("BAD_FIELD_VALUE", f"{where}: {value!r} is not a {enum_name}")
        elif not isinstance(value, str) or value not in STRING_ENUMS[enum_name]:
            raise Undecodable("BAD_FIELD_VALUE", f"{where}: {value!r} is not a {enum_name}")
        return
    raise AssertionError(f"{where}: the document's type {kind!r} is not one this decoder knows")


# --- packets (§2, §4) ---------------------------------------------------------------------------
@dataclass
class Packet:
    telecommand: bool
    apid: int
    seq: int  # 30 bits, §6.1
    wire_version: int
    ack_flags: int
    type_number: int
    type_name: str
    source_id: int
    time_us: int
    body: dict


def decode(data: bytes) -> Packet:
    """One packet, checked in the order of §4; raises Undecodable(code name)."""
    if len(data) > 65542:
        raise Undecodable("OVERSIZED_PACKET")
    if len(data) < 6:
        raise Undecodable("MALFORMED_PACKET")
    word0, word1, data_length = struct.unpack_from(">HHH", data)
    if data_length + 7 != len(data):
        raise Undecodable("BAD_LENGTH")
    if len(data) < 25:
        raise Undecodable("MALFORMED_PACKET")
    if crc16(data) != 0:  # §2.4: the CRC over the whole packet, its own field included, is zero
        raise Undecodable("BAD_CRC")
    if word0 >> 13 != 0:
        raise Undecodable("BAD_VERSION")
    if not word0 >> 11 & 1 or word1 >> 14 != 0b11:
        raise Undecodable("MALFORMED_PACKET")
    telecommand = bool(word0 >> 12 & 1)
    version, ack, type_number, source, epoch, time_us = SECONDARY.unpack_from(data, 6)
    if version != 1:
        raise Undecodable("BAD_VERSION")
    if ack & 0xF0 or (not telecommand and ack):
        raise Undecodable("MALFORMED_PACKET")
    if type_number not in MESSAGE_TYPES:
        raise Undecodable("UNKNOWN_COMMAND" if telecommand else "UNKNOWN_MESSAGE_TYPE")
    name, direction = MESSAGE_TYPES[type_number]
    if (direction == "TC") != telecommand:
        raise Undecodable("WRONG_PACKET_TYPE")
    try:
        body = msgpack.unpackb(data[22:-2], raw=False, strict_map_key=True)
    except UnicodeDecodeError:
        raise Undecodable("INVALID_UTF8") from None
    except Exception:  # any other msgpack failure
        raise Undecodable("BODY_UNDECODABLE") from None
    if not isinstance(body, dict):
        raise Undecodable("BODY_UNDECODABLE")
    rows = {row.name: row for row in FIELDS[type_number]}
    for key in body:
        if key not in rows:
            raise Undecodable("UNEXPECTED_FIELD", f"{name}.{key}")
    for row in rows.values():
        if row.name not in body:
            if not row.may_be_absent:
                raise Undecodable("MISSING_FIELD", f"{name}.{row.name}")
            continue
        check_value(row.type, body[row.name], f"{name}.{row.name}")
    return Packet(
        telecommand=telecommand,
        apid=word0 & 0x7FF,
        seq=epoch << 14 | word1 & 0x3FFF,
        wire_version=version,
        ack_flags=ack,
        type_number=type_number,
        type_name=name,
        source_id=source,
        time_us=time_us,
        body=body,
    )
