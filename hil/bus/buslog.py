"""The bus run log: `<data-dir>/bus-log.jsonl`, one JSON object per line (docs/bus.md §7).

Every bus run appends to it: its configuration, every power change with its cause, every
warning, every telecommand received / rejected / forwarded, every payload report, heartbeat
gaps and FDIR actions, each stamped with three clocks:

    wall_s   seconds since this run started (monotonic)
    trace_s  position in the trace file (trace seconds, unscaled)
    clock_s  the bus clock carried in telemetry: trace_s × time_scale

so that a replay tool (`ow hil replay LOG`) can drive the same cut timeline relative to command
arrival and compare the sequence of events. Writing: one `write()` per line, written at once
(a killed bus loses nothing already written); power changes and warnings are also fsynced.

The log is bounded: past `segment_bytes` the file is rotated (bus-log.jsonl -> .1 -> .2 ...,
the oldest beyond `segments` files removed). A line the disk refuses (full, read-only, failing)
is kept in memory, up to MEMORY_LINES, and written with the rest once the disk takes it again
(`retry()`); lines beyond that are counted and the count written as a `log_gap` line.

Reading: `read_log(path)` reads every kept segment in order, the oldest first; a torn last line is
ignored. `LogFollower` tails a growing, rotating log. `recorded_uplinks(entries)`: the tasks and
images the ground uplinked, decoded from the logged command packets.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common import durable
from common.wire import decode
from common.wire import messages as m

LOG_FILE = "bus-log.jsonl"
#: the payload's output (stdout and stderr, every boot appended), beside the bus log in the bus's data dir
PAYLOAD_LOG_FILE = "payload.log"
LOG_FORMAT = "orbitweaver-bus-log"
LOG_VERSION = 1

#: Entry kinds (docs/bus.md §7 lists each one's fields).
RUN_START = "run_start"
RUN_STOP = "run_stop"
POWER_ON = "power_on"
POWER_OFF = "power_off"
WARNING = "warning"
TRACE_END = "trace_end"
COMMAND_RECEIVED = "command_received"
COMMAND_REJECTED = "command_rejected"
COMMAND_FORWARDED = "command_forwarded"
COMMAND_CONFIRMED = "command_confirmed"
PAYLOAD_CONNECTED = "payload_connected"
PAYLOAD_REPORT = "payload_report"
PAYLOAD_EXITED = "payload_exited"
HEARTBEAT_GAP = "heartbeat_gap"
CLOCK_SKIP = "clock_skip"
SKIP_HELD = "skip_held"
FDIR_ACTION = "fdir_action"
SWITCH_ERROR = "power_switch_error"
LINK_REFUSED = "link_refused"
BUS_EVENT = "bus_event"
LINK_CLOSED = "link_closed"
REJECTIONS_SUPPRESSED = "rejections_suppressed"
LOG_GAP = "log_gap"
PAYLOAD_BOOT_FAILED = "payload_boot_failed"

KINDS = (
    RUN_START,
    RUN_STOP,
    POWER_ON,
    POWER_OFF,
    WARNING,
    TRACE_END,
    COMMAND_RECEIVED,
    COMMAND_REJECTED,
    COMMAND_FORWARDED,
    COMMAND_CONFIRMED,
    PAYLOAD_CONNECTED,
    PAYLOAD_REPORT,
    PAYLOAD_EXITED,
    HEARTBEAT_GAP,
    CLOCK_SKIP,
    SKIP_HELD,
    FDIR_ACTION,
    SWITCH_ERROR,
    LINK_REFUSED,
    BUS_EVENT,
    LINK_CLOSED,
    REJECTIONS_SUPPRESSED,
    LOG_GAP,
    PAYLOAD_BOOT_FAILED,
)
_SYNCED = {RUN_START, RUN_STOP, POWER_ON, POWER_OFF, WARNING, FDIR_ACTION, TRACE_END, BUS_EVENT}
#: Defaults of `ow bus run --log-segment-mb / --log-segments`: at most 8 files of 32 MiB.
DEFAULT_SEGMENT_BYTES = 32 << 20
DEFAULT_SEGMENTS = 8
#: Lines kept in memory while the disk refuses them (about 300 bytes each); later ones are counted.
MEMORY_LINES = 20_000
_COMMON = ("run", "n", "kind", "utc", "wall_s", "trace_s", "clock_s")


@dataclass(frozen=True)
class BusLogEntry:
    """One line of the run log. `data` holds the kind-specific fields."""

    run: str
    n: int
    kind: str
    utc: float
    wall_s: float
    trace_s: float | None
    clock_s: float | None
    data: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    @property
    def stamped_trace_s(self) -> float:
        """trace_s of an entry the bus stamps with its clock (power events, payload reports)."""
        if self.trace_s is None:
            raise ValueError(f"run-log entry {self.run}/{self.n} ({self.kind}) has no trace_s")
        return self.trace_s

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> BusLogEntry:
        return cls(
            run=str(obj["run"]),
            n=int(obj["n"]),
            kind=str(obj["kind"]),
            utc=float(obj["utc"]),
            wall_s=float(obj["wall_s"]),
            trace_s=None if obj.get("trace_s") is None else float(obj["trace_s"]),
            clock_s=None if obj.get("clock_s") is None else float(obj["clock_s"]),
            data={k: v for k, v in obj.items() if k not in _COMMON},
        )


class StorageListener(Protocol):
    """Told when the log's writes start failing and when they succeed again (hil.bus.storage)."""

    def failed(self, writer: str, exc: BaseException) -> None: ...

    def succeeded(self, writer: str) -> None: ...


