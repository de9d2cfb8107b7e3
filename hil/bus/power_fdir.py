"""Power and FDIR: the payload's power switch follows the trace unless FDIR holds it off; FDIR
power-cycles a payload that exits by itself, does not boot or stops its heartbeat (docs/bus.md §2, §3, §6).
The boot-loop guard holds off a payload that keeps failing to come up (§6), naming the reason its
last boot gave. Also how the switch is built for each driver (local process, ssh, commands)."""

from __future__ import annotations

import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import traces
from common import bootrecord, log
from common.wire import EventId, FdirMode, PowerCause
from common.wire import messages as m
from common.wire.ids import MAX_EVENT_TEXT_BYTES
from common.wire.text import clip_utf8
from hil.bus import buslog as bl
from hil.bus.base import BusIO, FdirChannels, PayloadLink, StopRequest
from hil.bus.clock import TraceClock
from hil.bus.config import REMOTE_PAYLOAD_COMMAND, BusConfig, default_payload_command, expand_command
from hil.bus.power import (
    CommandSwitch,
    LocalProcessSwitch,
    PowerSwitch,
    PowerSwitchError,
    SshSwitch,
    process_write_bytes,
)
from hil.bus.telemetry import Telemetry
from hil.bus.zygote import FLIGHT_PRELOAD, Zygote

_log = log.get("hil.bus")

#: After a power switch failed, wall seconds before it is tried again.
SWITCH_RETRY_S = 1.0
#: The boot-loop guard's back-off doubles at each hold in a row up to this (or the base, if larger).
BOOT_LOOP_BACKOFF_MAX_S = 3600.0


