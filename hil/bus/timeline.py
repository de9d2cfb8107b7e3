"""The trace timeline: the trace's power-ons, warnings and cuts when they fall due, its end, and
skip-idle's jumps of the clock over spans where nothing can happen (docs/bus.md §1, §2)."""

from __future__ import annotations

import time
from collections import deque

import traces
from common import log
from common.wire import messages as m
from common.wire.errors import RequestRef
from hil.bus import buslog as bl
from hil.bus.base import BusIO, GroundExchanges, PayloadLink, StopRequest, request_fields
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
#: skip-idle mode: how long the ground link must have been quiet -- no ground command taken or
#: forwarded, no answer of the payload routed -- before an idle payload's time may be skipped.
#: Wall seconds, not trace seconds: it covers the ground's turn between an answer and its next
#: command (an image upload is many such turns), which is a real process on this machine's
#: clock, neither compressed by --time-scale nor moved by a skip (docs/bus.md §1).
GROUND_QUIET_S = 2.0


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
        exchanges: GroundExchanges,
    ):
        self.config = config
        self.clock = clock
        self.io = io
        self.link = link
        self.power = power
        self.telemetry = telemetry
        self.stop = stop
        #: the ground's exchanges with the payload: skip-idle waits for them
        self.exchanges = exchanges
        #: the waiting stations (source ids) last written in a `skip_held` line
        self.held_logged: frozenset[int] = frozenset()
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
        """Jump the trace clock to the next trace action when nothing can happen before it: the
        payload is off until that action powers it, or it is on and idle while the ground is
        quiet and no station waits for an answer a cut took (docs/bus.md §1)."""
        if not self.actions or self.clock.held_at is not None:
            return  # a held clock is a pacer's or hold_for_connect's: not skip-idle's to move
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
            and self.exchanges.quiet_s(now) >= GROUND_QUIET_S
        )
        if idle and self.exchanges.waiting:
            self._log_held(now)
            return
        if not self.exchanges.waiting:
            self.held_logged = frozenset()
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

    def _log_held(self, now: float) -> None:
        """A `skip_held` line when the payload is idle but stations wait for answers a cut took
        (once for each set of them)."""
        waiting = self.exchanges.waiting
        if frozenset(waiting) == self.held_logged:
            return
        self.held_logged = frozenset(waiting)
        stations = [
            {
                "source": source,
                "station": wait.name,
                "waiting_s": round(now - wait.since, 3),
                "owed": [request_fields(RequestRef(*key)) for key in sorted(wait.owed)],
            }
            for source, wait in sorted(waiting.items())
        ]
        self.io.buslog.write(
            bl.SKIP_HELD,
            **self.io.stamp(now),
            reason="the payload is idle, but a cut took answers these stations wait for; "
            "they will ask again after their own time-out",
            stations=stations,
        )
        _log.info("bus_skip_held", stations=[s["source"] for s in stations])

    def next_due(self, now: float) -> float:
        """Wall seconds until the next trace action (at most POLL_MAX_S)."""
        due = now + POLL_MAX_S
        if self.actions:
            due = min(due, self.clock.at(self.actions[0].trace_s))
        return max(0.0, due - now)