def segment_path(path: str | os.PathLike, index: int) -> Path:
    """The log's segment `index`: 0 the current file, 1 the one before it, ..."""
    path = Path(path)
    return path if index == 0 else path.with_name(f"{path.name}.{index}")


_run_ids: set[str] = set()


def _new_run_id() -> str:
    """Start time and pid; a second run of this process in the same second gets a suffix
    (readers tell lines apart by run and number)."""
    base = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    run, k = base, 1
    while run in _run_ids:
        run, k = f"{base}.{k}", k + 1
    _run_ids.add(run)
    return run


class BusLog:
    """Appends entries of one bus run to the log file (see the module docstring)."""

    WRITER = "run log"

    def __init__(
        self,
        path: str | os.PathLike,
        run_id: str | None = None,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        segments: int = DEFAULT_SEGMENTS,
        listener: StorageListener | None = None,
    ):
        if segment_bytes < 1 or segments < 1:
            raise ValueError("a run log needs segment_bytes >= 1 and segments >= 1")
        self.path = Path(path)
        self.segment_bytes = segment_bytes
        self.segments = segments
        self.listener = listener
        self.run = run_id or _new_run_id()
        self._n = 0
        self._t0 = time.monotonic()
        self._fd: int | None = None
        self._size = 0
        #: lines the disk refused, oldest first, and how many more were dropped
        self._held: list[bytes] = []
        self._dropped = 0
        self.failing: OSError | None = None
        self.rotations = 0
        self._closed = False
        try:
            self._open()
        except OSError as exc:
            self._fail(exc)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if durable.storage_faults is not None:
            durable.storage_faults.before_write(str(self.path), 0)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        size = os.fstat(fd).st_size
        self._fd, self._size = fd, size
        # A line torn by a killed bus (or a refused write) must not swallow our next entry.
        if size > 0 and not self._ends_with_newline():
            self._write_bytes(b"\n")

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _write_bytes(self, data: bytes) -> None:
        """All of `data`, or none of it: a write the disk refuses half way (a full disk takes the
        first bytes of a line) is cut back to where it began, so no torn line sits between good
        ones. Only where even that is refused (read-only) does the newline written before the
        next line end it (and the reader skip it)."""
        assert self._fd is not None
        if durable.storage_faults is not None:
            durable.storage_faults.before_write(str(self.path), len(data))
        start = self._size
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                self._size += n
                view = view[n:]
        except OSError:
            if self._size != start:
                try:
                    os.ftruncate(self._fd, start)
                    self._size = start
                except OSError:
                    pass
            raise

    def _sync(self) -> None:
        assert self._fd is not None
        with durable.write_watch.timing():
            if durable.storage_faults is not None:
                durable.storage_faults.before_fsync(str(self.path))
            os.fsync(self._fd)

    def _fail(self, exc: OSError) -> None:
        first = self.failing is None
        self.failing = exc
        if first and self.listener is not None:
            self.listener.failed(self.WRITER, exc)

    def _hold(self, line: bytes) -> None:
        if len(self._held) < MEMORY_LINES:
            self._held.append(line)
        else:
            self._dropped += 1

    @property
    def started_monotonic(self) -> float:
        return self._t0

    @property
    def held_lines(self) -> int:
        """Lines waiting in memory for the disk."""
        return len(self._held)

    def restart_clock(self) -> float:
        """Make wall_s count from now (the moment the bus's trace clock starts)."""
        self._t0 = time.monotonic()
        return self._t0

    def write(
        self,
        kind: str,
        *,
        trace_s: float | None = None,
        clock_s: float | None = None,
        wall_s: float | None = None,
        **data: Any,
    ) -> dict:
        if kind not in KINDS:
            raise ValueError(f"unknown bus log entry kind {kind!r}")
        self._n += 1
        entry = {
            "run": self.run,
            "n": self._n,
            "kind": kind,
            "utc": round(time.time(), 6),
            "wall_s": round(time.monotonic() - self._t0 if wall_s is None else wall_s, 6),
            "trace_s": None if trace_s is None else round(trace_s, 6),
            "clock_s": None if clock_s is None else round(clock_s, 6),
        }
        for key, value in data.items():
            if key in _COMMON:
                raise ValueError(f"field {key!r} is reserved in the bus log")
            entry[key] = value
        line = (json.dumps(entry, separators=(",", ":"), default=str) + "\n").encode("utf-8")
        if self.failing is not None or self._fd is None:
            self._hold(line)  # written by retry() once the disk takes it
            return entry
        try:
            self._write_bytes(line)
            if kind in _SYNCED:
                self._sync()
        except OSError as exc:
            # A partly written line is ended by the newline written before the next one.
            self._hold(line)
            self._fail(exc)
            return entry
        self._rotate_if_full()
        return entry

    def retry(self) -> bool:
        """Write what the disk refused before (and reopen the file if need be). True when the
        log is writing again."""
        if self.failing is None:
            return True
        try:
            if self._fd is None:
                self._open()
            elif self._size > 0 and not self._ends_with_newline():
                self._write_bytes(b"\n")
            held = b"".join(self._held)
            if self._dropped:
                gap = {
                    "run": self.run,
                    "n": None,
                    "kind": LOG_GAP,
                    "utc": round(time.time(), 6),
                    "wall_s": round(time.monotonic() - self._t0, 6),
                    "trace_s": None,
                    "clock_s": None,
                    "dropped": self._dropped,
                }
                held += (json.dumps(gap, separators=(",", ":")) + "\n").encode("utf-8")
            if held:
                self._write_bytes(held)
            self._sync()
        except OSError as exc:
            self.failing = exc
            return False
        self._held, self._dropped, self.failing = [], 0, None
        if self.listener is not None:
            self.listener.succeeded(self.WRITER)
        self._rotate_if_full()
        return True

    def _rotate_if_full(self) -> None:
        if self._size < self.segment_bytes:
            return
        try:
            self._rotate()
        except OSError as exc:
            self._fail(exc)

    def _rotate(self) -> None:
        """bus-log.jsonl -> .1 -> .2 ...; the segment beyond the kept number is removed."""
        assert self._fd is not None
        self._sync()
        os.close(self._fd)
        self._fd = None
        if self.segments == 1:
            segment_path(self.path, 0).unlink(missing_ok=True)
        else:
            segment_path(self.path, self.segments - 1).unlink(missing_ok=True)
            for index in range(self.segments - 2, -1, -1):
                older = segment_path(self.path, index)
                if older.exists():
                    os.replace(older, segment_path(self.path, index + 1))
        for index in range(self.segments, self.segments + 64):  # left by a run that kept more
            if not segment_path(self.path, index).exists():
                break
            segment_path(self.path, index).unlink()
        self.rotations += 1
        self._open()
        durable.DurableFS().fsync_dir(str(self.path.parent))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.failing is not None:
            self.retry()
        if self._fd is not None:
            try:
                self._sync()
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


