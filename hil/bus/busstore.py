"""The bus's store-and-forward queue: a durable FIFO of ground telecommands for the payload.

Every telecommand the bus accepts from the ground is appended here (and fsynced) before it is
forwarded, so neither a payload that is off nor a bus that restarts loses it. The file is an
append-only log of records in the OrbitWeaver record format (docs/record-format.md, kind
BUS_COMMAND = 32), one operation per record:

    {"op": "base",      "next_id": N}                          first record after a compaction
    {"op": "enqueue",   "id": N, "packet": bytes, "from": user, "received_utc": float}
    {"op": "forwarded", "id": N, "link": L}                    handed to payload connection L
    {"op": "confirmed", "id": N, "how": "accepted" | ...}      the payload has it; never resend

An entry is *live* from `enqueue` until `confirmed`. The bus forwards live entries in id order
and sends an entry again on a new payload connection until it is confirmed: delivery over the
bus→payload hop is at least once, and the payload's durable replay guard makes execution exactly
once (docs/bus.md §5). `forwarded` marks tell a restarted bus which entries may already have
reached the payload (a resend of those is a redelivery).

A torn tail (the bus killed mid-append) is truncated away when the store is opened, as for
every append-only record file. Opening also compacts: confirmed entries are dropped by writing
a new file atomically; so does a running bus once the file has grown past COMPACT_BYTES and
twice what its live entries take, so the file stays bounded by the live entries, which the bus
bounds in turn (docs/bus.md §5 "Bounds").

The disk may refuse a write (full, read-only, failing: docs/bus.md "The bus's own disk"). An
`enqueue` is durable when it returns, or raises `StoreUnavailable` and leaves nothing behind:
the bus then refuses the command (BUS_STORAGE_FULL), so nothing it acknowledged is ever lost.
`forwarded` and `confirmed` marks that cannot be written stay in memory (`flush` raises and
keeps them) and go out with the next write that succeeds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common import log
from common import record as rec
from common.durable import DurableFS
from common.wire import AckFlags, WireError, decode, decode_header
from common.wire.errors import RequestRef

#: Record kind of the store's entries (docs/bus.md §5; kinds below 32 belong to the flight side).
BUS_COMMAND_KIND = rec.Kind.BUS_COMMAND  # an IntEnum: equal to the int a record carries
STORE_FILE = "commands.log"
#: Compact at run time once the file is this large and more than COMPACT_RATIO times what its
#: live entries take (the bus's caps bound those, so they bound the file too).
COMPACT_BYTES = 8 << 20
COMPACT_RATIO = 2

_log = log.get("hil.bus.busstore")


def request_key(request: RequestRef) -> tuple[int, int, int, int]:
    return (request.apid, request.source_id, request.seq, request.message_type)


@dataclass
class StoredCommand:
    """One telecommand waiting for the payload."""

    store_id: int
    packet: bytes
    sender: str
    received_utc: float
    request: RequestRef
    type_name: str
    task_id: str | None
    #: how many times it was handed to a payload connection (durable)
    forwards: int = 0
    #: bytes its enqueue record takes in the file
    record_bytes: int = 0
    # --- run-time state, not persisted -----------------------------------------------------
    #: the payload connection it was last sent on in this bus run, and when (monotonic)
    sent_link: int | None = None
    sent_at: float | None = None

    @property
    def key(self) -> tuple[int, int, int, int]:
        return request_key(self.request)

    @property
    def wants_acceptance(self) -> bool:
        return decode_header(self.packet).wants(AckFlags.ACCEPTANCE)


class StoreUnavailable(Exception):
    """The store could not make a command durable: `error` is what the disk said."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _describe(packet: bytes) -> tuple[RequestRef, str, str | None]:
    header, message = decode(packet)
    return header.request, message.TYPE.name, getattr(message, "task_id", None)


