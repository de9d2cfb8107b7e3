"""Turn any telemetry CSV into an interruption trace (`ow hil trace-import-csv`,
docs/trace-format.md section 10).

The column mapping comes from the caller (`CsvImport`); nothing about a file is guessed:

- Time: one column, in seconds, minutes, milliseconds, Unix seconds or date-times. Rows must not
  go back in time. Rows that repeat the time stamp of the row before are either a warning (the
  last of them is the reading at that time) or, with `spread_repeats`, evenly spaced samples
  within the stamp's resolution (60 rows under an `HH:MM` stamp are one per second).
- Payload on while the payload current is above `on_above_ma`; a switch happens at the first
  reading on the other side. A cut is `thermal` when the latest temperature reading at or before
  it is at or above `thermal_at_c`, `other_cause` (power) otherwise. No warnings: a log records no
  shutdown notice.
- Telemetry at 1 Hz: each second holds the latest reading at or before it; nothing is
  interpolated; a channel not mapped, or not read yet, is null.
- Several files may be given (the same time column in each, a mapped column in exactly one).

Reported with file and line: a missing column, time going backward, a cell that is not a
number, a reading outside the trace format's range (errors: the import stops); time gaps,
repeated stamps, empty cells, an uneven number of rows per stamp (warnings: it goes on).
"""

from __future__ import annotations

import calendar
import csv
import hashlib
import math
import os
import re
import statistics
import time
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path

from traces.format import NAME_PATTERN
from traces.generator import soc_from_voltage
from traces.model import CutCause, Event, EventKind, TelemetrySample, Trace

TIME_UNITS = ("s", "min", "ms", "unix", "datetime")
CURRENT_UNITS = ("mA", "A")
VOLTAGE_UNITS = ("V", "mV")
BATTERY_UNITS = ("soc", "percent", "V", "mV")
#: Cells in series of the pack whose curve converts a battery voltage (BUPT-1's, 4S Li-ion).
CURVE_CELLS = 4
#: Occurrences of one kind of warning listed one by one before they are only counted.
WARNINGS_LISTED = 5

_DATETIME = re.compile(
    r"^(\d{4})[-/](\d{1,2})[-/](\d{1,2})[ T](\d{1,2}):(\d{2})(?::(\d{2})(\.\d+)?)?\s*(Z|[+-]\d{2}:?\d{2})?$"
)


class CsvImportError(ValueError):
    """Input that cannot become a trace; str is `file:line: message`."""


class CsvImportOptionsError(ValueError):
    """A column mapping or option that cannot work, whatever the input."""


