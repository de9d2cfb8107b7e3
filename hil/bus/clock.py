"""Trace time and the trace's actions: when each power-on, warning and cut of the trace happens
on the monotonic clock (docs/bus.md §1, §2).

`time_scale` is wall seconds per trace second. Trace second t happens at wall time
(t - start_at) × time_scale after start; the bus clock carried in telemetry (`trace_time_s`,
`lead_time_s`) is trace time × time_scale, so it runs at wall speed and a lead tells the payload
how many of its own seconds it has left.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import traces
from common.wire import PowerCause
from traces import CutCause, EventKind

#: Trace cut causes (docs/trace-format.md §3.1) as wire power causes (docs/wire-protocol.md §5.5).
#: Keyed by a trace action's cause, which only the end action lacks (it is never looked up).
TRACE_CAUSE: dict[CutCause | None, PowerCause] = {
    CutCause.POWER: PowerCause.LOW_BATTERY,
    CutCause.THERMAL: PowerCause.THERMAL,
    CutCause.FDIR: PowerCause.FDIR,
    CutCause.CONTENTION: PowerCause.COMMANDED,
}


class TraceClock:
    """Trace time against the monotonic clock: trace second t is at t0 + (t - start_at) × scale.

    `hold` stops trace time (a replay waiting for the payload to reach the point the recording
    had reached by then, hil/replay.py); `release` lets it run on from where it stopped."""

    def __init__(self, time_scale: float, start_at_s: float, t0: float | None = None):
        self.scale = float(time_scale)
        self.start_at_s = float(start_at_s)
        self.t0 = time.monotonic() if t0 is None else t0
        self.held_at: float | None = None

    def hold(self, now: float) -> None:
        if self.held_at is None:
            self.held_at = now

    def release(self, now: float) -> None:
        if self.held_at is not None:
            self.t0 += now - self.held_at
            self.held_at = None

    def trace_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if self.held_at is not None:
            now = min(now, self.held_at)
        return self.start_at_s + (now - self.t0) / self.scale

    def clock_s(self, now: float | None = None) -> float:
        """The bus clock of telemetry: trace time × scale (wall speed)."""
        return self.trace_s(now) * self.scale

    def at(self, trace_s: float) -> float:
        """Monotonic time at which trace second `trace_s` happens (never, while held past it)."""
        t = self.t0 + (trace_s - self.start_at_s) * self.scale
        return math.inf if self.held_at is not None and t > self.held_at else t


@dataclass(frozen=True)
class TraceAction:
    """One thing the trace makes the bus do at trace second `trace_s`."""

    trace_s: float
    order: int  # at equal times: cut, then power_on, then warning (the trace's own order)
    kind: str  # "power_on", "warning", "cut", "end"
    cause: CutCause | None = None
    lead_s: float = 0.0


def trace_actions(
    trace: traces.Trace, start_at_s: float
) -> tuple[bool, tuple[float, CutCause | None, float] | None, list[TraceAction]]:
    """(on at the start, warning in force at the start as (cut time, cause, lead) or None, the
    actions after the start in time order, ending with "end")."""
    on = trace.is_on_at(start_at_s)
    pending = None
    for window in trace.windows():
        w = window.warning_at_s
        if w is not None and w < start_at_s < window.end_s and window.start_s <= start_at_s:
            pending = (window.end_s, window.cut_cause, window.warning_lead_s)
    actions = []
    for index, event in enumerate(trace.events):
        if event.kind is EventKind.WARNING:
            if event.t_s >= start_at_s:
                actions.append(TraceAction(event.t_s, index, "warning", event.cause, event.lead_s))
        elif event.t_s > start_at_s:
            kind = "power_on" if event.kind is EventKind.POWER_ON else "cut"
            actions.append(TraceAction(event.t_s, index, kind, event.cause, event.lead_s))
    actions.sort(key=lambda a: (a.trace_s, a.order))
    actions.append(TraceAction(max(trace.duration_s, start_at_s), len(trace.events), "end"))
    return on, pending, actions