class CommandStore:
    """Durable FIFO of telecommands (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, fs: DurableFS | None = None):
        self.fs = fs or DurableFS()
        self.directory = Path(directory)
        self.path = str(self.directory / STORE_FILE)
        self.live: dict[int, StoredCommand] = {}
        self._by_key: dict[tuple[int, int, int, int], int] = {}
        self._by_sender: dict[str, int] = {}
        self.live_bytes = 0
        self._live_record_bytes = 0
        self.next_id = 1
        self.dropped_tail_bytes = 0
        self._pending: list[rec.Encoded] = []
        #: a torn tail the disk would not let us cut off: cut before the next append
        self._torn_end: int | None = None
        #: the file could not be read: never rewrite it (a compaction would drop what we missed)
        self._unreadable = False
        self._compact_failed_at = 0
        #: the store's last storage error, if its directory or file could not be opened
        self.open_error: OSError | None = None
        try:
            self.fs.makedirs(str(self.directory))
            self._load()
        except OSError as exc:
            self.open_error = exc
            self._unreadable = self.fs.exists(self.path)
            _log.error("bus_store_unreadable", path=self.path, error=str(exc))
        self._compact_quietly()

    # ---- reading ---------------------------------------------------------------------------
    def _load(self) -> None:
        if not self.fs.exists(self.path):
            return
        buf = self.fs.read(self.path)
        end = 0
        for record, offset, length in rec.iter_records(buf):
            end = offset + length
            if record.kind != BUS_COMMAND_KIND:
                continue
            self._apply(record.meta, length)
        if end < len(buf):
            self.dropped_tail_bytes = len(buf) - end
            _log.warning("bus_store_torn_tail", path=self.path, dropped_bytes=self.dropped_tail_bytes)
            self._torn_end = end
            self._cut_torn_tail()

    def _cut_torn_tail(self) -> None:
        if self._torn_end is not None:
            self.fs.truncate(self.path, self._torn_end)
            self._torn_end = None

    def _apply(self, meta: dict, length: int = 0) -> None:
        op = meta.get("op")
        store_id = int(meta.get("id", 0))
        if op == "base":
            self.next_id = max(self.next_id, int(meta["next_id"]))
        elif op == "enqueue":
            packet = bytes(meta["packet"])
            try:
                request, type_name, task_id = _describe(packet)
            except WireError:  # cannot happen for what we wrote; never let it block the queue
                _log.error("bus_store_entry_undecodable", id=store_id)
                return
            self._add(
                StoredCommand(
                    store_id=store_id,
                    packet=packet,
                    sender=str(meta.get("from", "")),
                    received_utc=float(meta.get("received_utc", 0.0)),
                    request=request,
                    type_name=type_name,
                    task_id=task_id,
                    forwards=int(meta.get("forwards", 0)),
                    record_bytes=length,
                )
            )
            self.next_id = max(self.next_id, store_id + 1)
        elif op == "forwarded":
            entry = self.live.get(store_id)
            if entry is not None:
                entry.forwards += 1
        elif op == "confirmed":
            self._remove(store_id)

    def _add(self, entry: StoredCommand) -> None:
        self.live[entry.store_id] = entry
        # A second live entry with the same request id is refused by the bus before it gets
        # here; after a restart the older one keeps the key.
        self._by_key.setdefault(entry.key, entry.store_id)
        self._by_sender[entry.sender] = self._by_sender.get(entry.sender, 0) + 1
        self.live_bytes += len(entry.packet)
        self._live_record_bytes += entry.record_bytes

    def _remove(self, store_id: int) -> StoredCommand | None:
        entry = self.live.pop(store_id, None)
        if entry is None:
            return None
        if self._by_key.get(entry.key) == store_id:
            del self._by_key[entry.key]
        left = self._by_sender.get(entry.sender, 0) - 1
        if left > 0:
            self._by_sender[entry.sender] = left
        else:
            self._by_sender.pop(entry.sender, None)
        self.live_bytes -= len(entry.packet)
        self._live_record_bytes -= entry.record_bytes
        return entry

    def _compact(self) -> None:
        """Rewrite the file with only the live entries (atomic: write tmp, fsync, rename)."""
        if self._unreadable or not self.fs.exists(self.path):
            return
        self._cut_torn_tail()
        records = [rec.encode(BUS_COMMAND_KIND, {"op": "base", "next_id": self.next_id})]
        for entry in self.pending():
            records.append(rec.encode(BUS_COMMAND_KIND, self._enqueue_meta(entry, forwards=entry.forwards)))
        chunks = [chunk for encoded in records for chunk in encoded.chunks]
        self.fs.write_atomic(self.path, chunks)
        # What was pending is in the new file (forwards counted, confirmed entries gone).
        self._pending = []

    def _compact_quietly(self) -> None:
        """Compact; a disk that refuses (no room for the new file) leaves the old one as it is."""
        try:
            self._compact()
        except OSError as exc:
            self._compact_failed_at = self._size()
            _log.warning("bus_store_compaction_failed", path=self.path, error=str(exc))

    def _size(self) -> int:
        try:
            return self.fs.size(self.path)
        except OSError:
            return 0

    # ---- writing ---------------------------------------------------------------------------
    @staticmethod
    def _enqueue_meta(entry: StoredCommand, forwards: int = 0) -> dict:
        meta = {
            "op": "enqueue",
            "id": entry.store_id,
            "packet": entry.packet,
            "from": entry.sender,
            "received_utc": entry.received_utc,
        }
        if forwards:
            meta["forwards"] = forwards
        return meta

    def enqueue(self, packet: bytes, sender: str, received_utc: float) -> StoredCommand:
        """Add a decoded-valid telecommand, durably: appended (with any marks still waiting)
        and fsynced before it returns. Raises StoreUnavailable, leaving nothing of it behind,
        when the disk refuses."""
        request, type_name, task_id = _describe(packet)
        entry = StoredCommand(
            store_id=self.next_id,
            packet=bytes(packet),
            sender=sender,
            received_utc=received_utc,
            request=request,
            type_name=type_name,
            task_id=task_id,
        )
        encoded = rec.encode(BUS_COMMAND_KIND, self._enqueue_meta(entry))
        entry.record_bytes = sum(memoryview(c).nbytes for c in encoded.chunks)
        try:
            self._write([*self._pending, encoded])
        except OSError as exc:
            raise StoreUnavailable(exc) from None
        self._pending = []
        self.next_id += 1
        self._add(entry)
        self._maybe_compact()
        return entry

    def mark_forwarded(self, entry: StoredCommand, link: int) -> None:
        entry.forwards += 1
        self._pending.append(rec.encode(BUS_COMMAND_KIND, {"op": "forwarded", "id": entry.store_id, "link": link}))

    def confirm(self, entry: StoredCommand, how: str) -> None:
        if self._remove(entry.store_id) is None:
            return
        self._pending.append(rec.encode(BUS_COMMAND_KIND, {"op": "confirmed", "id": entry.store_id, "how": how}))

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Append every mark recorded since the last write in one write, then fsync. Raises the
        disk's OSError and keeps the marks for the next try when it refuses."""
        if not self._pending:
            return
        self._write(self._pending)
        self._pending = []
        self._maybe_compact()

    def probe(self) -> None:
        """Append one harmless record (the next id): whether the disk takes the store's writes
        again, when no command or mark is waiting to find out. Raises the disk's OSError."""
        self._write([rec.encode(BUS_COMMAND_KIND, {"op": "base", "next_id": self.next_id})])

    def _write(self, records: list[rec.Encoded]) -> None:
        if not os.path.isdir(self.directory):  # a disk that was read-only when the bus started
            self.fs.makedirs(str(self.directory))
        self._cut_torn_tail()
        chunks = [chunk for encoded in records for chunk in encoded.chunks]
        self.fs.append(self.path, chunks)  # a failed append is truncated back: nothing half-written

    def _maybe_compact(self) -> None:
        size = self._size()
        if size > max(COMPACT_BYTES, COMPACT_RATIO * self._live_record_bytes) and (
            size > self._compact_failed_at + COMPACT_BYTES
        ):
            self._compact_quietly()

    # ---- queries ---------------------------------------------------------------------------
    def pending(self) -> list[StoredCommand]:
        """Live entries in arrival order."""
        return [self.live[k] for k in sorted(self.live)]

    def find(self, key: tuple[int, int, int, int]) -> StoredCommand | None:
        store_id = self._by_key.get(key)
        return None if store_id is None else self.live.get(store_id)

    def count_for(self, sender: str) -> int:
        """Live entries from this station (key name)."""
        return self._by_sender.get(sender, 0)

    def __len__(self) -> int:
        return len(self.live)
