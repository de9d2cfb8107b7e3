"""Typed, immutable view of an interruption trace (docs/trace-format.md, section 6).

A `Trace` is a header plus a time-ordered tuple of `Event`s and a tuple of `TelemetrySample`s.
Derived views — `windows()`, `cuts()`, `stats()` — are computed on demand; `scaled()` and
`concat()` return new traces. The text form (reading, writing, validating) lives in `traces.format`,
which imports this module and never the other way round.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from types import MappingProxyType
from typing import Any

FORMAT_NAME = "orbitweaver-trace"
FORMAT_VERSION = 1

# Tolerance for "equal" / "exactly" between times (docs/trace-format.md section 4): 1 µs absolute
# plus a relative part, so traces scaled by non-integral factors stay valid.
TIME_TOLERANCE_ABS_S = 1e-6
TIME_TOLERANCE_REL = 1e-12


def times_equal(a: float, b: float) -> bool:
    """True when two trace times are equal within the format's tolerance."""
    return abs(a - b) <= TIME_TOLERANCE_ABS_S + TIME_TOLERANCE_REL * max(abs(a), abs(b))


class CutCause(enum.StrEnum):
    """Why the bus takes power away from the payload."""

    POWER = "power"  # brown-out protection: SoC / bus voltage below the payload threshold
    THERMAL = "thermal"  # payload at or above its thermal limit
    FDIR = "fdir"  # fault detection, isolation and recovery reset; never announced
    CONTENTION = "contention"  # a scheduled higher-priority payload takes the power budget


class EventKind(enum.StrEnum):
    POWER_ON = "power_on"
    WARNING = "warning"
    CUT = "cut"


@dataclass(frozen=True, slots=True)
class Event:
    """One event line: `power_on`, `warning` (announces a cut `lead_s` later) or `cut`."""

    t_s: float
    kind: EventKind
    cause: CutCause | None = None
    lead_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TelemetrySample:
    """One 1 Hz housekeeping sample; a field is None when the source did not measure it."""

    t_s: float
    bus_voltage_v: float | None
    battery_soc: float | None
    payload_temp_c: float | None
    payload_power_w: float | None


TELEMETRY_COLUMNS = ("t", "bus_voltage_v", "battery_soc", "payload_temp_c", "payload_power_w")


@dataclass(frozen=True, slots=True)
class PowerWindow:
    """An interval during which the payload has power.

    `cut_cause` is None for a window still open when the trace ends (then `end_s` is the trace's
    duration). `warning_lead_s` is 0 when the cut came without warning.
    """

    start_s: float
    end_s: float
    cut_cause: CutCause | None
    warning_lead_s: float = 0.0

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def is_open(self) -> bool:
        return self.cut_cause is None

    @property
    def warning_at_s(self) -> float | None:
        """When the payload is warned, or None when it is not."""
        return self.end_s - self.warning_lead_s if self.warning_lead_s > 0 else None


@dataclass(frozen=True, slots=True)
class Cut:
    t_s: float
    cause: CutCause
    warning_lead_s: float

    @property
    def warning_at_s(self) -> float | None:
        return self.t_s - self.warning_lead_s if self.warning_lead_s > 0 else None


@dataclass(frozen=True)
class TraceStats:
    """Summary numbers printed by `trace-info`. Window lengths include an open final window."""

    duration_s: float
    reference_request_s: float
    windows: int
    open_final_window: bool
    cuts: int
    cuts_by_cause: Mapping[str, int]
    window_mean_s: float | None
    window_median_s: float | None
    window_min_s: float | None
    window_max_s: float | None
    windows_shorter_than_request: int
    off_mean_s: float | None
    warned_cuts: int
    warning_lead_mean_s: float | None
    warning_lead_min_s: float | None
    warning_lead_max_s: float | None
    on_time_s: float
    duty_cycle: float

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["cuts_by_cause"] = dict(self.cuts_by_cause)
        return out


