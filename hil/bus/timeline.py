"""The trace timeline: the trace's power-ons, warnings and cuts when they fall due, its end, and
skip-idle's jumps of the clock over spans where nothing can happen (docs/bus.md §1, §2)."""

from __future__ import annotations

import time
from collections import deque

import traces
from common import log
from common.wire import messages as m
from hil.bus import buslog as bl
from hil.bus.base import BusIO, PayloadLink, StopRequest
from hil.bus.clock import TRACE_CAUSE, TraceClock, trace_actions
from hil.bus.config import BusConfig
from hil.bus.power_fdir import PowerFdir
from hil.bus.telemetry import Telemetry
from traces import CutCause

_log = log.get("hil.bus")

#: Longest the main loop sleeps in a poll, so that cuts land on time.
POLL_MAX_S = 0.02
#: skip-idle mode: how long the payload must report no task before idle time is skipped, and
#: the smallest jump worth making (wall seconds)
IDLE_CONFIRM_S = 0.5
SKIP_MIN_S = 0.05


class Timeline:
    """The trace's actions still to come, and the warning in force."""

    def __init__(
        self,
        config: BusConfig,
        trace: traces.Trace,
        clock: TraceClock,
        io: BusIO,
        link: PayloadLink,
        power: PowerFdir,
        telemetry: Telemetry,
        stop: StopRequest,
    ):
        self.config = config
        self.clock = clock
        self.io = io
        self.link = link
        self.power = power
        self.telemetry = telemetry
        self.stop = stop
        _, pending_warning, actions = trace_actions(trace, config.start_at_s)
        #: (cut time, cause, lead) of the announced cut to come, told to each new payload connection
        self.pending_warning: tuple[float, CutCause | None, float] | None = pending_warning
        self.actions = deque(actions)

    def run_due(self, now: float) -> None:
        """The trace's actions that have fallen due, in order."""
        while self.actions and now >= self.clock.at(self.actions[0].trace_s):
            action = self.actions.popleft()
            if action.kind == "power_on":
                self.power.trace_power_on(time.monotonic())
            elif action.kind == "cut":
                self.pending_warning = None
                self.power.trace_cut(TRACE_CAUSE[action.cause], time.monotonic())
            elif action.kind == "warning":
                self.pending_warning = (action.trace_s + action.lead_s, action.cause, action.lead_s)
                self.warn(redelivered=False)
            elif action.kind == "end":
                self._trace_end()

    def warn(self, *, redelivered: bool) -> None:
        """Publish the pending warning, and send it to the payload if it is connected."""
        if self.pending_warning is None:
            return
        cut_at, cause, lead = self.pending_warning
        assert cause is not None  # a warning announces a cut, and every cut has a cause
        now = time.monotonic()
        remaining_trace = max(0.0, cut_at - self.clock.trace_s(now))
        message = m.ShutdownWarning(
            trace_time_s=self.clock.clock_s(now),
            lead_time_s=remaining_trace * self.clock.scale,
            cause=TRACE_CAUSE[cause],
        )
        packet = self.io.bus_packet(message)
        self.io.publish(packet)
        delivered = self.io.to_payload(packet)
        self.io.buslog.write(
            bl.WARNING,
            **self.io.stamp(now),
            cause=TRACE_CAUSE[cause].value,
            trace_cause=cause.value,
            lead_trace_s=round(lead, 6),
            remaining_trace_s=round(remaining_trace, 6),
            lead_clock_s=round(remaining_trace * self.clock.scale, 6),
            cut_at_trace_s=cut_at,
            delivered=delivered,
            redelivered=redelivered,
        )
        _log.info(
            "bus_shutdown_warning",
            lead_s=message.lead_time_s,
            cause=message.cause.value,
            delivered=delivered,
            redelivered=redelivered,
        )

    def _trace_end(self) -> None:
        self.telemetry.trace_end()
        self.io.buslog.write(bl.TRACE_END, **self.io.stamp(), action="stop" if self.config.stop_at_end else "keep_on")
        _log.info("bus_trace_end", stop=self.config.stop_at_end)
        # Off with the bus that stops now, or kept powered from now on so that queued work can finish.
        self.power.trace_end(self.config.stop_at_end)
        if self.config.stop_at_end:
            self.stop.request("trace_end")

    def skip_idle(self, now: float) -> None:
        """Jump the trace clock to the next trace action when nothing can happen before it."""
        if not self.actions:
            return
        target = self.actions[0].trace_s
        trace_now = self.clock.trace_s(now)
        holds = [h for h in self.config.hold_at_s if h > trace_now]
        if holds:
            target = min(target, min(holds))
        if target <= trace_now:
            return
        switch, link = self.io.switch, self.link
        off_waiting = not switch.is_on() and not self.power.trace_on and self.actions[0].kind == "power_on"
        idle = (
            switch.is_on()
            and link.payload_rid is not None
            and link.payload_idle_since is not None
            and now - link.payload_idle_since > IDLE_CONFIRM_S
            and not len(self.io.store.pending())
            and link.payload_queue_depth == 0
        )
        if not (off_waiting or idle):
            return
        delta = self.clock.at(target) - now
        if delta < SKIP_MIN_S:
            return
        self.clock.t0 -= delta
        self.io.buslog.write(
            bl.CLOCK_SKIP,
            **self.io.stamp(),
            from_trace_s=round(trace_now, 3),
            to_trace_s=round(target, 3),
            reason="payload off" if off_waiting else "payload idle",
        )

    def next_due(self, now: float) -> float:
        """Wall seconds until the next trace action (at most POLL_MAX_S)."""
        due = now + POLL_MAX_S
        if self.actions:
            due = min(due, self.clock.at(self.actions[0].trace_s))
        return max(0.0, due - now)
