"""The OrbitWeaver record format (spec: docs/record-format.md).

A record = 24-byte fixed header + msgpack metadata + 64-byte aligned tensor payload + 16-byte
commit footer, checked by masked CRC32C. `encode` produces the byte chunks to write (tensor
bytes are not copied), `decode` parses a whole record, `decode_partial` reads only some tensors
through a file object.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import crc32c as _crc32c
import msgpack

if TYPE_CHECKING:
    import torch


def _torch():
    """torch, imported on first use: only tensor payloads need it, so queue and state records
    (and the tools that read them) start without paying for the import."""
    import torch

    return torch


MAGIC = b"OWR1"
COMMIT_MAGIC = b"OWC!"
FORMAT_VERSION = 1
FIXED_HEADER = struct.Struct("<4sHHIQI")  # magic, version, kind, meta_len, payload_len, header_crc
FOOTER = struct.Struct("<IQ4s")  # record_crc, record_len, commit_magic
HEADER_LEN = FIXED_HEADER.size  # 24
FOOTER_LEN = FOOTER.size  # 16
ALIGN = 64
MAX_META = 16 << 20
_MASK_DELTA = 0xA282EAD8


class Kind(enum.IntEnum):
    MANIFEST = 1
    VISION_STATE = 2
    VISION_OUT = 3
    PREFILL_BLOCK = 4
    DECODE_STEPS = 5
    RESULT = 6
    HIDDEN_LAYER = 7
    RECOVERY = 8  # one entry per restart of a request, in its checkpoint directory
    QUEUE_ENTRY = 16
    GUARD_STATE = 17
    FINISHED_TASK = 18
    HEALTH_STATE = 19
    TASK_INPUTS = 24  # 20-23 left for other payload records
    TASK_PIXELS = 25
    BUS_COMMAND = 32


#: Every reason a record is rejected with (docs/record-format.md §2 says when each applies).
REASONS = (
    "truncated",
    "bad_magic",
    "bad_version",
    "bad_length",
    "header_crc",
    "bad_kind",
    "bad_meta",
    "no_commit",
    "record_crc",
    "tensor_crc",
    "stale_salt",
)


class RecordError(Exception):
    """A record was rejected. `reason` is one of `REASONS` (docs/record-format.md §2)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def crc32c(data, crc: int = 0) -> int:
    """CRC32C (Castagnoli), hardware-accelerated, over any buffer without copying it.

    (`google-crc32c` computes the same values at the same speed but accepts only `bytes`, which
    would cost a copy of every tensor written.)"""
    return _crc32c.crc32c(data, crc)


def masked_crc(data, crc: int = 0) -> int:
    return mask(crc32c(data, crc))


def mask(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Item sizes by dtype name (docs/record-format.md §1 lists the same), so that records can be
# checked and sized without importing torch.
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_from_name(name: str):
    dtype = getattr(_torch(), name, None) if name in ITEMSIZE else None
    if dtype is None:
        raise RecordError("bad_meta", f"unknown dtype {name!r}")
    return dtype


def aligned_buffer(nbytes: int) -> memoryview:
    """A writable buffer whose first byte is 64-byte aligned.

    Tensors decoded from it are then aligned like freshly computed ones; CPU kernels pick
    different code paths for misaligned operands, and restored state must compute bitwise
    like the original."""
    import numpy as np  # here, not at the top: the payload's command thread reads and writes its
    # state and queue records before it answers the bus, and they carry no tensor (docs/flight.md "Boot")

    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + nbytes].data


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat memoryview (host, contiguous); no copy when already so."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(-1).view(_torch().uint8).numpy().data


@dataclass
class Record:
    kind: Kind
    meta: dict = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def salt(self) -> int:
        return int(self.meta.get("salt", 0))


@dataclass
class Encoded:
    """A record ready to write: `chunks` are written back to back; `nbytes` is their total."""

    chunks: list
    nbytes: int

    def to_bytes(self) -> bytes:
        return b"".join(bytes(c) for c in self.chunks)


def _layout(meta: dict | None, tensors: dict, salt: int, crc_of) -> tuple[dict, list, int, bytes]:
    """The record's metadata, (offset, tensor) pairs, payload length and packed metadata:
    shared by `encode` and `encoded_size`, so sizes are those of the records written."""
    meta = dict(meta or {})
    table, placed, offset = [], [], 0
    for name, t in tensors.items():
        nbytes = _nbytes(t)
        offset = align(offset)
        table.append(
            {
                "name": name,
                "dtype": _dtype_of(t),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": nbytes,
                "crc": crc_of(t),
            }
        )
        placed.append((offset, t))
        offset += nbytes
    meta["salt"] = int(salt)
    meta["tensors"] = table
    meta_bytes = msgpack.packb(meta, use_bin_type=True)
    if len(meta_bytes) > MAX_META:
        raise ValueError("record metadata too large")
    return meta, placed, offset, meta_bytes


