"""What this payload measured of its own work, for the ground's completion forecast
(docs/ground.md "Completion forecast", docs/wire-protocol.md PAYLOAD_PROFILE and WINDOW_HISTORY).

    state/profile.json        seconds per PROGRESS unit by phase, the last task's units per
                              phase, the power-up overheads measured (the most recent 32)
    state/window-starts.log   when each power window started (Unix seconds, payload clock):
                              12-byte entries, a little-endian double and its CRC32C

Both are advice: a damaged or missing file reads as empty and is never a reason not to boot; the
window lengths themselves are the window log's (flight/checkpoint/cadence.py, WindowLog).
"""

from __future__ import annotations

import json
import statistics
import struct
import threading

import crc32c

from common.durable import DurableFS

_START = struct.Struct("<dI")
#: Window starts sent (and overheads kept): as many as the window log keeps lengths.
KEEP_STARTS = 256
KEEP_OVERHEADS = 32
#: Weight of a new measurement in a phase's seconds per unit (a moving average that follows a
#: hotter or throttled payload within a few dozen units).
SMOOTHING = 0.1


def read_starts(path: str) -> list[float]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    out = []
    for i in range(0, len(data) - _START.size + 1, _START.size):
        value, crc = _START.unpack_from(data, i)
        if crc32c.crc32c(data[i : i + 8]) == crc:
            out.append(value)
    return out[-KEEP_STARTS:]


def append_start(fs: DurableFS, path: str, start: float) -> list[float]:
    """Log this window's start (the whole file rewritten: at most KEEP_STARTS entries of 12
    bytes, once per boot); returns the starts, oldest first."""
    starts = read_starts(path)
    if starts and start < starts[-1]:
        starts = []  # the clock went back: earlier starts no longer line up with this one
    starts = (starts + [start])[-KEEP_STARTS:]
    blob = b"".join(_START.pack(s, crc32c.crc32c(struct.pack("<d", s))) for s in starts)
    fs.write_atomic(path, [blob])
    return starts


class WorkProfile:
    """Seconds per unit of each phase, measured between consecutive units of one phase in one
    process (the first unit of a session also holds its restore, so it is not one), and the
    overhead from the process start to the first unit of work."""

    def __init__(self, path: str):
        self.path = path
        self.lock = threading.Lock()
        self.unit_s: dict[str, float] = {}
        self.task_units: dict[str, int] = {}
        self.decode_tokens = 0
        self.overheads: list[float] = []
        self.setup: list[float] = []
        self._last: tuple[str, int, float] | None = None  # phase, done, time of the last unit
        self._first_unit_seen = False
        self._task_t0: float | None = None
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            self.unit_s = {str(k): float(v) for k, v in data.get("unit_s", {}).items()}
            self.task_units = {str(k): int(v) for k, v in data.get("task_units", {}).items()}
            self.decode_tokens = int(data.get("decode_tokens", 0))
            self.overheads = [float(x) for x in data.get("overheads", [])][-KEEP_OVERHEADS:]
            self.setup = [float(x) for x in data.get("setup", [])][-KEEP_OVERHEADS:]
        except (OSError, ValueError, TypeError, AttributeError):
            pass  # advice only: measured again

    def unit(self, phase: str, done: int, total: int, now: float, uptime: float) -> None:
        with self.lock:
            since = None  # a phase's first units: from the task's start or the last phase's last unit
            if self._task_t0 is not None:
                self.setup = (self.setup + [now - self._task_t0])[-KEEP_OVERHEADS:]
                since = self._task_t0
                self._task_t0 = None
            elif self._last is not None and self._last[0] != phase:
                since = self._last[2]
            if since is not None and phase not in self.unit_s and done > 0:
                # a first estimate (it holds a setup or a restore), until two units of the phase
                # follow each other: a phase of one unit would otherwise never be measured
                self.unit_s[phase] = (now - since) / done
            if not self._first_unit_seen:
                self._first_unit_seen = True
                self.overheads = (self.overheads + [uptime])[-KEEP_OVERHEADS:]
            last = self._last
            if last is not None and last[0] == phase and done > last[1]:
                per = (now - last[2]) / (done - last[1])
                old = self.unit_s.get(phase)
                self.unit_s[phase] = per if old is None else (1 - SMOOTHING) * old + SMOOTHING * per
            self._last = (phase, done, now)
            self.task_units[phase] = total

    def task_started(self, now: float) -> None:
        with self.lock:
            self._last = None
            self._task_t0 = now

    def task_ended(self, max_new_tokens: int) -> None:
        with self.lock:
            self.decode_tokens = max_new_tokens
            self._last = None

    def fields(self) -> dict:
        with self.lock:
            return {
                "unit_s": dict(self.unit_s),
                "task_units": dict(self.task_units),
                "decode_tokens": self.decode_tokens,
                "overhead_s": statistics.median(self.overheads) if self.overheads else 0.0,
                "setup_s": statistics.median(self.setup) if self.setup else 0.0,
            }

    def save(self, fs: DurableFS) -> None:
        with self.lock:
            blob = json.dumps(
                {
                    "unit_s": self.unit_s,
                    "task_units": self.task_units,
                    "decode_tokens": self.decode_tokens,
                    "overheads": self.overheads,
                    "setup": self.setup,
                },
                sort_keys=True,
            ).encode()
        fs.write_atomic(self.path, [blob])