def describe_exit(status: int, driver: str) -> str:
    """What an exit status says of how a payload process ended, in words."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    if driver == "ssh" and status == 255:
        return "ssh session ended with status 255 (connection lost, or the payload killed by a signal)"
    return f"exited with status {status}"


class PowerFdir:
    """The power switch, the trace's wish for it, and FDIR's hold on it; the boot-loop guard."""

    def __init__(
        self,
        config: BusConfig,
        trace: traces.Trace,
        clock: TraceClock,
        io: BusIO,
        link: PayloadLink,
        fdir: FdirChannels,
        telemetry: Telemetry,
        stop: StopRequest,
    ):
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.trace = trace
        self.clock = clock
        self.io = io
        self.link = link
        self.fdir = fdir
        self.telemetry = telemetry
        self.stop = stop
        #: where the payload connects to the bus (the bound payload endpoint, or the configured
        #: one), known once the bus has bound its sockets (`build_switch`)
        self.payload_connect_endpoint: str | None = None
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
        # The boot-loop guard (docs/bus.md §6): failed boots and holds in a row, the hold (until
        # `held_until`, monotonic; None: until the ground's PAYLOAD_RETRY), this boot's first
        # packet and where its output starts in payload.log (for its boot-failure record).
        self.failed_boots = 0
        self.boot_holds = 0
        self.held_off = False
        self.held_until: float | None = None
        self.held_since = 0.0
        self.connected_at: float | None = None
        self.boot_up = False
        self.boot_output_offset: int | None = None

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

    def build_switch(self, payload_endpoint: str) -> PowerSwitch:
        """The power switch of the configured driver, for a payload that connects to
        `payload_endpoint`."""
        self.payload_connect_endpoint = payload_endpoint
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
        return self.trace_on and now >= self.fdir_hold_until and not self.held_off and not self.stop.is_set()

    def reconcile(self, now: float, force: bool = False) -> None:
        if self.held_off and self.held_until is not None and now >= self.held_until:
            self.retry_payload("backoff")
        desired = self._desired_on(now)
        if desired == self.io.switch.is_on():
            return
        if not force and now < self.next_switch_attempt:
            return
        if desired:
            self._power_on()
        elif self.stop.is_set() and self.trace_on:
            # The bus is stopping: the payload goes off with the bus, as _shutdown says, not with
            # the cause of the trace's last cut (left in off_cause): a testbench run counted such
            # a power-off, after its last request, as a cut when the loop got here first.
            origin = "end" if self.stop.reason == "trace_end" else "shutdown"
            self.power_off(PowerCause.TRACE if origin == "end" else PowerCause.COMMANDED, origin)
        else:
            self.power_off(self.off_cause, self.off_origin)

    # ---- the trace's wish for the switch (the timeline tells it) -------------------------------
    def trace_power_on(self, now: float) -> None:
        self.trace_on = True
        self.reconcile(now, force=True)

    def trace_cut(self, cause: PowerCause, now: float) -> None:
        self.trace_on = False
        self.off_cause, self.off_origin = cause, "trace"
        self.reconcile(now, force=True)

    def trace_end(self, stop_at_end: bool) -> None:
        """The trace ran out: the payload goes off with the bus that stops now, or stays on from
        now on (queued work can finish)."""
        if stop_at_end:
            self.off_cause, self.off_origin = PowerCause.TRACE, "end"
        else:
            self.trace_on = True

    def switch_failed(self, action: str, exc: Exception) -> None:
        self.next_switch_attempt = time.monotonic() + SWITCH_RETRY_S
        self.fdir.fault_count += 1
        self.fdir.last_fault = clip_utf8(f"power switch {action} failed: {exc}", MAX_EVENT_TEXT_BYTES)
        self.io.buslog.write(bl.SWITCH_ERROR, **self.io.stamp(), action=action, error=str(exc)[:500])
        _log.error("bus_power_switch_failed", action=action, error=str(exc))
        self.telemetry.publish_fdir()

    def _power_on(self) -> None:
        now = time.monotonic()  # the moment power is applied; spawning takes a few ms more
        output_offset = self._payload_output_size()
        try:
            self.io.switch.on()
        except PowerSwitchError as exc:
            self.switch_failed("on", exc)
            return
        self.power_count += 1
        self.powered_at = now
        self.connected_at, self.boot_up = None, False
        self.boot_output_offset = output_offset
        if self.config.hold_for_connect:
            self.clock.hold(now)  # released when the payload connects or is cut
        self.link.payload_rid = None
        self.link.last_seen = None
        self.link.gap_reported = False
        if self.fdir.mode is FdirMode.SAFE:
            self.fdir.mode = FdirMode.NOMINAL
        self.io.buslog.write(
            bl.POWER_ON,
            **self.io.stamp(now),
            cause=PowerCause.RESTORED.value,
            power_cycle=self.power_count,
            pid=self.io.switch.pid,
        )
        _log.info(
            "bus_power_on", trace_s=round(self.clock.trace_s(now), 3), pid=self.io.switch.pid, cycle=self.power_count
        )
        self.io.publish(
            self.io.bus_packet(
                m.PowerStateChange(trace_time_s=self.clock.clock_s(now), payload_on=True, cause=PowerCause.RESTORED)
            )
        )
        self.telemetry.publish_power_report(now)

    def power_off(self, cause: PowerCause, origin: str) -> None:
        pid = self.io.switch.pid
        was_on = self.io.switch.is_on()
        write_bytes = process_write_bytes(pid) if self.config.power_driver == "local" else None
        now = time.monotonic()  # the moment of the cut: SIGKILL goes out right after this
        try:
            self.io.switch.off(cause.value)
        except PowerSwitchError as exc:
            self.switch_failed("off", exc)
            return
        self.link.payload_rid = None
        self.powered_at = None
        self.connected_at = None
        self.last_off_fault = origin == "fdir"
        if self.config.hold_for_connect:
            self.clock.release(now)
        self.io.buslog.write(
            bl.POWER_OFF,
            **self.io.stamp(now),
            cause=cause.value,
            origin=origin,
            pid=pid,
            was_on=was_on,
            power_cycle=self.power_count,
            payload_write_bytes=write_bytes,
        )
        _log.info("bus_power_off", trace_s=round(self.clock.trace_s(now), 3), cause=cause.value, origin=origin, pid=pid)
        self.io.publish(
            self.io.bus_packet(m.PowerStateChange(trace_time_s=self.clock.clock_s(now), payload_on=False, cause=cause))
        )
        self.telemetry.publish_power_report(now)

    def _fdir(self, reason: str, now: float) -> None:
        """Power-cycle the payload: cut it now, power it again after fdir_off_s (if the trace
        still has it on then)."""
        self.fdir.fault_count += 1
        self.fdir.last_fault = clip_utf8(reason, MAX_EVENT_TEXT_BYTES)
        self.fdir.mode = FdirMode.SAFE
        self.io.buslog.write(
            bl.FDIR_ACTION,
            **self.io.stamp(now),
            action="power_cycle",
            reason=reason,
            off_s=self.config.fdir_off_s,
            fault_count=self.fdir.fault_count,
        )
        _log.warning("bus_fdir_power_cycle", reason=reason, fault_count=self.fdir.fault_count)
        self.fdir_hold_until = now + self.config.fdir_off_s
        self.power_off(PowerCause.FDIR, "fdir")
        self.telemetry.publish_fdir()

    def watch(self, now: float) -> None:
        if not self.io.switch.is_on():
            return
        if not self.boot_up and self.connected_at is not None and now - self.connected_at >= self.config.boot_settle_s:
            self.boot_came_up()
        status = self.io.switch.poll()
        if status is not None:
            self.io.buslog.write(bl.PAYLOAD_EXITED, **self.io.stamp(now), status=status, power_cycle=self.power_count)
            _log.warning("bus_payload_exited", status=status)
            # Judged before the cut forgets the boot; its output is read only for a boot not yet up.
            failed = None if self.boot_up else self._boot_failure(now, self._exit_reason(status))
            self._fdir(f"payload process exited by itself with status {status}", now)
            if failed is not None:
                self._count_failed_boot(failed, now, status=status)
            return
        cfg = self.config
        if self.link.payload_rid is None:
            if cfg.boot_timeout_s and self.powered_at is not None and now - self.powered_at > cfg.boot_timeout_s:
                self.io.buslog.write(
                    bl.HEARTBEAT_GAP,
                    **self.io.stamp(now),
                    gap_s=round(now - self.powered_at, 3),
                    action="power_cycle",
                    phase="boot",
                )
                failed = (
                    f"never connected within {cfg.boot_timeout_s:g} s of power-on (boot timeout)"
                    if self.connected_at is None
                    else self._boot_failure(now, "its link lost and not back within the boot timeout")
                )
                self._fdir(f"no heartbeat within {cfg.boot_timeout_s:g} s of power-on", now)
                if failed is not None:
                    self._count_failed_boot(failed, now)
            return
        assert self.link.last_seen is not None  # set whenever payload_rid is
        silent = now - self.link.last_seen
        if cfg.heartbeat_timeout_s and silent > cfg.heartbeat_timeout_s:
            self.io.buslog.write(
                bl.HEARTBEAT_GAP, **self.io.stamp(now), gap_s=round(silent, 3), action="power_cycle", phase="running"
            )
            failed = self._boot_failure(now, f"silent for {silent:.1f} s")
            self._fdir(f"no heartbeat for {silent:.1f} s", now)
            if failed is not None:
                self._count_failed_boot(failed, now)
        elif silent > cfg.heartbeat_gap_log_s and not self.link.gap_reported:
            self.link.gap_reported = True
            self.fdir.mode = FdirMode.DEGRADED
            self.telemetry.publish_fdir()

    # ---- the boot-loop guard (docs/bus.md §6) ---------------------------------------------------------
    def boot_connected(self, now: float) -> None:
        """A new payload connection (the relay calls this): the boot's first packet, unless it
        connected before in this boot."""
        if self.connected_at is None and self.powered_at is not None:
            self.connected_at = now

    def boot_came_up(self) -> None:
        """This boot has been connected boot_settle_s, or reported a unit of a task's work: it came
        up, and the count starts afresh."""
        self.boot_up = True
        if self.failed_boots or self.boot_holds:
            _log.info("bus_payload_came_up", after_failed_boots=self.failed_boots, holds=self.boot_holds)
        self.failed_boots = self.boot_holds = 0

    def _boot_failure(self, now: float, what: str) -> str | None:
        """`what` ended this boot: the reason it failed to come up, or None if it had come up (or
        was never one of ours to judge: the guard only watches boots the switch started)."""
        if self.powered_at is None or self.boot_up:
            return None
        if self.connected_at is None:
            return f"{what}, before it connected"
        return f"{what}, {now - self.connected_at:.1f} s after it connected"

    def _payload_output_size(self) -> int | None:
        """Where the next boot's output starts in payload.log (drivers that keep the output)."""
        if self.config.power_driver == "command":
            return None  # a relay carries no output: the board's own logs have it
        try:
            return (self.data_dir / bl.PAYLOAD_LOG_FILE).stat().st_size
        except OSError:
            return 0

    def _exit_reason(self, status: int) -> str:
        """Why the payload process ended: its boot-failure record (common/bootrecord.py) if this
        boot's output holds one, else what its exit status says."""
        record = None
        if self.boot_output_offset is not None:
            try:
                with open(self.data_dir / bl.PAYLOAD_LOG_FILE, "rb") as f:
                    size = f.seek(0, 2)
                    f.seek(max(self.boot_output_offset, size - bootrecord.TAIL_BYTES))
                    record = bootrecord.find(f.read().decode("utf-8", "replace"))
            except OSError:
                record = None
        if record is not None:
            return f"{record[0]} (exit status {status})"
        return describe_exit(status, self.config.power_driver)

    def _count_failed_boot(self, reason: str, now: float, status: int | None = None) -> None:
        """One more boot that failed to come up; at boot_loop_limit in a row, hold the payload off."""
        cfg = self.config
        self.failed_boots += 1
        self.io.buslog.write(
            bl.PAYLOAD_BOOT_FAILED,
            **self.io.stamp(now),
            failed_boots=self.failed_boots,
            reason=reason,
            status=status,
            power_cycle=self.power_count,
        )
        _log.warning("bus_payload_boot_failed", failed_boots=self.failed_boots, reason=reason)
        if not cfg.boot_loop_limit or self.failed_boots < cfg.boot_loop_limit:
            return
        self.boot_holds += 1
        backoff = None
        if cfg.boot_loop_backoff_s:
            ceiling = max(cfg.boot_loop_backoff_s, BOOT_LOOP_BACKOFF_MAX_S)
            backoff = min(cfg.boot_loop_backoff_s * 2 ** min(self.boot_holds - 1, 32), ceiling)
        self.held_off, self.held_since = True, now
        self.held_until = None if backoff is None else now + backoff
        until = (
            f"powered again in {backoff:g} s or on the ground's PAYLOAD_RETRY"
            if backoff is not None
            else "powered again on the ground's PAYLOAD_RETRY"
        )
        text = clip_utf8(
            f"boot loop: payload held off after {self.failed_boots} failed boots in a row; last: {reason}; {until}",
            MAX_EVENT_TEXT_BYTES,
        )
        self.fdir.mode, self.fdir.last_fault = FdirMode.SAFE, text
        self.io.bus_event(
            EventId.PAYLOAD_BOOT_LOOP,
            text,
            failed_boots=self.failed_boots,
            holds=self.boot_holds,
            reason=reason,
            backoff_s=backoff,
        )
        self.telemetry.publish_fdir()

    def retry_payload(self, origin: str, **fields) -> bool:
        """End the boot-loop hold (`origin`: "ground" for PAYLOAD_RETRY, "backoff"): the payload
        is powered again as the trace allows. Its next boot is judged like any: one more failure
        holds it again, with the back-off doubled. Returns False if nothing was held."""
        if not self.held_off:
            return False
        now = time.monotonic()
        held_s = now - self.held_since
        self.held_off, self.held_until = False, None
        why = "the back-off expired" if origin == "backoff" else "the ground commanded PAYLOAD_RETRY"
        self.io.bus_event(
            EventId.PAYLOAD_RETRY,
            f"payload held off {held_s:.1f} s after a boot loop; {why}: powering it again",
            origin=origin,
            held_s=round(held_s, 3),
            failed_boots=self.failed_boots,
            **fields,
        )
        return True