def _nbytes(t) -> int:
    if isinstance(t, TensorSpec):
        return t.nbytes
    return t.numel() * t.element_size()


def _dtype_of(t) -> str:
    return t.dtype if isinstance(t, TensorSpec) else dtype_name(t.dtype)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's dtype name and shape, without its data: for sizing records not written."""

    dtype: str
    shape: tuple

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * ITEMSIZE[self.dtype]


def encoded_size(kind: Kind, meta: dict | None, tensors: dict[str, TensorSpec]) -> int:
    """Bytes `encode` produces for a record with this metadata and these tensors (specs), with
    the largest salt and checksums the metadata can hold (msgpack sizes integers by value, so
    a real record is at most a few bytes smaller before the 64-byte alignment absorbs them)."""
    _, _, payload_len, meta_bytes = _layout(meta, tensors, (1 << 63) - 1, lambda t: 0xFFFFFFFF)
    return align(HEADER_LEN + len(meta_bytes)) + payload_len + FOOTER_LEN


def encode(
    kind: Kind, meta: dict | None = None, tensors: dict[str, torch.Tensor] | None = None, salt: int = 0
) -> Encoded:
    """Lay out a record. Tensor bytes are referenced, not copied (keep tensors alive until written)."""
    tensors = tensors or {}
    view_of = {id(t): tensor_bytes(t) for t in tensors.values()}
    meta, placed, payload_len, meta_bytes = _layout(meta, tensors, salt, lambda t: masked_crc(view_of[id(t)]))
    views = [(off, view_of[id(t)]) for off, t in placed]
    head = FIXED_HEADER.pack(MAGIC, FORMAT_VERSION, int(kind), len(meta_bytes), payload_len, 0)[:20]
    header_crc = masked_crc(meta_bytes, crc32c(head))
    head += struct.pack("<I", header_crc)
    prefix_len = align(HEADER_LEN + len(meta_bytes))
    chunks: list[bytes | memoryview] = [head, meta_bytes, bytes(prefix_len - HEADER_LEN - len(meta_bytes))]
    pos = 0
    for off, view in views:
        if off > pos:
            chunks.append(bytes(off - pos))
        chunks.append(view)
        pos = off + view.nbytes
    crc = 0
    for c in chunks:
        crc = crc32c(c, crc)
    total = prefix_len + payload_len + FOOTER_LEN
    chunks.append(FOOTER.pack(mask(crc), total, COMMIT_MAGIC))
    return Encoded(chunks, total)


@dataclass
class Header:
    kind: int
    meta: dict
    payload_offset: int
    payload_len: int

    @property
    def record_len(self) -> int:
        return self.payload_offset + self.payload_len + FOOTER_LEN


def _parse_header(buf, base: int = 0, available: int | None = None) -> Header:
    available = len(buf) - base if available is None else available
    if available < HEADER_LEN:
        raise RecordError("truncated", "shorter than the fixed header")
    magic, version, kind, meta_len, payload_len, header_crc = FIXED_HEADER.unpack_from(buf, base)
    if magic != MAGIC:
        raise RecordError("bad_magic")
    if version != FORMAT_VERSION:
        raise RecordError("bad_version", str(version))
    if meta_len > MAX_META:
        raise RecordError("bad_length", "metadata length out of range")
    if available < HEADER_LEN + meta_len:
        raise RecordError("truncated", "metadata incomplete")
    meta_bytes = bytes(buf[base + HEADER_LEN : base + HEADER_LEN + meta_len])
    crc = masked_crc(meta_bytes, crc32c(bytes(buf[base : base + 20])))
    if crc != header_crc:
        raise RecordError("header_crc")
    try:
        meta = msgpack.unpackb(meta_bytes, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types; all mean the same here
        raise RecordError("bad_meta", str(exc)) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), list):
        raise RecordError("bad_meta", "metadata is not a map with a tensor table")
    return Header(kind, meta, align(HEADER_LEN + meta_len), payload_len)


_KINDS = frozenset(int(k) for k in Kind)


def _check_kind(header: Header) -> None:
    """A verified header naming a kind this format version does not define was written by a newer
    or foreign writer, never made by a flipped bit (the header CRC covers the kind). Checked after
    `_parse_header`, which the journal reader also uses to trust a damaged record's length."""
    if header.kind not in _KINDS:
        raise RecordError("bad_kind", f"kind {header.kind} is not defined")