@dataclass(frozen=True)
class CsvImport:
    """What the columns mean and how to turn them into a trace (recorded in the trace header)."""

    time: str
    current: str
    on_above_ma: float
    time_unit: str = "s"
    #: repeated stamps are evenly spaced samples within the stamp's resolution (see module doc)
    spread_repeats: bool = False
    current_unit: str = "mA"
    temperature: str | None = None
    thermal_at_c: float | None = None
    voltage: str | None = None
    voltage_unit: str = "V"
    battery: str | None = None
    battery_unit: str = "soc"
    battery_cells: int = CURVE_CELLS
    #: payload power = current × this voltage (the payload's supply rail); None: not computed
    payload_volts: float | None = None
    #: column -> a value that means "no reading in this row" (multiplexed channels)
    no_reading: dict[str, float] = field(default_factory=dict)
    other_cause: str = CutCause.POWER.value
    #: excerpt on the log's time axis, in seconds (see `time_origin`)
    from_s: float | None = None
    to_s: float | None = None
    #: a time step longer than this is a gap (default: twice the file's median step)
    max_gap_s: float | None = None
    name: str | None = None
    reference_request_s: float = 180.0

    def check(self) -> None:
        def bad(message: str) -> CsvImportOptionsError:
            return CsvImportOptionsError(message)

        for value, allowed, what in (
            (self.time_unit, TIME_UNITS, "time unit"),
            (self.current_unit, CURRENT_UNITS, "current unit"),
            (self.voltage_unit, VOLTAGE_UNITS, "voltage unit"),
            (self.battery_unit, BATTERY_UNITS, "battery unit"),
        ):
            if value not in allowed:
                raise bad(f"{what} {value!r} is not one of {', '.join(allowed)}")
        if not math.isfinite(self.on_above_ma):
            raise bad("the on threshold must be a number of milliamperes")
        for flag, number in (
            ("--thermal-at", self.thermal_at_c),
            ("--from", self.from_s),
            ("--to", self.to_s),
            ("--max-gap", self.max_gap_s),
            ("--payload-volts", self.payload_volts),
        ):
            if number is not None and not math.isfinite(number):
                raise bad(f"{flag} must be a finite number, not {number!r}")
        if self.thermal_at_c is not None and self.temperature is None:
            raise bad("--thermal-at needs --temperature (the column to compare)")
        if self.other_cause not in {c.value for c in CutCause} - {CutCause.THERMAL.value}:
            raise bad(f"other cause {self.other_cause!r} is not one of power, fdir, contention")
        if self.battery_cells < 1:
            raise bad("--battery-cells must be at least 1")
        if self.from_s is not None and self.to_s is not None and self.to_s <= self.from_s:
            raise bad(f"--to {self.to_s:g} is not after --from {self.from_s:g}")
        if self.max_gap_s is not None and not self.max_gap_s > 0:
            raise bad("--max-gap must be > 0")
        if self.payload_volts is not None and not self.payload_volts > 0:
            raise bad("--payload-volts must be > 0")
        if self.name is not None and not NAME_PATTERN.match(self.name):
            raise bad(f"trace name {self.name!r}: 1-64 characters from a-z 0-9 . _ -, starting with a letter or digit")
        columns = [c for c in (self.time, self.current, self.temperature, self.voltage, self.battery) if c]
        if len(set(columns)) != len(columns):
            raise bad(f"a column is mapped twice: {', '.join(columns)}")
        unknown = set(self.no_reading) - set(columns)
        if unknown:
            raise bad(f"--no-reading names column(s) not mapped to a channel: {', '.join(sorted(unknown))}")

    def channels(self) -> dict[str, str]:
        """Trace channel -> CSV column, for the mapped channels."""
        mapping = {
            "current": self.current,
            "temperature": self.temperature,
            "voltage": self.voltage,
            "battery": self.battery,
        }
        return {channel: column for channel, column in mapping.items() if column}


@dataclass
class Imported:
    trace: Trace
    #: `file:line: warning: ...` lines, in the order found
    warnings: list[str]
    #: one-line facts the operator should see (where trace time 0 is, a payload on at the start)
    notes: list[str]


# ------------------------------------------------------------------------------------ reading


@dataclass
class _Reading:
    t: float  # log time, seconds
    value: float
    line: int


@dataclass
class _Table:
    path: Path
    #: channel -> readings in file order (which is time order)
    readings: dict[str, list[_Reading]]
    first_t: float
    #: time after which nothing is known: the last row's time, or with spread repeats the end
    #: of the last stamp's interval
    end_t: float
    rows: int


class _Warnings:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, path: Path, line: int, kind: str, message: str) -> None:
        key = (str(path), kind)
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        if count <= WARNINGS_LISTED:
            self.lines.append(f"{path}:{line}: warning: {message}")

    def finish(self) -> list[str]:
        for (path, kind), count in self._counts.items():
            if count > WARNINGS_LISTED:
                self.lines.append(
                    f"{path}:0: warning: {count - WARNINGS_LISTED} more {kind} not listed ({count} in all)"
                )
        return self.lines


