"""Telemetry: power, thermal and FDIR reports on the telemetry link at the trace's pace, decimated to
at most `telemetry_max_hz`; power and thermal rounds also go to a connected payload
(docs/bus.md §4)."""

from __future__ import annotations

import math

import traces
from common.wire import messages as m
from hil.bus.base import BusIO, FdirChannels
from hil.bus.clock import TraceClock
from hil.bus.config import BusConfig


class Telemetry:
    """The telemetry rounds, and the FDIR channels they report (set by power and FDIR)."""

    def __init__(self, config: BusConfig, trace: traces.Trace, clock: TraceClock, io: BusIO, fdir: FdirChannels):
        self.config = config
        self.trace = trace
        self.clock = clock
        self.io = io
        self.fdir = fdir
        #: the trace has run out (the timeline says so: `trace_end`); telemetry then repeats the
        #: last sample once per wall second
        self.trace_ended = False
        # telemetry decimation: one report per `tm_step` trace seconds
        period = self.trace.telemetry_period_s or 1.0
        min_wall = 1.0 / config.telemetry_max_hz
        self.tm_step = period * max(1, math.ceil(min_wall / (period * config.time_scale) - 1e-9))
        self.next_tm_trace = math.ceil(config.start_at_s / self.tm_step - 1e-9) * self.tm_step
        self.next_tm_after_end = 0.0
        self.last_sample = self.trace.telemetry_at(config.start_at_s)

    def trace_end(self) -> None:
        self.trace_ended = True

    def publish_power_report(self, now: float, to_payload: bool = False) -> None:
        sample = self.last_sample
        if (
            sample is None
            or sample.bus_voltage_v is None
            or sample.battery_soc is None
            or sample.payload_power_w is None
        ):
            return  # the trace did not measure these channels: nothing honest to report
        packet = self.io.bus_packet(
            m.PowerReport(
                trace_time_s=self.clock.clock_s(now),
                payload_on=self.io.switch.is_on(),
                bus_voltage_v=sample.bus_voltage_v,
                payload_power_w=sample.payload_power_w,
                battery_soc=sample.battery_soc,
            )
        )
        self.io.publish(packet)
        if to_payload:
            self.io.to_payload(packet)

    def publish_fdir(self) -> None:
        fdir = self.fdir
        self.io.publish(
            self.io.bus_packet(
                m.FdirReport(
                    trace_time_s=self.clock.clock_s(),
                    mode=fdir.mode,
                    fault_count=fdir.fault_count,
                    last_fault=fdir.last_fault,
                )
            )
        )

    def tick(self, now: float) -> None:
        """A telemetry round if one is due: power and thermal (also to the payload), FDIR."""
        if self.trace_ended:
            # After the trace: the last sample, once per wall second.
            if now < self.next_tm_after_end:
                return
            self.next_tm_after_end = now + 1.0
        else:
            if now < self.clock.at(self.next_tm_trace):
                return
            trace_s = self.clock.trace_s(now)
            # Behind by more than a step (a stalled loop): skip ahead rather than burst.
            while self.clock.at(self.next_tm_trace) <= now:
                self.next_tm_trace += self.tm_step
            sample = self.trace.telemetry_at(min(trace_s, self.trace.duration_s))
            if sample is not None:
                self.last_sample = sample
        # Power and thermal rounds also go to a connected payload: the trends towards the limits
        # that end its windows are what its checkpoint cadence plans with (docs/engine.md).
        self.publish_power_report(now, to_payload=True)
        sample = self.last_sample
        if sample is not None and sample.payload_temp_c is not None:
            packet = self.io.bus_packet(
                m.ThermalReport(
                    trace_time_s=self.clock.clock_s(now),
                    payload_temp_c=sample.payload_temp_c,
                    bus_temp_c=self.config.bus_temp_c,
                )
            )
            self.io.publish(packet)
            self.io.to_payload(packet)
        self.publish_fdir()