def _check_table(header: Header) -> None:
    names = set()
    for entry in header.meta["tensors"]:
        try:
            if not isinstance(entry["name"], str) or entry["name"] in names:
                raise RecordError("bad_meta", f"tensor name {entry['name']!r} is not a new string")
            names.add(entry["name"])
            if entry["dtype"] not in ITEMSIZE:
                raise RecordError("bad_meta", f"unknown dtype {entry['dtype']!r}")
            nbytes = math.prod(entry["shape"]) * ITEMSIZE[entry["dtype"]]
            ok = (
                entry["nbytes"] == nbytes
                and entry["offset"] % ALIGN == 0
                and 0 <= entry["offset"]
                and entry["offset"] + nbytes <= header.payload_len
            )
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise RecordError("bad_meta", f"tensor table entry {entry!r} is inconsistent")


def _tensor_from(buf, base: int, entry: dict) -> torch.Tensor:
    dtype = dtype_from_name(entry["dtype"])
    torch = _torch()
    if entry["nbytes"] == 0:
        return torch.empty(entry["shape"], dtype=dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=entry["nbytes"], offset=base + entry["offset"])
    return flat.view(dtype).view(entry["shape"])


def decode(buf, base: int = 0, expect_kind: Kind | None = None) -> tuple[Record, int]:
    """Parse and fully verify the record starting at `buf[base]`; returns (record, its length).

    Tensors are views into `buf` (a bytearray keeps them writable and alive)."""
    header = _parse_header(buf, base)
    _check_kind(header)
    _check_table(header)
    total = header.record_len
    if len(buf) - base < total:
        raise RecordError("truncated", f"need {total} bytes, have {len(buf) - base}")
    record_crc, record_len, commit = FOOTER.unpack_from(buf, base + total - FOOTER_LEN)
    if record_len != total:
        raise RecordError("bad_length", "footer length disagrees with header")
    if commit != COMMIT_MAGIC:
        raise RecordError("no_commit")
    if masked_crc(memoryview(buf)[base : base + total - FOOTER_LEN]) != record_crc:
        raise RecordError("record_crc")
    if expect_kind is not None and header.kind != expect_kind:
        raise RecordError("bad_meta", f"kind {header.kind}, expected {int(expect_kind)}")
    tensors = {e["name"]: _tensor_from(buf, base + header.payload_offset, e) for e in header.meta["tensors"]}
    meta = {k: v for k, v in header.meta.items() if k != "tensors"}
    return Record(Kind(header.kind), meta, tensors), total


def iter_records(buf) -> Iterator[tuple[Record, int, int]]:
    """Yield (record, offset, length) for consecutive records; stop at the first one rejected.

    After the loop, `iter_records.end` is not available; callers track offset + length."""
    pos = 0
    while pos < len(buf):
        try:
            record, length = decode(buf, pos)
        except RecordError:
            return
        yield record, pos, length
        pos += length


class ReadableFile(Protocol):
    """What the partial readers need of a file object (a raw file, BytesIO, ...)."""

    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: Any, /) -> int | None: ...


def read_envelope(f: ReadableFile, file_size: int) -> Header:
    """Verify a whole-file record's header, tensor table and commit footer without its payload."""
    f.seek(0)
    head = f.read(min(file_size, 4096))
    try:
        header = _parse_header(head, 0, file_size)
    except RecordError as exc:
        if exc.reason != "truncated" or file_size <= len(head):
            raise
        f.seek(0)
        head = f.read(file_size)
        header = _parse_header(head, 0, file_size)
    _check_kind(header)
    _check_table(header)
    if file_size < header.record_len:
        raise RecordError("truncated", f"need {header.record_len} bytes, have {file_size}")
    f.seek(header.record_len - FOOTER_LEN)
    _, record_len, commit = FOOTER.unpack(f.read(FOOTER_LEN))
    if record_len != header.record_len:
        raise RecordError("bad_length", "footer length disagrees with header")
    if commit != COMMIT_MAGIC:
        raise RecordError("no_commit")
    return header


def read_partial(f: ReadableFile, names: set[str] | None, file_size: int) -> Record:
    """Read a whole-file record's header and only the tensors in `names` (None = all).

    Verifies the header CRC, the commit footer and the CRC of every tensor read. The whole-record
    CRC is checked when every tensor is read (then this equals `decode`)."""
    header = read_envelope(f, file_size)
    entries = header.meta["tensors"]
    if names is None or (entries and {e["name"] for e in entries} <= names):
        f.seek(0)
        buf = aligned_buffer(header.record_len)
        if f.readinto(buf) != header.record_len:
            raise RecordError("truncated")
        return decode(buf, 0)[0]
    tensors = {}
    for e in entries:
        if e["name"] not in names:
            continue
        buf = aligned_buffer(e["nbytes"])
        f.seek(header.payload_offset + e["offset"])
        if f.readinto(buf) != e["nbytes"]:
            raise RecordError("truncated")
        if masked_crc(buf) != e["crc"]:
            raise RecordError("tensor_crc", e["name"])
        tensors[e["name"]] = _tensor_from(buf, 0, {**e, "offset": 0})
    meta = {k: v for k, v in header.meta.items() if k != "tensors"}
    return Record(Kind(header.kind), meta, tensors)