def _parse_number(path: Path, line: int, column: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise CsvImportError(f"{path}:{line}: column {column} is not a number: {text!r}") from None
    if not math.isfinite(value):
        raise CsvImportError(f"{path}:{line}: column {column} is not a finite number: {text!r}")
    return value


def _written_resolution(text: str) -> float:
    """Resolution of a number as written: 10^-(digits after the point)."""
    text = text.strip().lower()
    if "e" in text:
        return 0.0  # exponent notation has no fixed written precision
    return 10.0 ** -len(text.split(".", 1)[1]) if "." in text else 1.0


def _parse_time(path: Path, line: int, column: str, text: str, unit: str) -> tuple[float, float]:
    """(time in seconds on the file's own scale, resolution of the stamp in seconds)."""
    text = text.strip()
    if unit == "datetime":
        match = _DATETIME.match(text)
        if not match:
            raise CsvImportError(f"{path}:{line}: column {column} is not a date-time (YYYY-MM-DD HH:MM[:SS]): {text!r}")
        year, month, day, hour, minute, second, fraction, zone = match.groups()
        try:
            epoch = calendar.timegm(
                (int(year), int(month), int(day), int(hour), int(minute), int(second or 0), 0, 0, 0)
            )
            if not (
                1 <= int(month) <= 12
                and 1 <= int(day) <= 31
                and int(hour) < 24
                and int(minute) < 60
                and int(second or 0) < 61
            ):
                raise ValueError
        except (ValueError, OverflowError):
            raise CsvImportError(f"{path}:{line}: column {column} is not a valid date-time: {text!r}") from None
        if zone and zone != "Z":
            sign = 1 if zone[0] == "+" else -1
            digits = zone[1:].replace(":", "")
            epoch -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
        resolution = 60.0 if second is None else (10.0 ** -(len(fraction) - 1) if fraction else 1.0)
        return epoch + (float(fraction) if fraction else 0.0), resolution
    if _DATETIME.match(text):
        raise CsvImportError(
            f"{path}:{line}: column {column} is a date-time, not a number in {unit}: {text!r} (--time-unit datetime)"
        )
    value = _parse_number(path, line, column, text)
    scale = {"s": 1.0, "min": 60.0, "ms": 0.001, "unix": 1.0}[unit]
    return value * scale, _written_resolution(text) * scale


def _to_log_time(raw: float, unit: str, origin: float) -> float:
    # Rounded to the millisecond, which undoes binary fractions (minutes as 0.1 * k).
    return round(raw - origin, 3) if unit in ("unix", "datetime") else round(raw, 3)


def _read_table(path: Path, params: CsvImport, wanted: dict[str, str]) -> tuple[list, list]:
    """Rows of one file as (line, raw time, resolution, {channel: cell text}); the header check."""
    try:
        handle = path.open(encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise CsvImportError(f"{path}:0: cannot read: {exc.strerror or exc}") from None
    with handle:
        reader = csv.reader(handle)
        try:
            header = next(reader)
        except StopIteration:
            raise CsvImportError(f"{path}:1: empty file (no header line)") from None
        except csv.Error as exc:
            raise CsvImportError(f"{path}:1: not a CSV file: {exc}") from None
        header = [name.strip() for name in header]
        if params.time not in header:
            raise CsvImportError(f"{path}:1: missing time column {params.time!r} (columns: {', '.join(header)})")
        time_index = header.index(params.time)
        indices = {channel: header.index(column) for channel, column in wanted.items() if column in header}
        rows = []
        try:
            for cells in reader:
                line = reader.line_num
                if not cells or all(not c.strip() for c in cells):
                    continue  # a blank line (an editor's trailing newline)
                if len(cells) < len(header) or any(c.strip() for c in cells[len(header) :]):
                    raise CsvImportError(f"{path}:{line}: {len(cells)} cells, the header has {len(header)} columns")
                raw, resolution = _parse_time(path, line, params.time, cells[time_index], params.time_unit)
                rows.append((line, raw, resolution, {channel: cells[i] for channel, i in indices.items()}))
        except csv.Error as exc:
            raise CsvImportError(f"{path}:{reader.line_num}: not a CSV file: {exc}") from None
    return header, rows


def _row_times(path: Path, rows: list, params: CsvImport, warnings: _Warnings) -> tuple[list[float], float]:
    """Raw time of each row (repeats spread when asked); the end of the data in raw seconds.
    Stops at time going backward; warns about repeats, gaps and uneven rows per stamp."""
    times = [raw for _, raw, _, _ in rows]
    for (line_a, a, _, _), (line_b, b, _, _) in pairwise(rows):
        if b < a:
            raise CsvImportError(
                f"{path}:{line_b}: time goes backward: {params.time} is at {b:g} s here but at {a:g} s on line {line_a}"
            )
    end = times[-1] if times else 0.0
    if params.spread_repeats:
        groups: list[tuple[int, int]] = []  # (first row index, count) per distinct stamp
        for index, t in enumerate(times):
            if groups and times[groups[-1][0]] == t:
                groups[-1] = (groups[-1][0], groups[-1][1] + 1)
            else:
                groups.append((index, 1))
        spread = list(times)
        for first, count in groups:
            resolution = rows[first][2]
            if count > 1 and resolution <= 0:
                raise CsvImportError(
                    f"{path}:{rows[first][0]}: --spread-repeats needs stamps of a fixed written "
                    f"precision, not {rows[first][1]!r}"
                )
            for j in range(count):
                spread[first + j] = times[first] + j * resolution / count
        for ((line_a, _, _, _), (line_b, _, _, _)), (a, b) in zip(pairwise(rows), pairwise(spread), strict=True):
            if b <= a:
                raise CsvImportError(
                    f"{path}:{line_b}: time goes backward: the rows spread over the stamp of "
                    f"line {line_a} run past this row's stamp"
                )
        sizes = [count for _, count in groups[1:-1]]
        if sizes:
            usual = statistics.mode(sizes)
            for first, count in groups[1:-1]:
                if count != usual:
                    warnings.add(
                        path,
                        rows[first][0],
                        "uneven stamps",
                        f"{count} rows share this time stamp where {usual} usually do: their spacing differs",
                    )
        last_first, _ = groups[-1]
        end = times[last_first] + rows[last_first][2]
        times = spread
    else:
        for (line_a, a, _, _), (line_b, b, _, _) in pairwise(rows):
            if b == a:
                warnings.add(
                    path,
                    line_b,
                    "repeated time stamps",
                    f"same time stamp as line {line_a}: the later row is the reading at that time "
                    "(--spread-repeats takes such rows as evenly spaced samples)",
                )
    steps = [b - a for a, b in pairwise(times) if b > a]
    if steps:
        limit = params.max_gap_s if params.max_gap_s is not None else 2 * statistics.median(steps)
        for ((line_a, _, _, _), (line_b, _, _, _)), (a, b) in zip(pairwise(rows), pairwise(times), strict=True):
            if b - a > limit + 1e-9:
                warnings.add(
                    path,
                    line_b,
                    "time gaps",
                    f"gap of {b - a:g} s after line {line_a} (more than {limit:g} s): the reading of "
                    f"line {line_a} is held across it",
                )
    return times, end


def _convert(channel: str, value: float, params: CsvImport) -> float:
    if channel == "current":
        return value * 1000.0 if params.current_unit == "A" else value
    if channel == "voltage":
        return value / 1000.0 if params.voltage_unit == "mV" else value
    if channel == "battery":
        if params.battery_unit == "soc":
            return value
        if params.battery_unit == "percent":
            return value / 100.0
        volts = value / 1000.0 if params.battery_unit == "mV" else value
        if params.battery_cells != CURVE_CELLS:  # the same state of charge per cell
            volts = volts * CURVE_CELLS / params.battery_cells
        return soc_from_voltage(volts)
    return value


def _load(
    paths: Sequence[Path], params: CsvImport, warnings: _Warnings
) -> tuple[dict[str, list[_Reading]], dict[str, Path], float, float]:
    """Readings per channel on the log axis, which file each channel came from, the log-axis
    origin (raw seconds) and the end of the data on the log axis."""
    channels = params.channels()
    parsed = []
    found: dict[str, Path] = {}
    for path in paths:
        header, rows = _read_table(path, params, channels)
        for channel, column in channels.items():
            if column in header:
                if channel in found:
                    raise CsvImportError(
                        f"{path}:1: column {column!r} is also in {found[channel]}: which one is meant is ambiguous"
                    )
                found[channel] = path
        if not rows:
            raise CsvImportError(f"{path}:2: no data rows")
        times, end = _row_times(path, rows, params, warnings)
        parsed.append((path, header, rows, times, end))
    missing = [column for channel, column in channels.items() if channel not in found]
    if missing:
        listed = "; ".join(f"{p}: {', '.join(h)}" for p, h, *_ in parsed)
        raise CsvImportError(f"{paths[0]}:1: missing column(s) {', '.join(missing)} (columns: {listed})")
    origin = min(times[0] for *_, times, _ in parsed) if params.time_unit in ("unix", "datetime") else 0.0
    readings: dict[str, list[_Reading]] = {channel: [] for channel in channels}
    ends = []
    for path, _header, rows, times, end in parsed:
        mine = [channel for channel in channels if found[channel] == path]
        if not mine:
            continue  # a file none of whose columns is used
        ends.append(_to_log_time(end, params.time_unit, origin))
        for (line, _, _, cells), raw in zip(rows, times, strict=True):
            t = _to_log_time(raw, params.time_unit, origin)
            for channel in mine:
                column = channels[channel]
                text = cells[channel].strip()
                if not text:
                    warnings.add(
                        path,
                        line,
                        f"empty cells in {column}",
                        f"column {column} is empty: no reading in this row (the previous one holds)",
                    )
                    continue
                value = _parse_number(path, line, column, text)
                if column in params.no_reading and value == params.no_reading[column]:
                    continue
                readings[channel].append(_Reading(t, _convert(channel, value, params), line))
    for channel, column in channels.items():
        if not readings[channel]:
            raise CsvImportError(f"{found[channel]}:0: column {column} holds no reading")
    return readings, found, origin, min(ends)


def _latest(readings: Sequence[_Reading], t: float) -> _Reading | None:
    """The latest reading at or before `t` (readings in time order)."""
    times = [r.t for r in readings]
    index = bisect_right(times, t + 1e-6) - 1
    return readings[index] if index >= 0 else None


def _hold(readings: Sequence[_Reading], times: Iterable[float]) -> list[_Reading | None]:
    out: list[_Reading | None] = []
    index = -1
    for t in times:
        while index + 1 < len(readings) and readings[index + 1].t <= t + 1e-6:
            index += 1
        out.append(readings[index] if index >= 0 else None)
    return out


# ------------------------------------------------------------------------------------ the trace

#: trace channel: (telemetry range, unit, digits kept, hint when out of range)
_RANGES = {
    "voltage": ((0.0, 100.0), "V", 3, "is the column in mV? (--voltage-unit mV)"),
    "battery": ((0.0, 1.0), "(state of charge)", 3, "is it a percentage or a voltage? (--battery-unit)"),
    "temperature": ((-150.0, 150.0), "C", 1, "is the column in degrees Celsius?"),
    "power": ((0.0, 10000.0), "W", 2, "check --payload-volts and --current-unit"),
}


def _checked(channel: str, reading: _Reading | None, value: float | None, found: dict[str, Path]) -> float | None:
    """A telemetry value rounded as the trace keeps it; out of the format's range: the reading's
    file and line."""
    if reading is None or value is None:
        return None
    (low, high), unit, digits, hint = _RANGES[channel]
    if not low <= value <= high:
        source = found["current" if channel == "power" else channel]
        raise CsvImportError(
            f"{source}:{reading.line}: {channel} {value:g} {unit} is outside the trace format's "
            f"range [{low:g}, {high:g}]: {hint}"
        )
    return round(value, digits)


def _default_name(path: Path) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-._")[:64]
    return name if name and NAME_PATTERN.match(name) else "imported"


def import_csv(files: Sequence[str | os.PathLike[str]], params: CsvImport) -> Imported:
    """Build a trace from the telemetry CSV file(s) with the column mapping in `params`."""
    params.check()
    paths = [Path(f) for f in files]
    if not paths:
        raise CsvImportOptionsError("no input file")
    warnings = _Warnings()
    readings, found, origin, data_end = _load(paths, params, warnings)
    current = readings["current"]
    start = params.from_s if params.from_s is not None else current[0].t
    at_start = _latest(current, start)
    if at_start is None:
        raise CsvImportError(
            f"{found['current']}:{current[0].line}: the payload current has no reading at or before "
            f"the start (log time {start:g} s; the first is at {current[0].t:g} s): the payload "
            "state there is unknown; start at or after the first reading (--from)"
        )
    end = data_end
    if params.to_s is not None:
        if params.to_s > data_end + 1e-6:
            raise CsvImportError(
                f"{found['current']}:0: --to {params.to_s:g} is after the end of the data (log time {data_end:g} s)"
            )
        end = params.to_s
    duration = math.floor(end - start + 1e-6)
    if duration < 1:
        raise CsvImportError(
            f"{found['current']}:0: nothing to import: the data from log time {start:g} s ends at {end:g} s"
        )

    def trace_time(t: float) -> float:
        return round(t - start, 3)

    # Switches: the state at the start, then every crossing inside (0, duration].
    events: list[Event] = []
    on = False
    threshold = params.on_above_ma
    temperature = readings.get("temperature", [])
    cause_otherwise = CutCause(params.other_cause)
    states = {0.0: at_start.value > threshold}  # trace time -> on; the later of equal times wins
    for reading in current:
        t = trace_time(reading.t)
        if 0.0 < t <= duration:
            states[t] = reading.value > threshold
    for t, now_on in states.items():
        if now_on == on:
            continue
        if now_on:
            events.append(Event(float(t), EventKind.POWER_ON))
        else:
            temp = _latest(temperature, t + start) if temperature else None
            thermal = temp is not None and params.thermal_at_c is not None and temp.value >= params.thermal_at_c
            events.append(Event(float(t), EventKind.CUT, CutCause.THERMAL if thermal else cause_otherwise, 0.0))
        on = now_on

    seconds = range(duration + 1)
    held = {channel: _hold(values, [start + k for k in seconds]) for channel, values in readings.items()}

    def value(channel: str, k: int) -> float | None:
        reading = held[channel][k] if channel in held else None
        return _checked(channel, reading, None if reading is None else reading.value, found)

    samples = []
    for k in seconds:
        amps = held["current"][k]
        power = None if params.payload_volts is None or amps is None else amps.value * params.payload_volts / 1000.0
        samples.append(
            TelemetrySample(
                float(k),
                value("voltage", k),
                value("battery", k),
                value("temperature", k),
                _checked("power", amps, power, found),
            )
        )

    notes = []
    if params.time_unit in ("unix", "datetime"):
        notes.append(
            f"log time 0 is the first time stamp, {origin:.0f} s after 1970-01-01 UTC "
            f"({_utc(origin)}); the trace starts at log time {start:g} s"
        )
    else:
        in_unit = start / _unit_seconds(params.time_unit)
        notes.append(f"the trace starts at log time {start:g} s ({params.time} = {in_unit:g} {params.time_unit})")
    if at_start.value > threshold:
        notes.append(
            f"the payload is on at the start ({found['current']}:{at_start.line}): the trace's first "
            "power_on marks the start of the excerpt, not a switch-on"
        )
    if not events:
        notes.append(f"{params.current} never exceeds {threshold:g} mA in the excerpt: the payload is off throughout")

    name = params.name or _default_name(paths[0])
    inputs = {str(p.name): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in paths}
    trace = Trace(
        name=name,
        description=(
            f"Imported from {', '.join(p.name for p in paths)}: payload on while {params.current} > "
            f"{threshold:g} mA, log time {start:g}-{start + duration:g} s."
        ),
        duration_s=float(duration),
        events=tuple(events),
        telemetry=tuple(samples),
        telemetry_period_s=1.0,
        reference_request_s=params.reference_request_s,
        time_scale=1.0,
        source={
            "kind": "import",
            "importer": "traces.importers.csv_import.import_csv",
            "inputs": inputs,
            "parameters": asdict(params),
            "log_start_s": start,
        },
        assumptions=tuple(_assumptions(params, at_start.value > threshold)),
    )
    # Valid by construction (the writer validates again): ordered switches at distinct times,
    # values checked against the format's ranges above.
    return Imported(trace, warnings.finish(), notes)


def _unit_seconds(unit: str) -> float:
    return {"s": 1.0, "min": 60.0, "ms": 0.001}.get(unit, 1.0)


def _utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))


