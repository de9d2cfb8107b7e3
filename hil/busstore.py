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
a new file atomically.
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
#: Compact at run time once the file is this large and holds nothing live.
COMPACT_BYTES = 8 << 20

_log = log.get("hil.busstore")


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


def _describe(packet: bytes) -> tuple[RequestRef, str, str | None]:
    header, message = decode(packet)
    return header.request, message.TYPE.name, getattr(message, "task_id", None)


class CommandStore:
    """Durable FIFO of telecommands (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, fs: DurableFS | None = None):
        self.fs = fs or DurableFS()
        self.directory = Path(directory)
        self.fs.makedirs(str(self.directory))
        self.path = str(self.directory / STORE_FILE)
        self.live: dict[int, StoredCommand] = {}
        self._by_key: dict[tuple[int, int, int, int], int] = {}
        self.next_id = 1
        self.dropped_tail_bytes = 0
        self._pending: list[rec.Encoded] = []
        self._load()
        self._compact()

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
            self._apply(record.meta)
        if end < len(buf):
            self.dropped_tail_bytes = len(buf) - end
            _log.warning("bus_store_torn_tail", path=self.path, dropped_bytes=self.dropped_tail_bytes)
            self.fs.truncate(self.path, end)

    def _apply(self, meta: dict) -> None:
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

    def _remove(self, store_id: int) -> StoredCommand | None:
        entry = self.live.pop(store_id, None)
        if entry is not None and self._by_key.get(entry.key) == store_id:
            del self._by_key[entry.key]
        return entry

    def _compact(self) -> None:
        """Rewrite the file with only the live entries (atomic: write tmp, fsync, rename)."""
        if not self.fs.exists(self.path):
            return
        records = [rec.encode(BUS_COMMAND_KIND, {"op": "base", "next_id": self.next_id})]
        for entry in self.pending():
            records.append(rec.encode(BUS_COMMAND_KIND, self._enqueue_meta(entry, forwards=entry.forwards)))
        chunks = [chunk for encoded in records for chunk in encoded.chunks]
        self.fs.write_atomic(self.path, chunks)

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
        """Add a decoded-valid telecommand; durable after the next `flush()`."""
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
        self.next_id += 1
        self._add(entry)
        self._pending.append(rec.encode(BUS_COMMAND_KIND, self._enqueue_meta(entry)))
        return entry

    def mark_forwarded(self, entry: StoredCommand, link: int) -> None:
        entry.forwards += 1
        self._pending.append(rec.encode(BUS_COMMAND_KIND, {"op": "forwarded", "id": entry.store_id, "link": link}))

    def confirm(self, entry: StoredCommand, how: str) -> None:
        if self._remove(entry.store_id) is None:
            return
        self._pending.append(rec.encode(BUS_COMMAND_KIND, {"op": "confirmed", "id": entry.store_id, "how": how}))

    def flush(self) -> None:
        """Append everything recorded since the last flush in one write, then fsync."""
        if not self._pending:
            return
        chunks = [chunk for encoded in self._pending for chunk in encoded.chunks]
        self._pending = []
        self.fs.append(self.path, chunks)
        if not self.live and self.fs.size(self.path) > COMPACT_BYTES:
            self._compact()

    # ---- queries ---------------------------------------------------------------------------
    def pending(self) -> list[StoredCommand]:
        """Live entries in arrival order."""
        return [self.live[k] for k in sorted(self.live)]

    def find(self, key: tuple[int, int, int, int]) -> StoredCommand | None:
        store_id = self._by_key.get(key)
        return None if store_id is None else self.live.get(store_id)

    def __len__(self) -> int:
        return len(self.live)
