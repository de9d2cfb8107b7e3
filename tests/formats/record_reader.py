"""An independent reader of the record format, written from docs/record-format.md alone.

It imports nothing of the project: the header layout, the acceptance order and its reasons, the
dtype table and the kind table are what the document says (the dtype and kind tables are read
from the document itself, so a row changed there changes what this reader accepts). The tests
run it on real files written by the engine; when it and the bytes disagree, the document is
wrong or the writer is.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import msgpack
import numpy as np

DOC = Path(__file__).resolve().parents[2] / "docs" / "record-format.md"

HEADER = struct.Struct("<4sHHIQI")  # §1 fixed header: magic, version, kind, meta_len, payload_len, header_crc
FOOTER = struct.Struct("<IQ4s")  # §1 footer: record_crc, record_len, commit_magic
MAX_META = 16 * 1024 * 1024


class Rejected(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _doc_table(heading: str, pattern: str) -> list[tuple[str, ...]]:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        found = re.match(pattern, line)
        if found:
            rows.append(found.groups())
        elif rows and not line.startswith("|"):
            break
    return rows


#: §1: dtype -> (item size, numpy dtype the bytes can be viewed as)
ITEMSIZE = {
    name: int(size) for name, size in _doc_table("The dtypes, with their item sizes", r"^\| `(\w+)` \| (\d+) \|")
}
_NUMPY = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",  # no numpy bfloat16: read as raw 16-bit words
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "bool": "u1",
    "float8_e4m3fn": "u1",
    "float8_e5m2": "u1",
}
#: §3: kind number -> name
KINDS = {int(n): name for n, name in _doc_table("## 3. Kinds", r"^\|\s*(\d+)\s*\|\s*`(\w+)`\s*\|")}


def masked_crc(data: bytes) -> int:
    """§1: CRC32C, rotated right by 15 bits, plus 0xA282EAD8 (mod 2^32)."""
    crc = crc32c.crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def align64(n: int) -> int:
    return -(-n // 64) * 64


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    data: bytes

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=_NUMPY[self.dtype]).reshape(self.shape)


@dataclass
class ParsedRecord:
    kind: int
    kind_name: str
    meta: dict
    tensors: dict[str, Tensor] = field(default_factory=dict)
    start: int = 0  # offset of the record's first byte in the buffer it was read from
    length: int = 0
    payload_offset: int = 0  # P, from the record's first byte
    payload_len: int = 0


def read_record(buf: bytes, start: int = 0) -> ParsedRecord:
    """The record at `buf[start:]`, checked in the order of §2; raises Rejected(reason)."""
    have = len(buf) - start
    if have < HEADER.size:
        raise Rejected("truncated", "no fixed header")
    magic, version, kind, meta_len, payload_len, header_crc = HEADER.unpack_from(buf, start)
    if magic != b"OWR1":
        raise Rejected("bad_magic")
    if version != 1:
        raise Rejected("bad_version")
    if meta_len > MAX_META:
        raise Rejected("bad_length", f"meta_len {meta_len}")
    if have < HEADER.size + meta_len:
        raise Rejected("truncated", "metadata incomplete")
    meta_bytes = bytes(buf[start + 24 : start + 24 + meta_len])
    if masked_crc(bytes(buf[start : start + 20]) + meta_bytes) != header_crc:
        raise Rejected("header_crc")
    try:
        meta = msgpack.unpackb(meta_bytes, raw=False, strict_map_key=True)
    except Exception as exc:  # any msgpack failure is the same verdict
        raise Rejected("bad_meta", str(exc)) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), list):
        raise Rejected("bad_meta", "no tensor table")
    if kind not in KINDS:
        raise Rejected("bad_kind", str(kind))
    names = set()
    for entry in meta["tensors"]:
        if not isinstance(entry, dict) or not {"name", "dtype", "shape", "offset", "nbytes", "crc"} <= set(entry):
            raise Rejected("bad_meta", f"table entry {entry!r}")
        if not isinstance(entry["name"], str) or entry["name"] in names or entry["dtype"] not in ITEMSIZE:
            raise Rejected("bad_meta", f"table entry {entry!r}")
        names.add(entry["name"])
        if (
            entry["nbytes"] != math.prod(entry["shape"]) * ITEMSIZE[entry["dtype"]]
            or entry["offset"] < 0
            or entry["offset"] % 64
            or entry["offset"] + entry["nbytes"] > payload_len
        ):
            raise Rejected("bad_meta", f"table entry {entry!r}")
    payload_offset = align64(24 + meta_len)
    total = payload_offset + payload_len + 16
    if have < total:
        raise Rejected("truncated", f"need {total} bytes, have {have}")
    record_crc, record_len, commit = FOOTER.unpack_from(buf, start + total - 16)
    if record_len != total:
        raise Rejected("bad_length", f"footer says {record_len}, header {total}")
    if commit != b"OWC!":
        raise Rejected("no_commit")
    if masked_crc(bytes(buf[start : start + total - 16])) != record_crc:
        raise Rejected("record_crc")
    record = ParsedRecord(kind, KINDS[kind], meta, {}, start, total, payload_offset, payload_len)
    base = start + payload_offset
    for entry in meta["tensors"]:
        data = bytes(buf[base + entry["offset"] : base + entry["offset"] + entry["nbytes"]])
        if masked_crc(data) != entry["crc"]:  # implied by record_crc; checked as a partial reader would
            raise Rejected("tensor_crc", entry["name"])
        record.tensors[entry["name"]] = Tensor(
            entry["name"], entry["dtype"], tuple(entry["shape"]), entry["offset"], data
        )
    return record


def padding_is_zero(buf: bytes, record: ParsedRecord) -> bool:
    """§1: the metadata padding and the gaps between tensors are zero bytes."""
    start = record.start
    meta_end = start + 24 + HEADER.unpack_from(buf, start)[3]
    gaps = [(meta_end, start + record.payload_offset)]
    pos = 0
    for tensor in sorted(record.tensors.values(), key=lambda t: t.offset):
        gaps.append((start + record.payload_offset + pos, start + record.payload_offset + tensor.offset))
        pos = tensor.offset + len(tensor.data)
    gaps.append((start + record.payload_offset + pos, start + record.payload_offset + record.payload_len))
    return all(not any(buf[a:b]) for a, b in gaps)


def read_log(buf: bytes) -> tuple[list[ParsedRecord], Rejected | None]:
    """An appended file: consecutive records from offset 0, stopping at the first rejected one."""
    records: list[ParsedRecord] = []
    pos = 0
    while pos < len(buf):
        try:
            record = read_record(buf, pos)
        except Rejected as exc:
            return records, exc
        records.append(record)
        pos += record.length
    return records, None