def _assumptions(params: CsvImport, on_at_start: bool) -> list[str]:
    current = f"{params.current} ({params.current_unit})"
    out = [f"Payload on while {current} > {params.on_above_ma:g} mA; a switch at the first reading on the other side."]
    if params.thermal_at_c is not None:
        out.append(
            f"A cut is thermal when {params.temperature} at the switch-off is >= {params.thermal_at_c:g} C; "
            f"other cuts: {params.other_cause} (the log gives no reason)."
        )
    else:
        out.append(f"Every cut: {params.other_cause} (no thermal rule given; the log gives no reason).")
    out.append("No warnings: the log records no shutdown notice (all leads 0).")
    if params.payload_volts is not None:
        out.append(f"Payload power = {params.current} x {params.payload_volts:g} V (the payload's supply rail).")
    if params.battery is not None and params.battery_unit in ("V", "mV"):
        out.append(
            f"Battery state of charge from {params.battery} through the BUPT-1 Li-ion pack's discharge "
            f"curve (4 cells in series, scaled to {params.battery_cells})."
        )
    if params.no_reading:
        out.append("Not a reading: " + ", ".join(f"{c} = {v:g}" for c, v in params.no_reading.items()) + ".")
    if params.spread_repeats:
        out.append("Rows sharing a time stamp are evenly spaced samples within the stamp's resolution.")
    out.append(
        "1 Hz telemetry holds the latest reading at or before each second; nothing is interpolated; "
        "unmapped channels are null."
    )
    if on_at_start:
        out.append("The payload is on at the start of the excerpt: the first power_on marks that start.")
    return out