def _freeze(value: Any) -> Any:
    """Deep read-only copy of JSON-like data, so a frozen Trace cannot be mutated through it."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of `_freeze`: plain dicts and lists, ready for `json.dumps`."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True, eq=True)
class Trace:
    """An interruption trace. Construct with keyword arguments, or load one with `traces.load`.

    Construction does not validate; `problems()` does (and `traces.dump` refuses invalid traces).
    """

    name: str
    duration_s: float
    events: tuple[Event, ...]
    telemetry: tuple[TelemetrySample, ...] = ()
    telemetry_period_s: float | None = None
    reference_request_s: float = 180.0
    time_scale: float = 1.0
    description: str = ""
    source: Mapping[str, Any] = field(default_factory=lambda: {"kind": "manual"})
    assumptions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Normalize containers so equality and immutability do not depend on what the caller
        # passed (lists vs tuples, dict vs mapping proxy).
        object.__setattr__(self, "events", tuple(self.events))
        object.__setattr__(self, "telemetry", tuple(self.telemetry))
        object.__setattr__(self, "assumptions", tuple(self.assumptions))
        object.__setattr__(self, "source", _freeze(self.source))

    __hash__ = None  # type: ignore[assignment]  # holds mappings; equality is by value

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def from_windows(
        cls,
        name: str,
        duration_s: float,
        windows: Iterable[PowerWindow],
        *,
        telemetry: Sequence[TelemetrySample] = (),
        telemetry_period_s: float | None = None,
        reference_request_s: float = 180.0,
        description: str = "",
        source: Mapping[str, Any] | None = None,
        assumptions: Sequence[str] = (),
    ) -> Trace:
        """Build a trace from windows: power_on at each start, a warning `warning_lead_s` before
        each cut, a cut at each end (none for an open window)."""
        events: list[Event] = []
        for window in windows:
            events.append(Event(window.start_s, EventKind.POWER_ON))
            if window.cut_cause is None:
                continue
            if window.warning_lead_s > 0:
                events.append(
                    Event(
                        window.end_s - window.warning_lead_s, EventKind.WARNING, window.cut_cause, window.warning_lead_s
                    )
                )
            events.append(Event(window.end_s, EventKind.CUT, window.cut_cause, window.warning_lead_s))
        return cls(
            name=name,
            duration_s=duration_s,
            events=tuple(events),
            telemetry=tuple(telemetry),
            telemetry_period_s=telemetry_period_s,
            reference_request_s=reference_request_s,
            description=description,
            source=source if source is not None else {"kind": "manual"},
            assumptions=tuple(assumptions),
        )

    # ------------------------------------------------------------------ derived views

    def windows(self) -> list[PowerWindow]:
        """Power windows in time order; the last one is open (cut_cause None) if the payload is
        still on when the trace ends. Assumes a valid trace."""
        out: list[PowerWindow] = []
        start: float | None = None
        for event in self.events:
            if event.kind is EventKind.POWER_ON:
                start = event.t_s
            elif event.kind is EventKind.CUT and start is not None:
                out.append(PowerWindow(start, event.t_s, event.cause, event.lead_s))
                start = None
        if start is not None:
            out.append(PowerWindow(start, self.duration_s, None, 0.0))
        return out

    def cuts(self) -> list[Cut]:
        return [
            Cut(e.t_s, e.cause, e.lead_s)  # type: ignore[arg-type]
            for e in self.events
            if e.kind is EventKind.CUT
        ]

    def warnings(self) -> list[Event]:
        return [e for e in self.events if e.kind is EventKind.WARNING]

    def is_on_at(self, t_s: float) -> bool:
        """Whether the payload has power at trace time `t_s` (a window is [start, end))."""
        for window in self.windows():
            if window.start_s <= t_s < window.end_s:
                return True
        return False

    def telemetry_at(self, t_s: float) -> TelemetrySample | None:
        """The latest telemetry sample at or before `t_s` (what the bus would be publishing),
        or None before the first sample / without telemetry."""
        if not self.telemetry or self.telemetry_period_s is None:
            return None
        index = int(math.floor(t_s / self.telemetry_period_s + 1e-9))
        index = min(index, len(self.telemetry) - 1)
        return self.telemetry[index] if index >= 0 else None

    def stats(self) -> TraceStats:
        windows = self.windows()
        lengths = [w.length_s for w in windows]
        cuts = self.cuts()
        by_cause = {cause.value: 0 for cause in CutCause}
        for cut in cuts:
            by_cause[cut.cause.value] += 1
        leads = [c.warning_lead_s for c in cuts if c.warning_lead_s > 0]
        off_gaps = [b.start_s - a.end_s for a, b in pairwise(windows)]
        on_time = sum(lengths)
        return TraceStats(
            duration_s=self.duration_s,
            reference_request_s=self.reference_request_s,
            windows=len(windows),
            open_final_window=bool(windows) and windows[-1].is_open,
            cuts=len(cuts),
            cuts_by_cause=MappingProxyType(by_cause),
            window_mean_s=statistics.fmean(lengths) if lengths else None,
            window_median_s=statistics.median(lengths) if lengths else None,
            window_min_s=min(lengths) if lengths else None,
            window_max_s=max(lengths) if lengths else None,
            windows_shorter_than_request=sum(1 for x in lengths if x < self.reference_request_s),
            off_mean_s=statistics.fmean(off_gaps) if off_gaps else None,
            warned_cuts=len(leads),
            warning_lead_mean_s=statistics.fmean(leads) if leads else None,
            warning_lead_min_s=min(leads) if leads else None,
            warning_lead_max_s=max(leads) if leads else None,
            on_time_s=on_time,
            duty_cycle=on_time / self.duration_s if self.duration_s > 0 else 0.0,
        )

    # ------------------------------------------------------------------ transformations

    def scaled(self, factor: float) -> Trace:
        """The same trace with every time, duration and lead multiplied by `factor`.

        The testbench compresses time with it: with a request that takes R seconds uninterrupted
        on this machine, `trace.scaled(R / trace.reference_request_s)` keeps the ratio of window
        length to request length that the trace was designed for (docs/trace-format.md, s. 8).
        Telemetry values are unchanged; only their timestamps move.
        """
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"scale factor must be a finite number > 0, got {factor!r}")
        f = float(factor)
        return replace(
            self,
            duration_s=self.duration_s * f,
            events=tuple(replace(e, t_s=e.t_s * f, lead_s=e.lead_s * f) for e in self.events),
            telemetry=tuple(replace(s, t_s=s.t_s * f) for s in self.telemetry),
            telemetry_period_s=None if self.telemetry_period_s is None else self.telemetry_period_s * f,
            reference_request_s=self.reference_request_s * f,
            time_scale=self.time_scale * f,
        )

    def concat(self, other: Trace, *, name: str | None = None) -> Trace:
        """`self` followed by `other`, shifted by `self.duration_s`.

        The payload state must be continuous at the seam: if `self` ends with the payload on,
        `other` must start with a power_on at t=0 (the two windows merge); if `self` ends off,
        `other` may start either way. Both must share telemetry period, reference request and
        time scale. The seam sample of `other` (its t=0 telemetry) replaces `self`'s last one.
        """
        for attr in ("telemetry_period_s", "reference_request_s", "time_scale"):
            if getattr(self, attr) != getattr(other, attr):
                raise ValueError(
                    f"cannot concatenate: {attr} differs ({getattr(self, attr)} vs {getattr(other, attr)})"
                )
        offset = self.duration_s
        if self.telemetry and self.telemetry_period_s is not None:
            steps = offset / self.telemetry_period_s
            if not times_equal(steps, round(steps)):
                raise ValueError(
                    "cannot concatenate: the first trace's duration is not a whole number of "
                    "telemetry periods, so the telemetry grid would break at the seam"
                )
        own_windows = self.windows()
        ends_on = bool(own_windows) and own_windows[-1].is_open
        other_events = list(other.events)
        starts_on = (
            bool(other_events) and other_events[0].kind is EventKind.POWER_ON and times_equal(other_events[0].t_s, 0.0)
        )
        if ends_on:
            if not starts_on:
                raise ValueError(
                    "cannot concatenate: the first trace ends with the payload on but the second "
                    "starts with it off (a cut at the seam would need a cause)"
                )
            other_events = other_events[1:]  # merge the open window with the first one of `other`
        events = list(self.events) + [replace(e, t_s=e.t_s + offset) for e in other_events]
        telemetry: list[TelemetrySample] = list(self.telemetry)
        if telemetry and other.telemetry:
            telemetry = telemetry[:-1]
        telemetry += [replace(s, t_s=s.t_s + offset) for s in other.telemetry]
        return replace(
            self,
            name=name or self.name,
            duration_s=self.duration_s + other.duration_s,
            events=tuple(events),
            telemetry=tuple(telemetry),
            description=self.description
            if other.description == self.description
            else f"{self.description} Followed by: {other.description}",
            source={"kind": "manual", "concatenation_of": [thaw(self.source), thaw(other.source)]},
            assumptions=self.assumptions + tuple(a for a in other.assumptions if a not in self.assumptions),
        )

    def repeated(self, times: int, *, name: str | None = None) -> Trace:
        """`self` concatenated with itself `times` times (see `concat` for the seam rule)."""
        if times < 1:
            raise ValueError("times must be >= 1")
        out = self
        for _ in range(times - 1):
            out = out.concat(self, name=name)
        return replace(
            out,
            name=name or self.name,
            source={"kind": "manual", "repetition_of": thaw(self.source), "times": times},
        )
