"""The bus run log: `<data-dir>/bus-log.jsonl`, one JSON object per line (docs/bus.md §7).

Every bus run appends to it: its configuration, every power change with its cause, every
warning, every telecommand received / rejected / forwarded, every payload report, heartbeat
gaps and FDIR actions, each stamped with three clocks:

    wall_s   seconds since this run started (monotonic)
    trace_s  position in the trace file (trace seconds, unscaled)
    clock_s  the bus clock carried in telemetry: trace_s × time_scale

so that a replay tool (`ow hil replay LOG`) can drive the same cut timeline relative to command
arrival and compare the sequence of events. Writing: one `write()` per line, flushed at once
(a killed bus loses nothing already written); power changes and warnings are also fsynced.
Reading: `read_log(path)`; a torn last line is ignored. `recorded_uplinks(entries)`: the tasks
and images the ground uplinked, decoded from the logged command packets.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
FDIR_ACTION = "fdir_action"
SWITCH_ERROR = "power_switch_error"
LINK_REFUSED = "link_refused"

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
    FDIR_ACTION,
    SWITCH_ERROR,
    LINK_REFUSED,
)
_SYNCED = {RUN_START, RUN_STOP, POWER_ON, POWER_OFF, WARNING, FDIR_ACTION, TRACE_END}
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


class BusLog:
    """Appends entries of one bus run to the log file."""

    def __init__(self, path: str | os.PathLike, run_id: str | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run = run_id or time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
        self._n = 0
        self._t0 = time.monotonic()
        self._file = open(self.path, "a", encoding="utf-8")
        # A line torn by a killed bus must not swallow our first entry.
        if self._file.tell() > 0 and not self._ends_with_newline():
            self._file.write("\n")

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    @property
    def started_monotonic(self) -> float:
        return self._t0

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
        self._file.write(json.dumps(entry, separators=(",", ":"), default=str) + "\n")
        self._file.flush()
        if kind in _SYNCED:
            os.fsync(self._file.fileno())
        return entry

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def read_log(path: str | os.PathLike) -> list[BusLogEntry]:
    """Every complete entry of a run log, all runs, in file order. A torn line (the bus was
    killed in mid-write) is skipped; any other malformed line raises ValueError."""
    entries = []
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            # Only a line a killed writer left unfinished is acceptable: the last one, or one
            # that a later run started after (BusLog adds the missing newline).
            next_line = lines[number] if number < len(lines) else b""
            if number == len(lines) or (next_line.startswith(b"{") and b'"kind":"run_start"' in next_line):
                continue
            raise ValueError(f"{path}:{number}: not a JSON object") from None
        try:
            entries.append(BusLogEntry.from_json(obj))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a JSON line, not a bus log entry
            raise ValueError(f"{path}:{number}: not a bus log entry ({type(exc).__name__}: {exc})") from None
    return entries


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
