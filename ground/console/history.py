"""What the console remembers of the telemetry link: bounded, and decimated on the way out.

Events (every packet but the routine telemetry samples) sit in a ring of `max_events`; the
numbers of POWER, THERMAL and HOUSEKEEPING reports go into per-series rings of `max_samples`;
cuts, boots and power windows are derived as packets arrive. A view asks for a time range and a
number of buckets and gets at most that many (min, max) pairs per series, so a 72-hour deployment
costs the page the same as a minute of it, and the server's memory stays bounded whatever runs.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

from common.durable import DurableFS

#: the telemetry series the console plots: (packet type, body field) -> series name
SERIES: dict[tuple[str, str], str] = {
    ("POWER", "battery_soc"): "battery_soc",
    ("POWER", "bus_voltage_v"): "bus_voltage_v",
    ("POWER", "payload_power_w"): "payload_power_w",
    ("THERMAL", "payload_temp_c"): "payload_temp_c",
    ("THERMAL", "bus_temp_c"): "bus_temp_c",
    ("HOUSEKEEPING", "checkpoint_bytes"): "storage_used_bytes",
    ("HOUSEKEEPING", "disk_free_bytes"): "disk_free_bytes",
    ("HOUSEKEEPING", "queue_depth"): "queue_depth",
    ("HOUSEKEEPING", "progress_done"): "progress_done",
    ("HOUSEKEEPING", "memory_rss_bytes"): "payload_memory_bytes",
}
#: derived, not a field: the bytes the payload wrote to its data storage over every boot the
#: console has seen (HOUSEKEEPING `written_bytes` counts from each boot: History._written)
WRITTEN_SERIES = "storage_written_bytes"
#: every series the console plots and exports
SERIES_NAMES: tuple[str, ...] = (*dict.fromkeys(SERIES.values()), WRITTEN_SERIES)
#: the phases (TaskPhase values) in which the payload is working on a task: what a cut interrupts
RUNNING_PHASES = {"recovering", "vision", "prefill", "decode"}
#: tasks whose latest progress the console keeps (the task view shows each one's)
PROGRESS_TASKS = 1000
#: reports that are samples of the series, not events an operator reads one by one
SAMPLE_TYPES = {"POWER", "THERMAL", "HEARTBEAT"}


class WrittenStore:
    """The lifetime total of storage written, kept across console restarts in the station's
    state (`<state>/console-written.json`, docs/ground.md "Lifetime storage written"):
    `{"format": 1, "boot", "before_bytes", "boot_bytes", "t"}`, rewritten atomically."""

    FORMAT = 1

    def __init__(self, path: str | os.PathLike, fs: DurableFS | None = None):
        self.path = Path(path)
        self.fs = fs or DurableFS()

    def load(self) -> tuple[dict | None, str | None]:
        """(the saved total or None, a note for the operator when the file was damaged)."""
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError) as exc:
            return None, self._set_aside(f"unreadable ({type(exc).__name__})")
        fields = ("boot", "before_bytes", "boot_bytes")
        if (
            not isinstance(data, dict)
            or data.get("format") != self.FORMAT
            or not all(isinstance(data.get(k), int) and not isinstance(data.get(k), bool) for k in fields)
            or min(data[k] for k in fields) < 0
            or not isinstance(data.get("t"), int | float)
            or not math.isfinite(data["t"])
        ):
            return None, self._set_aside("not a storage-written record")
        return data, None

    def _set_aside(self, why: str) -> str:
        damaged = self.path.with_name(self.path.name + ".damaged")
        try:
            os.replace(self.path, damaged)
        except OSError as exc:
            return f"{self.path} {why}, and could not be set aside ({exc.strerror}); storage written starts from zero"
        return f"{self.path} {why}: set aside as {damaged.name}; storage written starts from zero"

    def save(self, boot: int, before: int, now: int, t: float) -> None:
        record = {"format": self.FORMAT, "boot": boot, "before_bytes": before, "boot_bytes": now, "t": t}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fs.write_atomic(str(self.path), [json.dumps(record, sort_keys=True).encode()])


class Series:
    def __init__(self, capacity: int):
        self.t: deque[float] = deque(maxlen=capacity)
        self.v: deque[float] = deque(maxlen=capacity)

    def add(self, t: float, v: float) -> None:
        if self.t and t < self.t[-1]:
            t = self.t[-1]  # keep time sorted: packets may arrive a little out of order
        self.t.append(t)
        self.v.append(v)

    def window(self, t0: float, t1: float) -> tuple[list[float], list[float]]:
        ts = list(self.t)
        lo, hi = bisect.bisect_left(ts, t0), bisect.bisect_right(ts, t1)
        vs = list(self.v)
        return ts[lo:hi], vs[lo:hi]


def decimate(ts: list[float], vs: list[float], t0: float, t1: float, buckets: int) -> list[list[float]]:
    """At most 2 points per bucket: the min and the max, each at its own time, in time order, so
    peaks and dips survive (a mean would hide the dip to zero that a cut is)."""
    if len(ts) <= 2 * buckets or t1 <= t0:
        return [[t, v] for t, v in zip(ts, vs, strict=True)]
    width = (t1 - t0) / buckets
    out: list[list[float]] = []
    current, lo_i, hi_i = -1, -1, -1
    for i, t in enumerate(ts):
        b = min(int((t - t0) / width), buckets - 1)
        if b != current:
            if current >= 0:
                out.extend([[ts[j], vs[j]] for j in sorted({lo_i, hi_i})])
            current, lo_i, hi_i = b, i, i
        else:
            if vs[i] < vs[lo_i]:
                lo_i = i
            if vs[i] > vs[hi_i]:
                hi_i = i
    if current >= 0:
        out.extend([[ts[j], vs[j]] for j in sorted({lo_i, hi_i})])
    return out


class History:
    def __init__(self, max_events: int = 100_000, max_samples: int = 200_000):
        self.lock = threading.Lock()
        self.events: deque[dict] = deque(maxlen=max_events)
        self.series = {name: Series(max_samples) for name in SERIES_NAMES}
        self.cuts: deque[dict] = deque(maxlen=max_events)
        self.boots: deque[float] = deque(maxlen=max_events)
        self.windows: deque[list[Any]] = deque(maxlen=max_events)  # [on, off or None while on]
        self.number = 0
        self._warning: dict | None = None
        self._doing: dict = {}
        #: each task's latest progress (phase, done, total, t), from its PROGRESS reports and the
        #: payload's HOUSEKEEPING; the most recent PROGRESS_TASKS tasks
        self.progress: dict[str, dict] = {}
        self.latest: dict[str, Any] = {}
        # storage written: the boots before the present one, the present boot's number and the
        # most it has reported (the count restarts at each boot; a late packet of an earlier
        # boot is not counted twice)
        self._written_before = 0
        self._written_boot = -1
        self._written_now = 0
        #: the present boot is known only from the saved total, not yet from a report: a lower
        #: boot count then means the payload's count restarted, not a late packet
        self._written_from_file = False
        self._written_store: WrittenStore | None = None
        self._written_changed: tuple[int, int, int, float] | None = None
        #: what the operator should know (a damaged or unwritable total): taken by the console
        self.notes: list[str] = []

    def add(self, record: dict) -> dict | None:
        """Take one packet record (ground.report.packet_record); returns what to push to pages
        (None for samples, which the pages fetch decimated)."""
        with self.lock:
            pushed = self._add(record)
            changed, self._written_changed = self._written_changed, None
        if changed is not None and self._written_store is not None:
            try:
                self._written_store.save(*changed)
            except OSError as exc:
                self.notes.append(f"storage written not saved to {self._written_store.path}: {exc.strerror or exc}")
        return pushed

    def restore_written(self, store: WrittenStore) -> None:
        """Go on from the lifetime total a console of this station saved (docs/ground.md
        "Lifetime storage written"), and save it there as it grows. The total is plotted from
        where it was (one sample at its time)."""
        saved, note = store.load()
        with self.lock:
            self._written_store = store
            if note:
                self.notes.append(note)
            if saved is None or self._written_boot >= 0:
                return  # nothing saved, or this history already counts (it was filled before)
            self._written_boot, self._written_before = saved["boot"], saved["before_bytes"]
            self._written_now, self._written_from_file = saved["boot_bytes"], True
            self.series[WRITTEN_SERIES].add(float(saved["t"]), float(self._written_before + self._written_now))

    def _add(self, record: dict) -> dict | None:
        t = float(record["t"])
        kind, body = record["type"], record.get("body") or {}
        for (ptype, field), name in SERIES.items():
            if ptype == kind and isinstance(body.get(field), int | float):
                self.series[name].add(t, float(body[field]))
        self.latest[kind] = {"t": t, "body": body}
        if kind == "HOUSEKEEPING":
            task = body.get("current_task")
            self._doing = {"task": task, "phase": body.get("phase")} if body.get("phase") in RUNNING_PHASES else {}
            if isinstance(task, str) and isinstance(body.get("progress_total"), int):
                self._progressed(task, t, body.get("phase"), body.get("progress_done"), body.get("progress_total"))
            self._written(t, body)
        elif kind == "PROGRESS" and isinstance(body.get("task_id"), str):
            # more often than HOUSEKEEPING: what a cut interrupts is known to the unit
            self._progressed(body["task_id"], t, body.get("phase"), body.get("done"), body.get("total"))
        elif kind == "SHUTDOWN_WARNING":
            self._warning = {"t": t, "cause": body.get("cause"), "lead_s": body.get("lead_time_s")}
        elif kind == "POWER_STATE":
            if body.get("payload_on"):
                self.windows.append([t, None])
            else:
                if self.windows and self.windows[-1][1] is None:
                    self.windows[-1][1] = t
                warning = self._warning
                lead = round(t - warning["t"], 3) if warning else None
                self.cuts.append(
                    {
                        "t": t,
                        "cause": body.get("cause"),
                        "after_fault": body.get("after_fault"),
                        "warning_lead_s": lead,
                        "warned_lead_s": warning["lead_s"] if warning else None,
                        "task": self._doing.get("task"),
                        "phase": self._doing.get("phase"),
                        "done": self._doing.get("done"),
                        "total": self._doing.get("total"),
                    }
                )
                self._warning = None
        elif kind == "EVENT" and body.get("event_id") == "BOOT":
            self.boots.append(t)
        if kind in SAMPLE_TYPES:
            return None
        self.number += 1
        record = dict(record, n=self.number)
        self.events.append(record)
        return record

    def _progressed(self, task: str, t: float, phase: Any, done: Any, total: Any) -> None:
        entry = {"phase": phase, "done": done, "total": total, "t": t}
        self.progress.pop(task, None)  # newest last: the oldest go first past the bound
        self.progress[task] = entry
        while len(self.progress) > PROGRESS_TASKS:
            del self.progress[next(iter(self.progress))]
        running = phase in RUNNING_PHASES  # a finished task's last report leaves the payload idle
        self._doing = {"task": task, "phase": phase, "done": done, "total": total} if running else {}

    def _written(self, t: float, body: dict) -> None:
        """The lifetime figure that flash wear depends on, from a count that restarts at each
        boot (wire-protocol.md §3.3 `written_bytes`): per boot its largest count, summed. A
        lower bound (what a boot wrote after its last report is not in it), over the boots this
        console saw."""
        written, boot = body.get("written_bytes"), body.get("boot_count")
        if not isinstance(written, int) or not isinstance(boot, int) or written < 0:
            return  # an older payload's report
        if boot < self._written_boot and not self._written_from_file:
            return  # a late report from a boot already summed
        before = (self._written_boot, self._written_before, self._written_now)
        if boot != self._written_boot:  # a new boot, or (below the saved one) a payload whose count restarted
            self._written_before += self._written_now
            self._written_boot, self._written_now = boot, 0
        self._written_from_file = False
        self._written_now = max(self._written_now, written)
        self.series[WRITTEN_SERIES].add(t, float(self._written_before + self._written_now))
        if (self._written_boot, self._written_before, self._written_now) != before:
            self._written_changed = (self._written_boot, self._written_before, self._written_now, t)

    def events_page(self, after: int = 0, limit: int = 500, kinds: set[str] | None = None) -> list[dict]:
        """Events numbered above `after`, oldest first, at most `limit` (the page pages back)."""
        with self.lock:
            found = []
            for record in reversed(self.events):
                if record["n"] <= after:
                    break
                if kinds and record["type"] not in kinds:
                    continue
                found.append(record)
                if len(found) >= limit:
                    break
            return found[::-1]

    def span(self) -> tuple[float, float]:
        with self.lock:
            starts = [s.t[0] for s in self.series.values() if s.t]
            ends = [s.t[-1] for s in self.series.values() if s.t]
            if self.events:
                starts.append(self.events[0]["t"])
                ends.append(self.events[-1]["t"])
            return (min(starts), max(ends)) if starts else (0.0, 0.0)

    def telemetry(self, t0: float, t1: float, buckets: int, names: list[str] | None = None) -> dict:
        with self.lock:
            out = {}
            for name, series in self.series.items():
                if names and name not in names:
                    continue
                ts, vs = series.window(t0, t1)
                out[name] = decimate(ts, vs, t0, t1, buckets)
            return out

    def raw(self, t0: float, t1: float, names: list[str]) -> dict[str, tuple[list[float], list[float]]]:
        with self.lock:
            return {name: self.series[name].window(t0, t1) for name in names if name in self.series}

    def timeline(self, t0: float, t1: float, limit: int = 2000) -> dict:
        with self.lock:
            cuts = [c for c in self.cuts if t0 <= c["t"] <= t1]
            boots = [b for b in self.boots if t0 <= b <= t1]
            windows = [w for w in self.windows if (w[1] is None or w[1] >= t0) and w[0] <= t1]
            on = bool(self.windows) and self.windows[-1][1] is None

        # Beyond `limit` marks the page could not tell them apart anyway: keep every n-th, say so.
        def thin(items: list) -> list:
            step = max(1, len(items) // limit + (1 if len(items) % limit else 0))
            return items[::step]

        return {
            "cuts": thin(cuts),
            "boots": thin(boots),
            "windows": thin(windows),
            "total_cuts": len(cuts),
            "payload_on": on,
            "doing": dict(self._doing),
        }