def _parse(path: Path, raw: bytes, entries: list[BusLogEntry], seen: dict, segment: int) -> None:
    lines = raw.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            # Only a line a killed writer (or a refused write) left unfinished is acceptable:
            # the last one, or the start of one of ours that the writer's next line followed
            # (BusLog ends the torn line before it writes again).
            next_line = lines[number] if number < len(lines) else b""
            if number == len(lines) or (line.startswith(b'{"run":') and next_line.startswith(b'{"run":')):
                continue
            raise ValueError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        if obj.get("kind") == LOG_GAP:
            continue
        try:
            entry = BusLogEntry.from_json(obj)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a JSON line, not a bus log entry
            raise ValueError(f"{path}:{number}: not a bus log entry ({type(exc).__name__}: {exc})") from None
        key = (entry.run, entry.n)
        if seen.setdefault(key, segment) != segment:
            continue  # a segment read twice across a rotation that happened while we read
        entries.append(entry)


def read_log(path: str | os.PathLike) -> list[BusLogEntry]:
    """Every complete entry of a run log, all runs and every kept segment, in order. A torn line
    (the bus was killed in mid-write) is skipped; any other malformed line raises ValueError.

    Segments are read newest first, so a rotation while reading can only make a segment appear
    twice (dropped by its entries' run and number), never make one be skipped."""
    path = Path(path)
    raws: list[tuple[Path, bytes]] = []
    index = 0
    while True:
        segment = segment_path(path, index)
        try:
            raw = segment.read_bytes()
        except FileNotFoundError:
            if index == 0:  # between a rotation's rename and the new file, or no log at all
                if not segment_path(path, 1).exists():
                    raise
                index += 1
                continue
            break
        raws.append((segment, raw))
        index += 1
    entries: list[BusLogEntry] = []
    seen: dict = {}
    for number, (segment, raw) in enumerate(reversed(raws)):
        _parse(segment, raw, entries, seen, number)
    return entries


