"""Power and FDIR: the payload's power switch follows the trace unless FDIR holds it off; FDIR
power-cycles a payload that exits by itself, does not boot or stops its heartbeat (docs/bus.md §2, §3, §6).
Also how the switch is built for each driver (local process, ssh, commands)."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Sequence

from common import log
from common.wire import FdirMode, PowerCause
from common.wire import messages as m
from common.wire.ids import MAX_EVENT_TEXT_BYTES
from common.wire.text import clip_utf8
from hil import buslog as bl
from hil.bus.base import Pacer
from hil.bus.config import REMOTE_PAYLOAD_COMMAND, BusConfig, default_payload_command, expand_command
from hil.bus.telemetry import TelemetryPart
from hil.power import (
    CommandSwitch,
    LocalProcessSwitch,
    PowerSwitch,
    PowerSwitchError,
    SshSwitch,
    process_write_bytes,
)
from hil.zygote import FLIGHT_PRELOAD, Zygote

_log = log.get("hil.bus")

#: After a power switch failed, wall seconds before it is tried again.
SWITCH_RETRY_S = 1.0


class PowerPart(TelemetryPart):
    """The power switch, the trace's wish for it, and FDIR's hold on it."""

    def __init__(self, config: BusConfig, switch: PowerSwitch | None = None, pacer: Pacer | None = None):
        super().__init__(config, switch, pacer)
        #: what the trace wants now (the timeline sets it) and why the payload is off
        self.trace_on = self.trace.is_on_at(config.start_at_s)
        self.off_cause = PowerCause.TRACE
        self.off_origin = "trace"
        #: FDIR keeps the payload off until then (monotonic time)
        self.fdir_hold_until = 0.0
        self.next_switch_attempt = 0.0
        self.powered_at: float | None = None
        self.power_count = 0
        #: whether the payload's last power-off was FDIR's answer to a payload failure (told to the
        #: next boot: its health and safety counts only such exits against what it was handling)
        self.last_off_fault = False

    def payload_argv(self, template: Sequence[str] | None = None, payload_endpoint: str | None = None) -> list[str]:
        """The flight process's command line (for the ssh driver: the remote one)."""
        cfg = self.config
        values = {
            "python": sys.executable,
            "payload_data_dir": cfg.payload_data_dir or str(self.data_dir / "payload"),
            "bus_data_dir": str(self.data_dir),
            "model": cfg.model,
            "keys": cfg.payload_keys_dir or str(cfg.keys_dir),
            "payload_endpoint": payload_endpoint or self.payload_connect_endpoint,
        }
        if template is None:
            template = cfg.payload_command or (
                REMOTE_PAYLOAD_COMMAND if cfg.power_driver == "ssh" else default_payload_command()
            )
        return expand_command(template, values, cfg.flight_args)

    def _build_switch(self) -> PowerSwitch:
        cfg = self.config
        if cfg.power_driver == "local":
            zygote, boot_s = None, 0.0
            if cfg.boot_trace_s is not None:
                zygote = Zygote(cfg.zygote_preload or FLIGHT_PRELOAD, log_path=self.data_dir / "zygote.log").start()
                boot_s = cfg.boot_trace_s * cfg.time_scale
            return LocalProcessSwitch(
                self.payload_argv(),
                output_path=self.data_dir / bl.PAYLOAD_LOG_FILE,
                pidfile=self.data_dir / "payload.pid",
                zygote=zygote,
                boot_s=boot_s,
            )
        if cfg.power_driver == "ssh":
            kwargs = {}
            if cfg.ssh_reboot_command:
                kwargs["reboot_command"] = cfg.ssh_reboot_command
            return SshSwitch(
                shlex.join(self.payload_argv()),
                host=cfg.ssh_host,
                user=cfg.ssh_user,
                port=cfg.ssh_port,
                identity=cfg.ssh_identity,
                ssh_options=cfg.ssh_options,
                transport=cfg.ssh_transport,
                mode=cfg.ssh_mode,
                pidfile=cfg.ssh_pidfile,
                kill_command=cfg.ssh_kill_command,
                output_path=self.data_dir / bl.PAYLOAD_LOG_FILE,
                timeout_s=cfg.switch_timeout_s,
                **kwargs,
            )
        on_command, off_command = cfg.power_on_command, cfg.power_off_command
        assert on_command and off_command  # BusConfig.validate() insists on both for this driver
        return CommandSwitch(on_command, off_command, timeout_s=cfg.switch_timeout_s)

    def _desired_on(self, now: float) -> bool:
        return self.trace_on and now >= self.fdir_hold_until and not self._stop.is_set()

    def _reconcile_power(self, now: float, force: bool = False) -> None:
        desired = self._desired_on(now)
        if desired == self.switch.is_on():
            return
        if not force and now < self.next_switch_attempt:
            return
        if desired:
            self._power_on()
        else:
            self._power_off(self.off_cause, self.off_origin)

    def _switch_failed(self, action: str, exc: Exception) -> None:
        self.next_switch_attempt = time.monotonic() + SWITCH_RETRY_S
        self.fault_count += 1
        self.last_fault = clip_utf8(f"power switch {action} failed: {exc}", MAX_EVENT_TEXT_BYTES)
        self.buslog.write(bl.SWITCH_ERROR, **self._stamp(), action=action, error=str(exc)[:500])
        _log.error("bus_power_switch_failed", action=action, error=str(exc))
        self._publish_fdir()

    def _power_on(self) -> None:
        now = time.monotonic()  # the moment power is applied; spawning takes a few ms more
        try:
            self.switch.on()
        except PowerSwitchError as exc:
            self._switch_failed("on", exc)
            return
        self.power_count += 1
        self.powered_at = now
        if self.config.hold_for_connect:
            self.clock.hold(now)  # released when the payload connects or is cut
        self.payload_rid = None
        self.last_seen = None
        self.gap_reported = False
        if self.fdir_mode is FdirMode.SAFE:
            self.fdir_mode = FdirMode.NOMINAL
        self.buslog.write(
            bl.POWER_ON,
            **self._stamp(now),
            cause=PowerCause.RESTORED.value,
            power_cycle=self.power_count,
            pid=self.switch.pid,
        )
        _log.info(
            "bus_power_on", trace_s=round(self.clock.trace_s(now), 3), pid=self.switch.pid, cycle=self.power_count
        )
        self._publish(
            self._bus_packet(
                m.PowerStateChange(trace_time_s=self.clock.clock_s(now), payload_on=True, cause=PowerCause.RESTORED)
            )
        )
        self._publish_power_report(now)

    def _power_off(self, cause: PowerCause, origin: str) -> None:
        pid = self.switch.pid
        was_on = self.switch.is_on()
        write_bytes = process_write_bytes(pid) if self.config.power_driver == "local" else None
        now = time.monotonic()  # the moment of the cut: SIGKILL goes out right after this
        try:
            self.switch.off(cause.value)
        except PowerSwitchError as exc:
            self._switch_failed("off", exc)
            return
        self.payload_rid = None
        self.powered_at = None
        self.last_off_fault = origin == "fdir"
        if self.config.hold_for_connect:
            self.clock.release(now)
        self.buslog.write(
            bl.POWER_OFF,
            **self._stamp(now),
            cause=cause.value,
            origin=origin,
            pid=pid,
            was_on=was_on,
            power_cycle=self.power_count,
            payload_write_bytes=write_bytes,
        )
        _log.info("bus_power_off", trace_s=round(self.clock.trace_s(now), 3), cause=cause.value, origin=origin, pid=pid)
        self._publish(
            self._bus_packet(m.PowerStateChange(trace_time_s=self.clock.clock_s(now), payload_on=False, cause=cause))
        )
        self._publish_power_report(now)

    def _fdir(self, reason: str, now: float) -> None:
        """Power-cycle the payload: cut it now, power it again after fdir_off_s (if the trace
        still has it on then)."""
        self.fault_count += 1
        self.last_fault = clip_utf8(reason, MAX_EVENT_TEXT_BYTES)
        self.fdir_mode = FdirMode.SAFE
        self.buslog.write(
            bl.FDIR_ACTION,
            **self._stamp(now),
            action="power_cycle",
            reason=reason,
            off_s=self.config.fdir_off_s,
            fault_count=self.fault_count,
        )
        _log.warning("bus_fdir_power_cycle", reason=reason, fault_count=self.fault_count)
        self.fdir_hold_until = now + self.config.fdir_off_s
        self._power_off(PowerCause.FDIR, "fdir")
        self._publish_fdir()

    def _watch_payload(self, now: float) -> None:
        if not self.switch.is_on():
            return
        status = self.switch.poll()
        if status is not None:
            self.buslog.write(bl.PAYLOAD_EXITED, **self._stamp(now), status=status, power_cycle=self.power_count)
            _log.warning("bus_payload_exited", status=status)
            self._fdir(f"payload process exited by itself with status {status}", now)
            return
        cfg = self.config
        if self.payload_rid is None:
            if cfg.boot_timeout_s and self.powered_at is not None and now - self.powered_at > cfg.boot_timeout_s:
                self.buslog.write(
                    bl.HEARTBEAT_GAP,
                    **self._stamp(now),
                    gap_s=round(now - self.powered_at, 3),
                    action="power_cycle",
                    phase="boot",
                )
                self._fdir(f"no heartbeat within {cfg.boot_timeout_s:g} s of power-on", now)
            return
        assert self.last_seen is not None  # set whenever payload_rid is
        silent = now - self.last_seen
        if cfg.heartbeat_timeout_s and silent > cfg.heartbeat_timeout_s:
            self.buslog.write(
                bl.HEARTBEAT_GAP, **self._stamp(now), gap_s=round(silent, 3), action="power_cycle", phase="running"
            )
            self._fdir(f"no heartbeat for {silent:.1f} s", now)
        elif silent > cfg.heartbeat_gap_log_s and not self.gap_reported:
            self.gap_reported = True
            self.fdir_mode = FdirMode.DEGRADED
            self._publish_fdir()
