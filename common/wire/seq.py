"""Sequence numbers: per-APID counters for senders, a replay guard for receivers.

A sequence number is 30 bits: the 14-bit CCSDS sequence count (primary header) below a 16-bit
epoch (secondary header) that counts the wraps of the 14-bit field. Numbers are compared with
serial-number arithmetic (RFC 1982) modulo 2**30, so even the 30-bit space may wrap.

Both halves must survive restarts (docs/wire-protocol.md §6):
- the ground's counter, else a restarted ground tool reuses numbers the payload has seen and
  every command is rejected as a replay. `DurableSequenceCounter` reserves numbers in blocks,
  writing the block's end to disk before handing out the first number of the block;
- the payload's guard, else a power cut reopens the replay window. The flight process calls
  `ReplayGuard.save` (or stores `to_bytes()` itself) after accepting a command and before acting
  on it.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Iterable

from common.durable import DurableFS
from common.wire.errors import ReplayError
from common.wire.ids import SEQ_FORWARD_WINDOW, SEQ_MAX, SEQ_MODULUS, ResponseCode

_HALF = SEQ_MODULUS // 2


class SequenceStateError(ValueError):
    """Persisted counter or guard state is damaged or of an unknown format."""


def serial_distance(frm: int, to: int) -> int:
    """Signed distance from `frm` to `to` modulo 2**30, in (-2**29, 2**29]."""
    d = (to - frm) % SEQ_MODULUS
    return d - SEQ_MODULUS if d > _HALF else d


def _check_seq(seq: int) -> int:
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= SEQ_MAX:
        raise ValueError(f"sequence number {seq!r} outside 0..{SEQ_MAX}")
    return seq


def _check_apid(apid: int) -> int:
    if isinstance(apid, bool) or not isinstance(apid, int) or not 0 <= apid <= 0x7FF:
        raise ValueError(f"APID {apid!r} outside 0..0x7FF")
    return apid


# Persisted formats: magic, format version, entry count, entries, CRC-32 of everything before.
_COUNTER_MAGIC = b"OWSC"
_GUARD_MAGIC = b"OWRG"
_FORMAT_VERSION = 1
_PREAMBLE = struct.Struct(">4sBH")
_COUNTER_ENTRY = struct.Struct(">HI")  # apid, next sequence number
_GUARD_ENTRY = struct.Struct(">HHIQ")  # apid, source id, highest accepted, window bitmap
_CRC = struct.Struct(">I")


def _seal(magic: bytes, entries: list[bytes]) -> bytes:
    blob = _PREAMBLE.pack(magic, _FORMAT_VERSION, len(entries)) + b"".join(entries)
    return blob + _CRC.pack(zlib.crc32(blob))


def _unseal(magic: bytes, data: bytes | memoryview, entry: struct.Struct) -> Iterable[tuple]:
    data = bytes(data)
    if len(data) < _PREAMBLE.size + _CRC.size:
        raise SequenceStateError("state too short")
    if zlib.crc32(data[: -_CRC.size]) != _CRC.unpack(data[-_CRC.size :])[0]:
        raise SequenceStateError("state CRC mismatch")
    found_magic, version, count = _PREAMBLE.unpack_from(data)
    if found_magic != magic or version != _FORMAT_VERSION:
        raise SequenceStateError(f"not a {magic.decode()} v{_FORMAT_VERSION} state: {found_magic!r} v{version}")
    if len(data) != _PREAMBLE.size + count * entry.size + _CRC.size:
        raise SequenceStateError("state length disagrees with its entry count")
    return [entry.unpack_from(data, _PREAMBLE.size + i * entry.size) for i in range(count)]


class SequenceCounter:
    """Next sequence number per APID for one sender (in memory; see DurableSequenceCounter).
    Thread-safe: a process's threads may share one counter (the payload numbers its telemetry
    from its main and its worker thread)."""

    def __init__(self, next_seq: dict[int, int] | None = None):
        self._next: dict[int, int] = {}
        self._lock = threading.RLock()
        for apid, seq in (next_seq or {}).items():
            self._next[_check_apid(apid)] = _check_seq(seq)

    def peek(self, apid: int) -> int:
        """The number `next(apid)` will return."""
        return self._next.get(_check_apid(apid), 0)

    def next(self, apid: int) -> int:
        with self._lock:
            seq = self.peek(apid)
            self._next[apid] = (seq + 1) % SEQ_MODULUS
            return seq

    def advance_past(self, apid: int, seq: int) -> None:
        """Make the next number follow `seq` (resynchronisation after REPLAYED_SEQUENCE, using the
        REJECTED report's highest_seq). Never moves the counter backwards."""
        _check_seq(seq)
        with self._lock:
            if serial_distance(self.peek(apid), seq) >= 0:
                self._next[apid] = (seq + 1) % SEQ_MODULUS

    def rebase(self, apid: int, seq: int) -> None:
        """Make the next number follow `seq`, backwards too: after SEQUENCE_TOO_FAR_AHEAD the
        receiver's highest accepted number is the truth, and numbers above it were never
        accepted, so using them is safe."""
        _check_seq(seq)
        with self._lock:
            self._next[_check_apid(apid)] = (seq + 1) % SEQ_MODULUS

    def to_bytes(self) -> bytes:
        return _seal(_COUNTER_MAGIC, [_COUNTER_ENTRY.pack(a, s) for a, s in sorted(self._next.items())])

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> SequenceCounter:
        try:
            return cls({apid: seq for apid, seq in _unseal(_COUNTER_MAGIC, data, _COUNTER_ENTRY)})
        except ValueError as exc:
            raise SequenceStateError(str(exc)) from None


class DurableSequenceCounter(SequenceCounter):
    """A SequenceCounter backed by a file, safe against crashes at any instant.

    Numbers are reserved `reserve` at a time: before handing out the first number of a block the
    block's end is written (atomically, fsynced). After a crash the counter resumes at the end of
    the last reserved block, so no number is ever issued twice; the cost is a gap of at most
    `reserve` numbers, which receivers accept (forward jumps are always fresh)."""

    def __init__(self, path: str | os.PathLike, reserve: int = 64, fs: DurableFS | None = None):
        if reserve < 1:
            raise ValueError("reserve must be >= 1")
        self.path = os.fspath(path)
        self.reserve = reserve
        self._fs = fs or DurableFS()
        if self._fs.exists(self.path):
            persisted = SequenceCounter.from_bytes(self._fs.read(self.path))
            super().__init__(dict(persisted._next))
        else:
            super().__init__()
        # Everything below the persisted values may have been issued before a crash.
        self._reserved_until = dict(self._next)

    def next(self, apid: int) -> int:
        with self._lock:
            seq = self.peek(apid)
            limit = self._reserved_until.get(apid)
            if limit is None or serial_distance(seq, limit) <= 0:
                self._persist(apid, (seq + self.reserve) % SEQ_MODULUS)
            return super().next(apid)

    def rebase(self, apid: int, seq: int) -> None:
        with self._lock:
            super().rebase(apid, seq)
            # Numbers from here on are handed out again: the reservation on disk moves back too.
            self._persist(apid, (self.peek(apid) + self.reserve) % SEQ_MODULUS)

    def _persist(self, apid: int, reserved_until: int) -> None:
        state = {**self._reserved_until, apid: reserved_until}
        directory = os.path.dirname(os.path.abspath(self.path))
        self._fs.makedirs(directory)
        self._fs.write_atomic(self.path, [SequenceCounter(state).to_bytes()])
        self._reserved_until = state


class AheadSequenceCounter(SequenceCounter):
    """A telemetry sender's counter that never waits on the disk (the payload's: its heartbeats
    and answers must go out while its disk is full, read-only or stalled).

    Like DurableSequenceCounter it resumes after a crash at the end of the last block reserved on
    disk, so numbers are not issued twice -- but `next()` only counts in memory. The reservation
    is kept ahead by `reserve()`, which the owner calls off its sending path whenever
    `wants_reserve()` says that less than half a block is left. If numbers run past the
    reservation because the disk refused or stalled the write, they go on being issued (a sender
    must not fall silent); only a crash in that state can make a later boot repeat some of them,
    and `unreserved` counts the numbers issued so."""

    def __init__(self, path: str | os.PathLike, block: int = 1 << 16, fs: DurableFS | None = None):
        if block < 2:
            raise ValueError("block must be >= 2")
        self.path = os.fspath(path)
        self.block = block
        self._fs = fs or DurableFS()
        persisted: dict[int, int] = {}
        #: why numbering restarted from 0 (a damaged or unreadable file), or None
        self.reset_reason: str | None = None
        try:
            if self._fs.exists(self.path):
                persisted = dict(SequenceCounter.from_bytes(self._fs.read(self.path))._next)
        except (SequenceStateError, OSError) as exc:
            # Telemetry numbers order and count packets for the ground, which refuses none of
            # them as a replay: a sender that cannot read its counter starts again rather than
            # not at all.
            self.reset_reason = f"{type(exc).__name__}: {exc}"
        super().__init__(persisted)
        self._reserved_until = dict(persisted)
        self.unreserved = 0

    def next(self, apid: int) -> int:
        with self._lock:
            seq = super().next(apid)
            limit = self._reserved_until.get(apid)
            if limit is None or serial_distance(seq, limit) <= 0:
                self.unreserved += 1
            return seq

    def wants_reserve(self) -> bool:
        """Less than half a block reserved ahead of some APID's next number."""
        with self._lock:
            for apid, seq in self._next.items():
                limit = self._reserved_until.get(apid)
                if limit is None or serial_distance(seq, limit) < self.block // 2:
                    return True
            return False

    def reserve(self, apids: Iterable[int] = ()) -> None:
        """Write the next block's end for every APID in use (and `apids`): durable on return.
        Raises OSError when the disk refuses; numbers go on being issued all the same."""
        with self._lock:
            for apid in apids:
                self._next.setdefault(_check_apid(apid), 0)
            state = {apid: (seq + self.block) % SEQ_MODULUS for apid, seq in self._next.items()}
        directory = os.path.dirname(os.path.abspath(self.path))
        self._fs.makedirs(directory)
        self._fs.write_atomic(self.path, [SequenceCounter(state).to_bytes()])
        with self._lock:
            self._reserved_until.update(state)


class SequenceAheadError(ReplayError):
    """A telecommand's number is further ahead of the highest accepted one than the forward
    window: refused (SEQUENCE_TOO_FAR_AHEAD), so that no single jump can move the window far
    enough for old frames to look new. `highest` lets an honest sender rebase its counter."""

    def __init__(self, reason: str, *, highest: int):
        super().__init__(reason, highest=highest, code=ResponseCode.SEQUENCE_TOO_FAR_AHEAD)


class ReplayGuard:
    """Rejects telecommands whose sequence number was already accepted.

    State per (APID, source id): the highest accepted number and a bitmap of the WINDOW numbers
    below it (the anti-replay window of IPsec, RFC 4303 §3.4.3). A number at most
    `forward_window` ahead of the highest is fresh; one inside the window is fresh once; one
    behind the window is rejected, because the guard can no longer tell whether it was seen;
    one further ahead than the forward window is refused too (SEQUENCE_TOO_FAR_AHEAD). Without
    that bound a single jump of 2^29 - 1 would make every older number look ahead again
    (serial-number arithmetic), and a captured frame could be replayed. The first number from
    an unknown sender is accepted and starts its window.
    """

    WINDOW = 64

    def __init__(self, forward_window: int = SEQ_FORWARD_WINDOW) -> None:
        if not 1 <= forward_window < SEQ_MODULUS // 2:
            raise ValueError(f"forward window {forward_window} outside 1..2^29-1")
        self.forward_window = forward_window
        self._state: dict[tuple[int, int], tuple[int, int]] = {}

    def highest(self, apid: int, source_id: int) -> int | None:
        entry = self._state.get((apid, source_id))
        return None if entry is None else entry[0]

    def check(self, apid: int, source_id: int, seq: int) -> None:
        """Raise ReplayError (code REPLAYED_SEQUENCE) unless `seq` is fresh. Does not record it."""
        self._evaluate(apid, source_id, seq)

    def record(self, apid: int, source_id: int, seq: int) -> None:
        """Mark `seq` as accepted (raises ReplayError if it is not fresh)."""
        self._state[(apid, source_id)] = self._evaluate(apid, source_id, seq)

    def accept(self, apid: int, source_id: int, seq: int) -> None:
        """check + record in one step."""
        self.record(apid, source_id, seq)

    def _evaluate(self, apid: int, source_id: int, seq: int) -> tuple[int, int]:
        _check_seq(seq)
        entry = self._state.get((apid, source_id))
        if entry is None:
            return seq, 1
        highest, bitmap = entry
        ahead = serial_distance(highest, seq)
        if ahead > self.forward_window:
            raise SequenceAheadError(
                f"apid {apid:#05x} source {source_id}: seq {seq} is {ahead} ahead of {highest}, beyond the "
                f"forward window of {self.forward_window}",
                highest=highest,
            )
        if ahead > 0:
            shifted = (bitmap << ahead) & ((1 << self.WINDOW) - 1) if ahead < self.WINDOW else 0
            return seq, shifted | 1
        behind = -ahead
        if behind >= self.WINDOW:
            raise ReplayError(
                f"apid {apid:#05x} source {source_id}: seq {seq} is {behind} behind {highest}, "
                "outside the replay window",
                highest=highest,
            )
        if bitmap >> behind & 1:
            raise ReplayError(f"apid {apid:#05x} source {source_id}: seq {seq} already accepted", highest=highest)
        return highest, bitmap | 1 << behind

    def to_bytes(self) -> bytes:
        return _seal(
            _GUARD_MAGIC,
            [_GUARD_ENTRY.pack(a, s, h, b) for (a, s), (h, b) in sorted(self._state.items())],
        )

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> ReplayGuard:
        guard = cls()
        for apid, source_id, highest, bitmap in _unseal(_GUARD_MAGIC, data, _GUARD_ENTRY):
            if apid > 0x7FF or highest > SEQ_MAX or not bitmap & 1:
                raise SequenceStateError(f"invalid guard entry apid={apid} highest={highest}")
            guard._state[(apid, source_id)] = (highest, bitmap)
        return guard

    def save(self, path: str | os.PathLike, fs: DurableFS | None = None) -> None:
        """Write the state atomically and durably (write, fsync, rename, fsync directory)."""
        fs = fs or DurableFS()
        path = os.fspath(path)
        fs.makedirs(os.path.dirname(os.path.abspath(path)))
        fs.write_atomic(path, [self.to_bytes()])

    @classmethod
    def load(cls, path: str | os.PathLike, fs: DurableFS | None = None) -> ReplayGuard:
        """The saved guard, or an empty one if none was ever saved. Damaged state raises
        SequenceStateError: the caller decides (docs/wire-protocol.md §6.3)."""
        fs = fs or DurableFS()
        path = os.fspath(path)
        if not fs.exists(path):
            return cls()
        return cls.from_bytes(fs.read(path))