class LogFollower:
    """Reads a run log as it grows, across rotations: `read()` returns the complete lines
    appended since the last call (from the rotated segment first, when the file was rotated
    in between)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._inode: int | None = None
        self._offset = 0

    def _read_from(self, path: Path, inode: int | None, offset: int) -> tuple[bytes, int] | None:
        try:
            with open(path, "rb") as f:
                if inode is not None and os.fstat(f.fileno()).st_ino != inode:
                    return None
                f.seek(offset)
                chunk = f.read()
        except OSError:
            return None
        complete = chunk[: chunk.rfind(b"\n") + 1]
        return complete, offset + len(complete)

    def read(self) -> bytes:
        try:
            inode = os.stat(self.path).st_ino
        except OSError:
            return b""
        out = b""
        if self._inode is not None and inode != self._inode:
            # Rotated: the rest of the file we were reading is now segment 1.
            rest = self._read_from(segment_path(self.path, 1), self._inode, self._offset)
            if rest is not None:
                out += rest[0]
            self._offset = 0
        self._inode = inode
        got = self._read_from(self.path, inode, self._offset)
        if got is not None:
            out += got[0]
            self._offset = got[1]
        return out


def recorded_uplinks(entries: Iterable[BusLogEntry]) -> tuple[dict[str, m.UplinkTask], dict[str, bytes]]:
    """What the ground uplinked, from the command packets the bus logged (`packet`, BusConfig's
    `log_packets`): each task by id (the first UPLINK_TASK received for it: a redelivery repeats
    it), and each image whose every chunk was received, re-assembled in index order. A packet
    that does not decode is skipped: it reached no task either."""

    tasks: dict[str, m.UplinkTask] = {}
    chunks: dict[str, dict[int, bytes]] = {}
    totals: dict[str, int] = {}
    for entry in entries:
        if entry.kind != COMMAND_RECEIVED or not entry.data.get("packet"):
            continue
        try:
            _, message = decode(base64.b64decode(entry.data["packet"]))
        except Exception:  # noqa: BLE001 - a recorded bad packet is part of the recording, not of a task
            continue
        if isinstance(message, m.ImageChunk):
            chunks.setdefault(message.image, {})[message.index] = bytes(message.data)
            totals[message.image] = message.total
        elif isinstance(message, m.UplinkTask):
            tasks.setdefault(message.task_id, message)
    images = {
        name: b"".join(data for _, data in sorted(parts.items()))
        for name, parts in chunks.items()
        if len(parts) == totals[name]
    }
    return tasks, images


def runs(entries: Iterable[BusLogEntry]) -> dict[str, list[BusLogEntry]]:
    """Entries grouped by bus run, runs in file order."""
    grouped: dict[str, list[BusLogEntry]] = {}
    for entry in entries:
        grouped.setdefault(entry.run, []).append(entry)
    return grouped


def power_timeline(entries: Iterable[BusLogEntry]) -> list[BusLogEntry]:
    """power_on / power_off / warning entries in order: the cut timeline a replay re-drives."""
    return [e for e in entries if e.kind in (POWER_ON, POWER_OFF, WARNING)]


def event_key(entry: BusLogEntry) -> tuple:
    """What identifies an entry independently of clocks and process ids, for comparing the
    sequence of events of a run with that of its replay."""
    d = entry.data
    if entry.kind in (POWER_ON, POWER_OFF):
        return (entry.kind, d.get("cause"))
    if entry.kind == WARNING:
        return (entry.kind, d.get("cause"), d.get("lead_trace_s"))
    if entry.kind in (COMMAND_RECEIVED, COMMAND_FORWARDED, COMMAND_CONFIRMED):
        return (entry.kind, d.get("type"), d.get("task_id"), _request_tuple(d.get("request")))
    if entry.kind == COMMAND_REJECTED:
        return (entry.kind, d.get("type"), d.get("code"), _request_tuple(d.get("request")))
    if entry.kind == PAYLOAD_REPORT:
        return (entry.kind, d.get("type"), d.get("task_id"), d.get("code"), _request_tuple(d.get("request")))
    return (entry.kind,)


def _request_tuple(request: Any) -> tuple | None:
    if not isinstance(request, Mapping):
        return None
    return (request.get("apid"), request.get("source"), request.get("seq"), request.get("type"))


def event_sequence(entries: Iterable[BusLogEntry], kinds: Iterable[str] | None = None) -> list[tuple]:
    """`event_key` of each entry (of the given kinds), in order."""
    wanted = set(kinds) if kinds is not None else None
    return [event_key(e) for e in entries if wanted is None or e.kind in wanted]
