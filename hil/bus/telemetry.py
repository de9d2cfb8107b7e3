"""Telemetry: power, thermal and FDIR reports on the telemetry link at the trace's pace, decimated to
at most `telemetry_max_hz`; power and thermal rounds also go to a connected payload
(docs/bus.md §4)."""

from __future__ import annotations

import math

from common.wire import FdirMode
from common.wire import messages as m
from hil.bus.base import BusBase, Pacer
from hil.bus.config import BusConfig
from hil.bus.power import PowerSwitch


class TelemetryPart(BusBase):
    """The telemetry rounds and the FDIR channels they report."""

    def __init__(self, config: BusConfig, switch: PowerSwitch | None = None, pacer: Pacer | None = None):
        super().__init__(config, switch, pacer)
        # FDIR telemetry channels (set by the power and FDIR part)
        self.fdir_mode = FdirMode.NOMINAL
        self.fault_count = 0
        self.last_fault: str | None = None
        # telemetry decimation: one report per `tm_step` trace seconds
        period = self.trace.telemetry_period_s or 1.0
        min_wall = 1.0 / config.telemetry_max_hz
        self.tm_step = period * max(1, math.ceil(min_wall / (period * config.time_scale) - 1e-9))
        self.next_tm_trace = math.ceil(config.start_at_s / self.tm_step - 1e-9) * self.tm_step
        self.next_tm_after_end = 0.0
        self.last_sample = self.trace.telemetry_at(config.start_at_s)

    def _publish_power_report(self, now: float, to_payload: bool = False) -> None:
        sample = self.last_sample
        if (
            sample is None
            or sample.bus_voltage_v is None
            or sample.battery_soc is None
            or sample.payload_power_w is None
        ):
            return  # the trace did not measure these channels: nothing honest to report
        packet = self._bus_packet(
            m.PowerReport(
                trace_time_s=self.clock.clock_s(now),
                payload_on=self.switch.is_on(),
                bus_voltage_v=sample.bus_voltage_v,
                payload_power_w=sample.payload_power_w,
                battery_soc=sample.battery_soc,
            )
        )
        self._publish(packet)
        if to_payload:
            self._to_payload(packet)

    def _publish_fdir(self) -> None:
        self._publish(
            self._bus_packet(
                m.FdirReport(
                    trace_time_s=self.clock.clock_s(),
                    mode=self.fdir_mode,
                    fault_count=self.fault_count,
                    last_fault=self.last_fault,
                )
            )
        )

    def _telemetry_tick(self, now: float) -> None:
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
        self._publish_power_report(now, to_payload=True)
        sample = self.last_sample
        if sample is not None and sample.payload_temp_c is not None:
            packet = self._bus_packet(
                m.ThermalReport(
                    trace_time_s=self.clock.clock_s(now),
                    payload_temp_c=sample.payload_temp_c,
                    bus_temp_c=self.config.bus_temp_c,
                )
            )
            self._publish(packet)
            self._to_payload(packet)
        self._publish_fdir()
